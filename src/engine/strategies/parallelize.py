"""How a LightningModule's net is cut into stages (pipe, pipeline) and sharded (fsdp): one place, so that the
strategies treat every net alike. The net is the module's `net` attribute, else the LightningModule itself; unless
the user names them, cuts balance the net's blocks and FSDP units are its repeated block class (as torchtitan and
litgpt wrap transformer blocks)."""

import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from engine.errors import UserError
from engine.strategies import split as cutting


def net_of(module: nn.Module) -> nn.Module:
    """What the strategies spread over devices: `module.net`, or the LightningModule's own forward."""
    net = getattr(module, "net", None)
    return net if isinstance(net, nn.Module) else module


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


def _timed(block_stages: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward and backward per block on `sample`, best of `repeats`, each block fed what the
    blocks before it computed."""
    costs = []
    values: tuple = (sample,)
    for stage in block_stages:
        best = float("inf")
        for _ in range(repeats):
            inputs = [
                v.detach().clone().requires_grad_(v.is_floating_point()) if torch.is_tensor(v) else v for v in values
            ]
            start = time.perf_counter()
            out = stage(*inputs)
            tensors = [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                torch.autograd.backward([t.float().sum() for t in tensors])
            best = min(best, time.perf_counter() - start)
        stage.zero_grad(set_to_none=True)
        costs.append(best)
        with torch.no_grad():
            out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    return costs


def balance(found: Sequence[cutting.Block], stages: int, how: Any = "params", costs: Sequence[float] = ()) -> list[int]:
    """How many blocks each stage gets: given (`[4, 6]`), or chosen by parameter count ("params") or by the
    timed `costs` of each block ("time")."""
    if stages < 1 or stages > len(found):
        raise UserError(f"{stages} stages for a net of {len(found)} blocks: use between 1 and {len(found)} devices")
    if isinstance(how, Sequence) and not isinstance(how, str):
        sizes = [int(n) for n in how]
        if len(sizes) != stages or sum(sizes) != len(found) or min(sizes) < 1:
            raise UserError(
                f"trainer.strategy.balance={list(how)}: give {stages} numbers of blocks (one per stage, each "
                f">= 1) that add up to the net's {len(found)} blocks: {[b.name for b in found]}"
            )
        return sizes
    if how == "params":
        # + 1 per block: parameter-free blocks (ReLU, pooling) still cost a little, and spread evenly
        return _cut([b.parameters + 1 for b in found], stages)
    if how == "time":
        if len(costs) != len(found):
            raise UserError("trainer.strategy.balance=time needs an example input: the module's example_input_array")
        return _cut(costs, stages)
    raise UserError(f"trainer.strategy.balance={how!r}: params, time, or a list of blocks per stage")


def plan_stages(
    net: nn.Module,
    stages: int,
    split_points: Sequence[str] | None,
    how: Any = "params",
    sample: torch.Tensor | None = None,
    leaves: Sequence[str] = (),
) -> cutting.Split:
    """The net in `stages` stages: cut before the modules named in `split_points`, or at block boundaries chosen
    by `how` (params, time on `sample`, or blocks per stage)."""
    graphs = cutting.trace_both(net, leaves)
    found, starts = cutting.blocks(graphs[0], net)
    if split_points:
        if len(split_points) != stages - 1:
            raise UserError(
                f"trainer.strategy.split_points={list(split_points)}: {len(split_points)} cut(s) make "
                f"{len(split_points) + 1} stages, and this run has {stages} (trainer.devices); give {stages - 1} names"
            )
        return cutting.split(net, split_points, graphs)
    costs: list[float] = []
    if how == "time" and sample is not None:
        each = cutting.stages(graphs[0], net, starts[1:])  # one stage per block
        costs = _timed(each, sample)
    sizes = balance(found, stages, how, costs)
    return cutting.split(net, cutting.names_for(found, sizes), graphs)


def describe(plan: cutting.Split) -> str:
    """`[conv1 ...] [layer3 ...]`: the module each stage starts with, for the log."""
    return " ".join(f"[{name} ...]" for name in [plan.blocks[0].name, *plan.names])


def _matches(module: nn.Module, path: str, names: set[str]) -> bool:
    cls = type(module)
    return path in names or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names


def _repeated_blocks(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """Instances of the net's repeated block classes (defined outside torch.nn, used at least twice, holding
    parameters), outermost only: a transformer's Block, not the Attention inside it; ResNet's Bottleneck."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for path, module in net.named_modules():
        cls = type(module)
        if path and not cls.__module__.startswith("torch.") and any(True for _ in module.parameters()):
            by_class.setdefault(cls, []).append((path, module))
    repeated = {cls: found for cls, found in by_class.items() if len(found) >= 2}
    chosen = [(p, m) for found in repeated.values() for p, m in found]
    return [(p, m) for p, m in chosen if not any(p.startswith(f"{q}.") for q, _ in chosen if q != p)]


