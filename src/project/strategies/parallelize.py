"""How a net is cut into blocks, and the blocks spread over devices: one place for every strategy that does.

A net can be split when it is an nn.Sequential: its children, with nested nn.Sequentials opened up, are its
blocks, in call order, each taking the previous one's output. That is all a net of your own needs (the
template's LeNet, MLP and ResNet-18 are built that way). `pipe` and `pipeline` cut the block list into stages;
`fsdp` makes each block with weights its own FSDP unit.
"""

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from project.errors import UserError

Blocks = list[tuple[str, nn.Module]]


def blocks(net: nn.Module) -> Blocks:
    """(name, module) for each block of the net, in call order; names are the state_dict prefixes."""
    if not isinstance(net, nn.Sequential):
        raise UserError(
            f"{type(net).__name__} cannot be cut into stages: model parallelism needs the net as an nn.Sequential "
            "of blocks, each taking the previous one's output (see README, Model parallelism)"
        )
    found: Blocks = []
    for name, child in net.named_children():
        if isinstance(child, nn.Sequential):
            found += [(f"{name}.{inner}", module) for inner, module in blocks(child)]
        else:
            found.append((name, child))
    return found


def _parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _timed(found: Blocks, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward and backward per block on `sample`, best of `repeats` (blocks stay where they are)."""
    costs = []
    x = sample
    for _, module in found:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = module(inp.clone() if inp.requires_grad else inp)  # a leaf: ReLU(inplace=True) would refuse it
            out.float().sum().backward()
            best = min(best, time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
        costs.append(best)
        with torch.no_grad():
            x = module(x)
    return costs


def _cut(costs: Sequence[float], stages: int) -> list[int]:
    """Blocks per stage, contiguous, minimising the costliest stage: a pipeline runs at its slowest stage's pace.
    Exact dynamic programme over cut points (a few dozen blocks: instant)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least possible largest stage cost when the first i blocks form k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def balance(found: Blocks, stages: int, how: Any = "params", sample: torch.Tensor | None = None) -> list[int]:
    """How many blocks each stage gets: given (`[4, 6]`), or chosen by parameter count ("params") or by a timed
    forward and backward of each block on `sample` ("time")."""
    if stages < 1 or stages > len(found):
        raise UserError(f"{stages} stages for a net of {len(found)} blocks: use between 1 and {len(found)} devices")
    if isinstance(how, Sequence) and not isinstance(how, str):
        sizes = [int(n) for n in how]
        if len(sizes) != stages or sum(sizes) != len(found) or min(sizes) < 1:
            raise UserError(
                f"trainer.strategy.balance={list(how)}: give {stages} numbers of blocks (one per stage, each "
                f">= 1) that add up to the net's {len(found)} blocks: {[name for name, _ in found]}"
            )
        return sizes
    if how == "params":
        # + 1 per block: parameter-free blocks (ReLU, pooling) still cost a little, and spread evenly
        return _cut([_parameters(m) + 1 for _, m in found], stages)
    if how == "time":
        if sample is None:
            raise UserError("trainer.strategy.balance=time needs an example input: the module's example_input_array")
        return _cut(_timed(found, sample), stages)
    raise UserError(f"trainer.strategy.balance={how!r}: params, time, or a list of blocks per stage")


def stages(found: Blocks, sizes: Sequence[int]) -> list[list[tuple[str, nn.Module]]]:
    """The block list cut into consecutive stages of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(found[start : start + size])
        start += size
    return out


def fully_shard_blocks(net: nn.Module, mesh: Any) -> None:
    """FSDP2 for `fsdp`: one FSDP unit per block with weights (per module with weights of its own, for a net that
    is not an nn.Sequential), then the net, so that only the block being computed is ever gathered whole.
    Idempotent (Lightning calls configure_model for fit and for test)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(net, FSDPModule):
        return
    if isinstance(net, nn.Sequential):
        units = [module for _, module in blocks(net)]
    else:
        units = [m for m in list(net.modules())[1:] if any(True for _ in m.parameters(recurse=False))]
    for module in units:
        if _parameters(module):
            fully_shard(module, mesh=mesh)
    fully_shard(net, mesh=mesh)
