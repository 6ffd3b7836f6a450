"""`make bench` figure 2: a whole training run, process start to exit, against the lightning-hydra-template doing
the same work: 3 epochs of the 784-64-128-64 MLP at batch 64 on the same 5,000 digits (3,500 train, 500 val),
checkpoints and TensorBoard events written, no test. Targets: <= 0.6x the peer's wall time, and <= 1.5 s above
the import floor (`import torch, lightning.pytorch, torchmetrics, hydra, torch.utils.tensorboard`), which is
run in the same interleaved rounds. The peer runs only where benchmarks/peer.py has prepared it.
Writes benchmarks/results/whole_run.json and whole_run.png.
"""

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import peer
from plotting import bars, pyplot
from timing import REPO, RESULTS, checked, interleaved, python_env, run_process, summary, write_results

EPOCHS, BATCH = 3, 64
FLOOR = "import torch, lightning.pytorch, torchmetrics, hydra, torch.utils.tensorboard"
TARGET_RATIO, TARGET_ABOVE_FLOOR_S = 0.6, 1.5


def ours_cmd(epochs: int) -> list[str]:
    return [
        sys.executable,
        str(REPO / "train.py"),
        "model=mlp",
        "model.net.hidden=[64,128,64]",
        f"data.batch_size={BATCH}",
        f"trainer.max_epochs={epochs}",
        "test=false",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-whole-run-"))  # both templates' logs/ land here, not in the repo
    peer_found = peer.prepare(work / "peer")
    cmds: dict[str, tuple[list[str], Path]] = {
        "this template": (ours_cmd(args.epochs), work / "ours"),
        "import floor": ([sys.executable, "-c", FLOOR], work),
    }
    if isinstance(peer_found, peer.Peer):
        overrides = peer_found.whole_run_overrides(work / "peer-logs", args.epochs, BATCH)
        cmds["lightning-hydra-template"] = (peer_found.train_cmd(*overrides), peer_found.root)
    else:
        print(f"peer skipped: {peer_found}")
    (work / "ours").mkdir()
    env = python_env()
    runs = interleaved(
        {
            name: lambda cmd=cmd, cwd=cwd: checked(run_process(cmd, cwd=cwd, env=env), " ".join(cmd))
            for name, (cmd, cwd) in cmds.items()
        },
        repeats=args.repeats,
        warmup=1,
    )
    rows: dict[str, Any] = {
        name: {"wall_s": summary([p.wall_s for p in procs]), "cpu_s": summary([p.cpu_s for p in procs])}
        for name, procs in runs.items()
    }
    ours = rows["this template"]["wall_s"]["median"]
    results: dict[str, Any] = {
        "epochs": args.epochs,
        "batch_size": BATCH,
        "repeats": args.repeats,
        "commands": {name: " ".join(cmd) for name, (cmd, _) in cmds.items()},
        "rows": rows,
        "above_import_floor_s": ours - rows["import floor"]["wall_s"]["median"],
        "target_above_import_floor_s": TARGET_ABOVE_FLOOR_S,
        "target_ratio_to_peer": TARGET_RATIO,
    }
    if isinstance(peer_found, peer.Peer):
        peer_row = rows["lightning-hydra-template"]
        results["peer_commit"] = peer_found.commit
        # each round's ratio, then the median: a round disturbed for both cancels out
        ratios = [a.wall_s / b.wall_s for a, b in zip(runs["this template"], runs["lightning-hydra-template"])]
        results["ratio_to_peer_wall"] = summary(ratios)
        results["ratio_to_peer_cpu"] = rows["this template"]["cpu_s"]["median"] / peer_row["cpu_s"]["median"]
    for name, row in rows.items():
        print(f"{name:26s} wall {row['wall_s']['median']:6.2f} s   cpu {row['cpu_s']['median']:6.2f} s")
    print(f"above the import floor: {results['above_import_floor_s']:.2f} s (target <= {TARGET_ABOVE_FLOOR_S} s)")
    if "ratio_to_peer_wall" in results:
        print(f"ratio to the peer: {results['ratio_to_peer_wall']['median']:.2f}x wall (target <= {TARGET_RATIO}x)")
    path = write_results("whole_run", results)
    plot(rows, RESULTS / "whole_run.png", args.epochs)
    print(f"wrote {path} and {RESULTS / 'whole_run.png'}")


def plot(rows: dict[str, Any], path: Path, epochs: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key in zip(axes, ("wall_s", "cpu_s")):
        kind = "wall" if key == "wall_s" else "CPU (user + sys)"
        bars(
            {n: r[key] for n, r in rows.items()},
            path,
            f"{kind} time, whole process",
            "seconds (median, min-max)",
            ax=ax,
        )
    fig.suptitle(f"{epochs} epochs, MLP 784-64-128-64, batch {BATCH}, 3,500 digits, test=false")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