def _top_blocks(net: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The net's children, nn.Sequential and nn.ModuleList opened up, that hold parameters."""
    found = []
    for name, child in net.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            found += _top_blocks(child, f"{path}.")
        elif any(True for _ in child.parameters()):
            found.append((path, child))
    return found


def fsdp_units(net: nn.Module, units: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The modules FSDP shards as one unit each, outermost first: `units` (class, qualified class or module names),
    else the net's `fsdp_units` attribute, else its repeated block class, else its top-level blocks with parameters."""
    wanted = units if units else getattr(net, "fsdp_units", None)
    if wanted:
        names = {str(u) for u in wanted}
        found = [(p, m) for p, m in net.named_modules() if p and _matches(m, p, names)]
        matched = {n for n in names if any(_matches(m, p, {n}) for p, m in found)}
        if names - matched:
            classes = sorted({type(m).__name__ for _, m in net.named_modules() if any(True for _ in m.parameters())})
            raise UserError(
                f"trainer.strategy.units: no module of {type(net).__name__} is named or of class "
                f"{', '.join(sorted(names - matched))}; its classes with parameters: {', '.join(classes)}"
            )
        return [(p, m) for p, m in found if not any(p.startswith(f"{q}.") for q, _ in found if q != p)]
    return _repeated_blocks(net) or _top_blocks(net)


def _tied_together(units: list[nn.Module]) -> list[list[nn.Module]]:
    """The units in groups that share no parameter with another group: tied weights must be in one FSDP group, which
    torch refuses to split ("is shared with a parameter already managed by another FSDP group")."""
    groups: list[list[nn.Module]] = []
    owners: dict[int, int] = {}  # a parameter's id -> its group
    for unit in units:
        ids = {id(p) for p in unit.parameters()}
        joined = sorted({owners[i] for i in ids if i in owners})
        if not joined:
            groups.append([unit])
            target = len(groups) - 1
        else:
            target = joined[0]
            for other in joined[1:]:
                groups[target] += groups[other]
                groups[other] = []
            groups[target].append(unit)
        for i in {*ids, *(id(p) for m in groups[target] for p in m.parameters())}:
            owners[i] = target
    return [group for group in groups if group]


def shard(
    module: nn.Module, net: nn.Module, mesh: Any, units: Sequence[str] | None = None, recompute: bool = False
) -> None:
    """FSDP2 over the net: each unit, then the net (or, for the LightningModule itself, its children, so that a step
    calling `self.encoder(x)` still gathers it). `recompute`: activation checkpointing per unit. Idempotent."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if any(isinstance(m, FSDPModule) for m in net.modules()):
        return
    found = fsdp_units(net, units)
    if recompute:
        from torch.distributed._composable import checkpoint

        for _, unit in found:
            checkpoint(unit)
    kinds: dict[str, int] = {}
    for _, unit in found:
        kinds[type(unit).__name__] = kinds.get(type(unit).__name__, 0) + 1
    holder = type(net).__name__
    for group in _tied_together([unit for _, unit in found]):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
    covered = {id(p) for _, unit in found for p in unit.parameters()}
    rest = [n for n, p in net.named_parameters() if id(p) not in covered]
    if net is not module:
        fully_shard(net, mesh=mesh)
        roots = [holder]
    else:
        own = [n for n, p in module.named_parameters(recurse=False)]
        if own:
            raise UserError(
                f"trainer=fsdp: {type(module).__name__} holds parameters of its own ({', '.join(own[:3])}); move them "
                "into a submodule, or give the module a `net` attribute that holds every layer"
            )
        roots = []
        for name, child in module.named_children():
            if any(id(p) not in covered for p in child.parameters()):
                fully_shard(child, mesh=mesh)
                roots.append(name)
    rank_zero_info(
        f"fsdp: {len(found)} unit(s) ({', '.join(f'{k} x{v}' for k, v in kinds.items()) or 'none'}) and "
        f"{', '.join(roots) or 'nothing'} holding the rest ({len(rest)} parameter tensors)"
        f"{'; each unit recomputed in the backward' if recompute else ''}; trainer.strategy.units=[...] chooses others"
    )
