"""Where a run's processes meet: torch's `env://` waits 30 minutes without a word, on every interface; here rank 0's
store listens on MASTER_ADDR (one machine) and the wait ends after `launch.rendezvous_timeout_s` with one line.
Under torchrun the agent's store outlives worker restarts, so a group built in it meets the previous attempt's keys
(pytorch#135712): rank 0 hosts a store per attempt, and the agent's store only says where it is."""

import logging
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Any

from engine.errors import UserError

log = logging.getLogger(__name__)


def listen_on(address: str, port: int, torchrun: bool = False) -> tuple[int, int]:
    """A listening socket on `address` only, and its port (0: a free one, as under torchrun); the descriptor is
    handed to (and closed by) the TCPStore."""
    try:
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        server = socket.create_server((address, port), family=family, backlog=128)
    except OSError as e:
        if torchrun:  # rank 0's own store, on a free port of MASTER_ADDR: no port the user chose
            raise UserError(
                f"cannot listen on MASTER_ADDR={address} ({e.strerror or e}): rank 0 hosts the run's store on a free "
                "port of MASTER_ADDR, which on one machine must be an address of this machine (127.0.0.1)"
            ) from e
        raise UserError(
            f"cannot listen on MASTER_ADDR={address} MASTER_PORT={port} ({e.strerror or e}): on one machine "
            "MASTER_ADDR must be an address of this machine (127.0.0.1), and MASTER_PORT a free port"
        ) from e
    port = server.getsockname()[1]
    return server.detach(), port


def connect(strategy: Any, timeout_s: int) -> None:
    """Lightning's setup_distributed for `strategy` (a ParallelStrategy), through our store."""
    import torch.distributed as dist
    from lightning.fabric.utilities.distributed import _init_dist_connection
    from lightning.fabric.utilities.seed import reset_seed

    reset_seed()
    strategy.set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()

    backend = strategy._process_group_backend
    kwargs: dict[str, Any] = {"timeout": strategy._timeout}
    if strategy.root_device.type != "cpu":
        kwargs["device_id"] = strategy.root_device
    if dist.is_initialized():
        return
    rank, world = strategy.global_rank, strategy.world_size
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = _store_of_this_attempt(rank, world, strategy.num_nodes, timeout_s)
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun without a shared store: rank 0 hosts one per attempt
        _init_dist_connection(strategy.cluster_environment, backend, **kwargs)
        return
    else:
        store = _store_at_master_port(strategy, timeout_s)
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world}")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
    if backend == "nccl":
        import atexit

        from lightning.fabric.utilities.distributed import _destroy_dist_connection

        atexit.register(_destroy_dist_connection)  # as Lightning does: torch warns about an undestroyed NCCL group


def _store_at_master_port(strategy: Any, timeout_s: int) -> Any:
    """Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT; everyone waits there for all `world` processes."""
    import torch.distributed as dist

    env = strategy.cluster_environment
    address, port, rank, world = env.main_address, env.main_port, strategy.global_rank, strategy.world_size
    nodes = strategy.num_nodes
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    if nodes > 1:
        log.info(
            f"Node {strategy.node_rank}, rank {rank}: waiting for {world} processes on {nodes} nodes at "
            f"{address}:{port} (gives up after launch.rendezvous_timeout_s={timeout_s})"
        )
    listen_fd = listen_on(address, port)[0] if rank == 0 and nodes == 1 else None
    try:
        return dist.TCPStore(
            address,
            port,
            world,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=True,
            master_listen_fd=listen_fd,
        )
    except (dist.DistStoreError, dist.DistNetworkError, RuntimeError) as e:
        waited = f"waited {timeout_s} s (launch.rendezvous_timeout_s) at {address}:{port} for {world} processes"
        if rank == 0:
            fix = (
                f"start the other nodes with MASTER_ADDR={address} MASTER_PORT={port} NODE_RANK=1..{nodes - 1}"
                if nodes > 1
                else "the other ranks did not start; see their logs (train_ddp_process_<n>.log in the run dir)"
            )
        else:
            fix = f"is node 0 running, with the same MASTER_ADDR={address} and MASTER_PORT={port}?"
        raise UserError(f"rank {rank} gave up: {waited} ({_first_sentence(e)}); {fix}") from e


WHERE = "project/store_of_this_attempt"  # in torchrun's agent store: "<port> <token>" of rank 0's store
TOKEN = "project/token"  # in rank 0's store


def _store_of_this_attempt(rank: int, world: int, nodes: int, timeout_s: int) -> Any:
    """Under torchrun: rank 0 hosts a new store and writes "<port> <token>" into the agent's; another rank takes an
    entry only once its store answers with its token (a dead rank 0's port refuses, a reused one has another)."""
    import torch.distributed as dist

    address, wait = os.environ["MASTER_ADDR"], timedelta(seconds=timeout_s)
    try:
        agent = dist.TCPStore(address, int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
        if rank == 0:
            # one node: MASTER_ADDR only; several: every interface
            listen_fd, port = listen_on(address, 0, torchrun=True) if nodes == 1 else (None, 0)
            store = dist.TCPStore(
                address, port, world, is_master=True, timeout=wait, wait_for_workers=False, master_listen_fd=listen_fd
            )
            token = secrets.token_hex(8)
            store.set(TOKEN, token)
            agent.set(WHERE, f"{store.port} {token}")
            return store
        deadline = time.monotonic() + timeout_s
        while True:
            entry, token = agent.get(WHERE).decode().split()
            try:
                store = dist.TCPStore(address, int(entry), is_master=False, timeout=timedelta(seconds=1))
                if store.get(TOKEN).decode() == token:
                    store.set_timeout(wait)
                    return store
            except (dist.DistError, RuntimeError):
                pass  # the previous attempt's rank 0, gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"no store of rank 0 answered at {address}:{entry}")
            time.sleep(0.1)
    except (dist.DistError, RuntimeError, TimeoutError) as e:
        raise UserError(
            f"rank {rank} gave up: waited {timeout_s} s (launch.rendezvous_timeout_s) for rank 0 of this torchrun "
            f"attempt ({_first_sentence(e)}); see rank 0's log"
        ) from e


def _first_sentence(error: BaseException) -> str:
    return " ".join(str(error).split()).split(". ")[0]
