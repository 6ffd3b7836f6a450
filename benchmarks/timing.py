"""What every benchmark here shares: interleaved rounds, median/min/max summaries, timed child processes, and
the results file with the date and the machine.

Configurations are always timed in turn (one of each per round, repeated), never one block after another, so
that drift on a shared machine (another job, thermal throttling, a cache warming up) hits them all alike.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> str:
    """One line naming the machine, read without importing torch (a startup benchmark must not pay for it)."""
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {cores()} cores, Python {platform.python_version()}, torch {version('torch')}"


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median with min and max: the median is robust to one disturbed round, min/max show the spread."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
        "samples": list(samples),
    }


def interleaved(configs: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 0) -> dict[str, list[Any]]:
    """Calls each configuration once per round, `warmup + repeats` rounds; keeps what the last `repeats` return."""
    kept: dict[str, list[Any]] = {name: [] for name in configs}
    for round_ in range(warmup + repeats):
        for name, measure in configs.items():
            value = measure()
            if round_ >= warmup:
                kept[name].append(value)
    return kept


@dataclass
class Process:
    """A finished child process: wall time, CPU time (user + system, its children included) and output."""

    wall_s: float
    cpu_s: float
    returncode: int
    output: str


def run_process(cmd: Sequence[str], cwd: Path | None = None, env: Mapping[str, str] | None = None) -> Process:
    """Runs a whole process, start to exit, as a user's shell would. Its CPU time comes from wait4, which also
    counts the processes it started and waited for (ddp ranks)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        return Process(wall, usage.ru_utime + usage.ru_stime, proc.returncode, out.read())


def checked(proc: Process, what: str) -> Process:
    """A benchmark of a failing command measures nothing: stop with its output."""
    if proc.returncode != 0:
        sys.exit(f"{what} exited {proc.returncode}:\n{proc.output[-3000:]}")
    return proc


def write_results(name: str, results: dict[str, Any]) -> Path:
    """benchmarks/results/<name>.json, stamped with the date and the machine."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    stamped = {"date": date.today().isoformat(), "machine": machine(), **results}
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    return path


def python_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's, plus benchmarks/ importable (for the epoch timer and the
    repeated digits, named by `_target_` in overrides), plus `extra`."""
    path = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
