"""`make bench`: what drawing the net's graph in TensorBoard costs at the first step of a run, torch's way and the
template's (engine.callbacks.tensorboard._graph).

`SummaryWriter.add_graph` traces with `torch.jit.trace`'s check_trace: two more traces, compared with the first.
The template traces once, without the check, and writes the same records (tests/test_private_api.py compares them).
Timed on LeNet and torchvision's ResNet-18 at 28x28, 2 images, in this process after a first call of each (the
imports and the JIT's set-up are paid once per process by both). Rounds interleaved. Writes
benchmarks/results/graph.json.
"""

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from timing import interleaved, summary, write_results
from torch.utils.tensorboard import SummaryWriter

from engine.callbacks.tensorboard import _graph
from project.models.lenet import LeNet
from project.models.resnet import ResNet18


def ms(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # torch.jit.trace's deprecation and tracer warnings, alike for both
    writer = SummaryWriter(tempfile.mkdtemp(prefix="bench-graph-"))
    results: dict[str, Any] = {"repeats": args.repeats}
    for name, net in {"lenet": LeNet(), "resnet18": ResNet18()}.items():
        net.eval()
        example = torch.zeros(2, 1, 28, 28)
        configs = {
            "SummaryWriter.add_graph (traced with the check)": lambda: ms(lambda: writer.add_graph(net, example)),
            "traced once (the template)": lambda: ms(lambda: writer._get_file_writer().add_graph(_graph(net, example))),
        }
        rows = {k: summary(v) for k, v in interleaved(configs, args.repeats, warmup=1).items()}
        results[f"{name}, ms"] = rows
        for config, row in rows.items():
            print(f"{name:10s} {config:50s} {row['median']:8.1f} ms")
    writer.close()
    print(f"wrote {write_results('graph', results)}")


if __name__ == "__main__":
    main()
