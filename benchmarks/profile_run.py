"""`make bench`: where a 3-epoch run's CPU goes (figure 2's run: the 784-64-128-64 MLP, batch 64, test=false).

Two views of the same command, written to benchmarks/results/profile.txt:
- `python -X importtime`: the imports, the largest first, and the packages a default run pulls in;
- `python -m cProfile`: the run's CPU split into what the issue asks about (imports, Hydra and the config checks,
  data loading, training steps, validation, Lightning hooks and callbacks, progress bar, self.log and metrics,
  TensorBoard writes, checkpoint writes), each the cumulative time of the functions that enter it, then the top
  functions by cumulative time. Buckets overlap where one calls another (a checkpoint write inside a hook).
"""

import argparse
import io
import pstats
import re
import sys
import tempfile
from pathlib import Path

from timing import RESULTS, checked, python_env, run_process
from whole_run import ours_cmd

# bucket -> (file path part, function name pattern): the entry points whose cumulative time is the bucket's
BUCKETS: dict[str, list[tuple[str, str]]] = {
    "imports (all, at any time)": [("<frozen importlib._bootstrap>", r"^_find_and_load$")],
    "Hydra: compose the config": [("hydra/_internal/config_loader_impl.py", r"^load_configuration$")],
    "config checks (schema, _target_ signatures, factories)": [
        ("engine/config/schema.py", r"^check_config$"),
        ("engine/build.py", r"^check$"),
    ],
    "build: data, model, callbacks, loggers, trainer": [("engine/build.py", r"^(datamodule|model|named|trainer)$")],
    "Trainer.fit (all of training)": [("lightning/pytorch/trainer/trainer.py", r"^fit$")],
    "sanity check": [("lightning/pytorch/trainer/trainer.py", r"^_run_sanity_check$")],
    "data loading (next batch)": [("lightning/pytorch/loops/fetchers.py", r"^__next__$")],
    "training steps (forward, backward, optimizer)": [("lightning/pytorch/loops/optimization/automatic.py", r"^run$")],
    "validation loops": [("lightning/pytorch/loops/evaluation_loop.py", r"^run$")],
    "callbacks' hooks (all callbacks)": [("lightning/pytorch/trainer/call.py", r"^_call_callback_hooks$")],
    "progress bar (its hooks)": [("lightning/pytorch/callbacks/progress/", r"^on_")],
    "self.log and torchmetrics": [
        ("lightning/pytorch/core/module.py", r"^log$"),
        ("torchmetrics/metric.py", r"^forward$"),
    ],
    "logger writes (metrics to TensorBoard)": [("logger_connector/logger_connector.py", r"^log_metrics$")],
    "TensorBoard callback (images, graph, histograms)": [("engine/callbacks/tensorboard.py", r"^on_")],
    "checkpoint writes": [("lightning/pytorch/trainer/trainer.py", r"^save_checkpoint$")],
}

# what a default run of the digits does not need, or may not: where each is first imported, and its cost
WATCHED = [
    "torch",
    "lightning.pytorch",
    "torchmetrics",
    "torchvision",
    "torch._dynamo",
    "torch.utils.tensorboard",
    "tensorboard",
    "matplotlib",
    "rich",
    "scipy",
    "sklearn",
    "pandas",
    "PIL",
    "onnx",
    "hydra",
    "omegaconf",
]


def import_report(cmd: list[str], cwd: Path, min_s: float = 0.1, max_depth: int = 30) -> str:
    proc = checked(run_process([cmd[0], "-X", "importtime", *cmd[1:]], cwd=cwd, env=python_env()), "importtime")
    rows = []  # (cumulative us, depth, name); a line: "import time: <self us> | <cumulative us> | <indented name>"
    for line in proc.output.splitlines():
        fields = line.split("|")
        if not line.startswith("import time:") or len(fields) != 3 or not fields[1].strip().isdigit():
            continue
        name = fields[2].rstrip()
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2  # one space, then two per level of nesting
        rows.append((int(fields[1]), depth, name.strip()))
    total = sum(cum for cum, depth, _ in rows if depth == 0)
    out = [f"Imports: {total / 1e6:.2f} s in all (top-level imports' cumulative time)", ""]
    out.append("Packages a run pulls in: cumulative seconds of the first import of the package or any of its modules")
    for package in WATCHED:
        cum = max((c for c, _, name in rows if name == package or name.startswith(package + ".")), default=0)
        out.append(f"{cum / 1e6:8.3f}  {package}")
    out += ["", f"Import tree, modules of >= {min_s} s cumulative (parents above children; depth <= {max_depth}):"]
    # -X importtime prints a module after everything it imported: reversed, each parent comes first
    for cum, depth, name in reversed(rows):
        if cum >= min_s * 1e6 and depth <= max_depth:
            out.append(f"{cum / 1e6:8.3f}  {'  ' * depth}{name}")
    return "\n".join(out)


def cprofile_report(cmd: list[str], cwd: Path, top: int) -> str:
    out_file = cwd / "run.prof"
    proc = checked(
        run_process([cmd[0], "-m", "cProfile", "-o", str(out_file), *cmd[1:]], cwd=cwd, env=python_env()), "cProfile"
    )
    stats = pstats.Stats(str(out_file))
    total = stats.total_tt  # type: ignore[attr-defined]
    lines = [f"cProfile: {total:.2f} s of profiled time (process wall {proc.wall_s:.2f} s, CPU {proc.cpu_s:.2f} s)", ""]
    lines.append(f"{'seconds':>8} {'share':>6}  bucket")
    entries = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    for bucket, specs in BUCKETS.items():
        cum = sum(
            ct
            for (file, _, name), (_, _, _, ct, _) in entries.items()
            if any(part in file and re.search(pattern, name) for part, pattern in specs)
        )
        lines.append(f"{cum:8.2f} {cum / total:6.1%}  {bucket}")
    buffer = io.StringIO()
    pstats.Stats(str(out_file), stream=buffer).sort_stats("cumulative").print_stats(top)
    lines += ["", f"Top {top} functions by cumulative time:", buffer.getvalue().split("\n\n", 1)[-1].strip()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    cmd = ours_cmd(args.epochs)
    work = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    header = f"Profile of: {' '.join(['python', *cmd[1:]])}\n(run in an empty folder; python is {sys.executable})"
    text = "\n\n".join([header, import_report(cmd, work), cprofile_report(cmd, work, args.top)])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "profile.txt").write_text(text + "\n")
    print(text.split("Top ")[0])
    print(f"wrote {RESULTS / 'profile.txt'}")


if __name__ == "__main__":
    main()
