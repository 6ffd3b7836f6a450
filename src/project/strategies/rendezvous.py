"""Where the processes of a run meet, for every multi-process strategy of this project.

torch's default `env://` rendezvous waits up to the process-group timeout (30 minutes) without a word and
listens on every interface. Here rank 0's TCPStore listens only on MASTER_ADDR when all processes are on
one machine, ranks on several nodes say whom they wait for, and the wait ends after
`launch.rendezvous_timeout_s` with one line that names the fix. Under torchrun the agent's store is used.
"""

import logging
import os
import socket
from datetime import timedelta
from typing import Any

from project.errors import UserError

log = logging.getLogger(__name__)


def _listen_on(address: str, port: int) -> int:
    """A listening socket on `address` only; its descriptor is handed to (and closed by) the TCPStore."""
    try:
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        server = socket.create_server((address, port), family=family, backlog=128)
    except OSError as e:
        raise UserError(
            f"cannot listen on MASTER_ADDR={address} MASTER_PORT={port} ({e.strerror or e}): on one machine "
            "MASTER_ADDR must be an address of this machine (127.0.0.1), and MASTER_PORT a free port"
        ) from e
    return server.detach()


def connect(strategy: Any, timeout_s: int) -> None:
    """torch.distributed.init_process_group for `strategy` (a Lightning ParallelStrategy), through our store."""
    import torch.distributed as dist
    from lightning.fabric.utilities.distributed import _init_dist_connection

    backend = strategy._process_group_backend
    kwargs: dict[str, Any] = {"timeout": strategy._timeout}
    if strategy.root_device.type != "cpu":
        kwargs["device_id"] = strategy.root_device
    if dist.is_initialized():
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent hosts the store and already knows every rank
        _init_dist_connection(strategy.cluster_environment, backend, **kwargs)
        return
    env = strategy.cluster_environment
    address, port, rank, world = env.main_address, env.main_port, strategy.global_rank, strategy.world_size
    nodes = strategy.num_nodes
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    if nodes > 1:
        log.info(
            f"Node {strategy.node_rank}, rank {rank}: waiting for {world} processes on {nodes} nodes at "
            f"{address}:{port} (gives up after launch.rendezvous_timeout_s={timeout_s})"
        )
    listen_fd = _listen_on(address, port) if rank == 0 and nodes == 1 else None
    try:
        store = dist.TCPStore(
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
        reason = " ".join(str(e).split()).split(". ")[0]
        raise UserError(f"rank {rank} gave up: {waited} ({reason}); {fix}") from e
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world}")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
    if backend == "nccl":
        import atexit

        from lightning.fabric.utilities.distributed import _destroy_dist_connection

        atexit.register(_destroy_dist_connection)  # as Lightning does: torch warns about an undestroyed NCCL group
