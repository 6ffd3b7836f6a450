"""`make bench-tests`: what `make test` costs. Runs the suite as `make test` does (three files at a time) with
pytest's durations, and writes the wall time, the CPU time of the processes it started and waited for (the
test's warm interpreters and what they forked included; SLURM's job steps not), the outcome and the ten
slowest test phases to benchmarks/results/test_suite.json. The figures of earlier trees (issue 21's cuts) are kept
under `history` in that file; this script appends the new measurement there too.
Run it on a quiet machine: the suite is CPU-bound on 2 cores, anything beside it shows in the wall time."""

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from datetime import date
from typing import Any

from timing import REPO, RESULTS, machine

SLOWEST = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$", re.M)
OUTCOME = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", re.M)


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def measure(workers: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadfile", "--durations=10", "-q"]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:  # what failed, and why: the figures alone do not say
        print(proc.stdout[-8000:], file=sys.stderr)
    outcome = OUTCOME.findall(proc.stdout)
    return {
        "date": date.today().isoformat(),
        "machine": machine(),  # the project's 2-core machines are not all alike (AMD EPYC, Intel Xeon)
        "commit": commit(),
        "command": " ".join(["pytest", *command[3:]]),
        "exit_code": proc.returncode,
        "outcome": outcome[-1] if outcome else proc.stdout[-500:],
        "wall_s": round(wall, 1),
        "cpu_user_s": round(usage.ru_utime, 1),
        "cpu_sys_s": round(usage.ru_stime, 1),
        "slowest": [
            {"seconds": float(s), "phase": phase, "test": test} for s, phase, test in SLOWEST.findall(proc.stdout)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3, help="as `make test`")
    args = parser.parse_args()
    path = RESULTS / "test_suite.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    found = measure(args.workers)
    results = {
        "machine": machine(),
        "target_wall_s": 360,
        "latest": found,
        "history": [*previous.get("history", []), {k: v for k, v in found.items() if k != "slowest"}],
    }
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{found['outcome']}: {found['wall_s']} s wall, {found['cpu_user_s'] + found['cpu_sys_s']:.0f} s CPU")
    print(f"wrote {path}")
    sys.exit(found["exit_code"])


if __name__ == "__main__":
    main()
