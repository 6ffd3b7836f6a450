"""`make bench` figure 1: how long `python train.py --help` and `--cfg job` take, whole process, and whether they
import torch (they must not: the target is <= 1.0 s on a 2-core machine, and `import torch` alone costs more).

Baselines, in the same interleaved rounds: the bare interpreter (`python -c pass`), `import torch`, and, when
it is prepared (benchmarks/peer.py), the lightning-hydra-template's `src/train.py --help`.
Writes benchmarks/results/startup.json and startup.png.
"""

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import peer
from plotting import bars
from timing import REPO, RESULTS, checked, interleaved, python_env, run_process, summary, write_results

TARGET_S = 1.0


def commands(peer_found: peer.Peer | str) -> dict[str, list[str]]:
    py, train = sys.executable, str(REPO / "train.py")
    cmds = {
        "python -c pass": [py, "-c", "pass"],
        "train.py --help": [py, train, "--help"],
        "train.py --cfg job": [py, train, "--cfg", "job"],
        "python -c 'import torch'": [py, "-c", "import torch"],
    }
    if isinstance(peer_found, peer.Peer):
        cmds["peer: src/train.py --help"] = peer_found.train_cmd("--help")
    return cmds


def imports_torch(cmd: list[str], cwd: Path) -> bool:
    """Does the command import torch at all? `-X importtime` lists every module a process imports."""
    proc = checked(run_process([cmd[0], "-X", "importtime", *cmd[1:]], cwd=cwd, env=python_env()), " ".join(cmd))
    return any(line.split("|")[-1].strip() == "torch" for line in proc.output.splitlines() if "import time:" in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cwd = Path(tempfile.mkdtemp(prefix="bench-startup-"))  # nothing of a run may land in the repository
    peer_found = peer.prepare(cwd / "peer")
    if isinstance(peer_found, str):
        print(f"peer skipped: {peer_found}")
    cmds = commands(peer_found)
    env = python_env()
    runs = interleaved(
        {
            name: lambda cmd=cmd: checked(run_process(cmd, cwd=cwd, env=env), " ".join(cmd))
            for name, cmd in cmds.items()
        },
        repeats=args.repeats,
        warmup=1,  # the first round reads every file from disk; later rounds from the page cache, as a user's would
    )
    rows: dict[str, Any] = {}
    for name, procs in runs.items():
        rows[name] = {
            "wall_s": summary([p.wall_s for p in procs]),
            "cpu_s": summary([p.cpu_s for p in procs]),
            "imports_torch": imports_torch(cmds[name], cwd),
        }
        print(f"{name:28s} {rows[name]['wall_s']['median']:6.3f} s  torch imported: {rows[name]['imports_torch']}")
    results = {"target_s": TARGET_S, "repeats": args.repeats, "rows": rows}
    if isinstance(peer_found, peer.Peer):
        results["peer_commit"] = peer_found.commit
    path = write_results("startup", results)
    bars(
        {name: row["wall_s"] for name, row in rows.items()},
        RESULTS / "startup.png",
        title=f"Start-up, whole process ({args.repeats} interleaved rounds)",
        ylabel="seconds (median, min-max)",
        target=("target for --help / --cfg job", TARGET_S),
    )
    print(f"wrote {path} and {RESULTS / 'startup.png'}")


if __name__ == "__main__":
    main()
