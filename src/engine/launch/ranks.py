"""When a rank dies, the run ends within seconds with one line that names it and its log.

Lightning checks its children every 5 s, and the others end on gloo's "Connection reset by peer" with a traceback
naming only an address. Here rank 0 watches them every half second; the first to notice a death reports it once."""

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from engine.errors import say
from engine.launch import environment, second_signal

log = logging.getLogger(__name__)

_reported = threading.Event()
_dead: list[str] = []  # the line, once a child has died


def _describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def report_once(line: str) -> bool:
    """Print `error: <line>` unless a death was already reported; True if this call printed it."""
    if _reported.is_set():
        return False
    _reported.set()
    say(f"error: {line}")
    return True


def dead_rank(wait_s: float = 1.0) -> str | None:
    """The line about a dead child, waiting briefly for the watcher: rank 0's collective may fail first."""
    deadline = time.time() + wait_s
    while not _dead and time.time() < deadline:
        time.sleep(0.05)
    return _dead[0] if _dead else None


_GRACE_S = 5.0  # how long a child's exit 2 waits for rank 0 to end on the same mistake


def _last_error(log: Path, since: int) -> str | None:
    """The line a rank said as it ended (`... [ERROR] - error: <line>`, engine.errors.say), from what its log got
    after byte `since` (what an earlier run in the same directory wrote there is not this rank's)."""
    try:
        with log.open("rb") as f:  # the line may have a long traceback after it: the last MiB, not the last lines
            f.seek(max(since, log.stat().st_size - 2**20))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    said = [line.split("[ERROR] - error: ", 1)[1] for line in lines if "[ERROR] - error: " in line]
    return said[-1] if said else None


def _log_of(rank: int) -> Path:
    run_dir = _run_dir()
    return run_dir / f"train_ddp_process_{rank}.log" if run_dir else Path(f"train_ddp_process_{rank}.log")


class _Watcher(threading.Thread):
    def __init__(self, procs: list[Any]) -> None:
        super().__init__(daemon=True, name="rank-watcher")
        self.procs = procs
        # where each rank's log ends as it starts: a line before that is an earlier run's (a resume in the same dir)
        self.log_sizes = {r: _log_of(r).stat().st_size for r in range(1, len(procs) + 1) if _log_of(r).is_file()}

    def run(self) -> None:
        while True:
            time.sleep(0.5)
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return  # every child finished well
            for rank, (proc, code) in enumerate(zip(self.procs, codes), start=1):
                if code:
                    log = _log_of(rank)
                    said = _last_error(log, self.log_sizes.get(rank, 0)) if code > 0 else None  # not after a signal
                    reason = f"{_describe(code)}: {said}" if said else _describe(code)
                    _dead.append(f"rank {rank} (pid {proc.pid}) died ({reason}); its log: {log}")
                    if code == 2 and said:  # a mistake, which rank 0 may have found too: its own line comes first
                        time.sleep(_GRACE_S)
                    report_once(_dead[0])
                    for other in self.procs:
                        if other.poll() is None:
                            other.send_signal(signal.SIGKILL)
                    os._exit(1)  # rank 0 may sit in a collective with the dead rank: nothing else ends it


class RankWatchingLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for ddp and fsdp, with our watcher in place of Lightning's 5-second one."""

    _met = False  # meeting_port done

    def meeting_port(self) -> None:
        """MASTER_PORT for every rank Lightning starts: the user's, checked, else (one machine) a free port of ours.
        Once, before any rank starts (engine.build calls it, so that a refusal leaves no run dir)."""
        from engine.launch import ports

        if self._met or self.cluster_environment.creates_processes_externally:
            return
        self._met = True
        address, one_machine = self.cluster_environment.main_address, self.num_nodes == 1
        if "MASTER_PORT" in os.environ:
            port = ports.check_master_port(address, listen=one_machine)
        elif one_machine:
            port = ports.free_port(address)
            os.environ["MASTER_PORT"] = str(port)
        else:
            return  # several nodes: checked at start (engine.launch.processes)
        log.info(f"The {self.num_processes * self.num_nodes} ranks meet at {address}:{port}")

    def _call_children_watched(self) -> None:
        """Lightning's start of ranks 1..N-1, which inherit the mark of the process that watches them (they leave the
        console to it): in their environment only, not in this process's, nor in what it starts later."""
        before = os.environ.get(environment.WATCHED_BY)
        os.environ[environment.WATCHED_BY] = str(os.getpid())
        try:
            self._call_children_scripts()
        finally:
            if before is None:
                del os.environ[environment.WATCHED_BY]
            else:
                os.environ[environment.WATCHED_BY] = before

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from lightning.fabric.strategies.launchers.subprocess_script import _set_num_threads_if_needed

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self.meeting_port()
            self._call_children_watched()
            second_signal.end_with_this_process(self.procs)
            _Watcher(self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)
