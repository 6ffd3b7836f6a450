"""The parts of `trainer=pipeline` (engine.strategies.pipeline) that need no process group, testable in one process:
what a stage holds and refuses, micro-batches and schedules, and how the last stage runs the user's step and what
it sends the other stages so that they log the same. Checkpoints: engine.strategies.pipeline_checkpoints."""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import Metric

from engine.errors import UserError
from engine.strategies.split import Split

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _tensors(stages: Sequence[nn.Module]) -> set[int]:
    return {id(t) for stage in stages for t in (*stage.parameters(), *stage.buffers())}


def check_cut(module: nn.Module, net: nn.Module, plan: Split, pp_size: int, stages_per_rank: int) -> None:
    """Refuse a cut that cannot train: parameters outside the net (only the last stage would update them), or a
    process without parameters (its optimizer would have nothing to optimize)."""
    in_net = {id(p) for p in net.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in in_net]
    if outside:
        raise UserError(
            f"trainer=pipeline: parameters outside the net ({outside[:3]}) would be trained by the last stage "
            "only; move them into the net"
        )
    for rank in range(pp_size):
        mine = [plan.train[rank + v * pp_size] for v in range(stages_per_rank)]
        if not any(p.numel() for stage in mine for p in stage.parameters()):
            layers = [str(n.target) for stage in mine for n in stage.graph.nodes if n.op == "call_module"]
            raise UserError(
                f"trainer=pipeline: pipeline rank {rank} would hold no parameters ({layers}); give it a layer with "
                "weights: trainer.strategy.split_points=[...] or trainer.strategy.balance=[blocks per stage, ...]"
            )


def keep_only(net: nn.Module, plan: Split, mine: Sequence[int], first: bool) -> None:
    """Drop what only other ranks' stages use (whole layers, so BatchNorm's load hooks ask for no missing keys), so
    that state_dict holds this rank's own under the full model's names. What no stage uses stays on the first."""
    own = _tensors([s for i in mine for s in (plan.train[i], plan.eval[i])])
    used = _tensors([*plan.train, *plan.eval])

    def foreign(tensor: Tensor | None) -> bool:
        return tensor is not None and id(tensor) not in own and (id(tensor) in used or not first)

    for path, module in list(net.named_modules()):
        tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        if path and not any(True for _ in module.children()) and tensors and all(map(foreign, tensors)):
            parent, _, name = path.rpartition(".")
            net.get_submodule(parent)._modules[name] = None
            continue
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if foreign(tensor):
                    table[name] = None


class _ClonedInputs(nn.Module):
    """A stage's inputs from another process are leaves that require grad: an in-place first op (ReLU with
    inplace=True) may not overwrite them, so the stage gets copies."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *values: Any) -> Any:
        return self.stage(*(v.clone() if isinstance(v, Tensor) and v.requires_grad else v for v in values))


def stage_module(stage: nn.Module, first: bool) -> nn.Module:
    """The module a PipelineStage runs: the stage itself (the net's own layers, no copy of their weights)."""
    return stage if first else _ClonedInputs(stage)


def refuse(module: Any) -> None:
    """What the pipeline cannot run, said on every rank before any communication."""
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()):
        raise UserError(
            "model.compile does not work with trainer=pipeline (each stage runs its own blocks, never the compiled "
            "net): set model.compile=false"
        )
    if not module.automatic_optimization:
        raise UserError(
            "trainer=pipeline runs the backward inside its schedule: it needs automatic optimization "
            "(self.automatic_optimization = True)"
        )


def micro_batches(batch_size: int, wanted: int, schedule: str, pp_size: int) -> tuple[int, str]:
    """(M', schedule): M' the largest divisor of the batch size <= `wanted` (equal micro-batches make torch's 1/M'
    scaling exact); 1F1B with M' < stages runs GPipe; interleaved needs M' a multiple of max(1, M' // pp_size)."""
    for m in range(min(wanted, batch_size), 0, -1):
        if batch_size % m:
            continue
        if schedule == "interleaved_1f1b" and m % max(1, m // pp_size):
            continue
        if schedule == "1f1b" and m < pp_size:
            return m, "gpipe"
        return m, schedule
    raise UserError(f"trainer=pipeline: a batch of {batch_size} samples cannot be cut into micro-batches")


def net_input(batch: Any) -> Tensor:
    """The tensor the net takes: the batch itself, or its first element ((x, y) pairs)."""
    x = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not isinstance(x, Tensor) or x.dim() == 0 or len(x) == 0:
        raise UserError(
            "trainer=pipeline feeds the net batch[0] (or the batch, if it is a tensor), which must be a non-empty "
            f"batched tensor; got {type(x).__name__}"
        )
    return x


def narrow(obj: Any, start: int, size: int, total: int) -> Any:
    """Samples [start, start + size) of a batch: every tensor whose first dimension is the batch's, wherever it
    sits in the batch's collections; anything else as it is."""
    return apply_to_collection(obj, Tensor, lambda t: t.narrow(0, start, size) if t.dim() and len(t) == total else t)


@dataclass
class Run:
    """The stages and schedule for one batch shape (a PipelineStage sizes its buffers by its first micro-batch).
    `targets`: index tensors, one per micro-batch, by which the loss function knows which micro-batch it got."""

    schedule: Any
    micro_batches: int
    batch_size: int
    targets: list[Tensor] = field(default_factory=list)
    args: tuple = ()  # the arguments of the training step being run: (batch, batch_idx, ...)
    kwargs: dict = field(default_factory=dict)

    def index(self, target: Tensor) -> int | None:
        """Which micro-batch the loss function got, or None for torch's shape inference (it passes a copy)."""
        return next((i for i, t in enumerate(self.targets) if t is target), None)

    def micro_batch_args(self, index: int) -> tuple[tuple, dict]:
        size = self.batch_size // self.micro_batches
        return (narrow(self.args[0], index * size, size, self.batch_size), *self.args[1:]), self.kwargs


def build_run(strategy: Any, batch_size: int, train: bool, loss_fn: Callable | None) -> Run:
    """This rank's stages (over the blocks the strategy kept, no copies) and the schedule for this batch size."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    m, kind = micro_batches(batch_size, strategy.micro_batches, strategy.schedule, strategy.pp_size)
    stages: list[Any] = [
        PipelineStage(
            stage_module(stage, index == 0), index, strategy.num_stages, strategy.root_device, group=strategy.pp_group
        )
        for index, stage in zip(strategy.stage_indices, strategy.stages(train))
    ]
    if kind == "interleaved_1f1b":
        schedule: Any = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stages[0], m, loss_fn=loss_fn)
    rank_zero_info(
        f"trainer=pipeline: {'training' if train else 'evaluation'} batches of {batch_size} run as {m} "
        f"micro-batches of {batch_size // m} ({kind})"
    )
    targets = list(torch.arange(batch_size, device=strategy.root_device).tensor_split(m)) if train else []
    return Run(schedule, m, batch_size, targets)


Record = tuple[str, Any, dict[str, Any]]  # the arguments of one self.log call
Payload = dict[str, Any]  # what the last stage sends its pipeline after each step


def call_user(
    module: Any, net: nn.Module, method: str, args: tuple, kwargs: dict, output: Any, records: list[Record]
) -> Any:
    """The LightningModule's step with the net answering `output` and self.log calls recorded; the module's forward
    around the net runs as on one device, and a net asked for anything but batch[0] is refused."""
    x = net_input(args[0])

    def answer(*given: Any, **named: Any) -> Any:
        if named or len(given) != 1 or not (given[0] is x or _same(given[0], x)):
            raise UserError(_asked_for_another_input(module, net, method, given, named))
        return output

    net.__dict__["forward"] = answer
    module.__dict__["log"] = lambda name, value, **kw: records.append((name, value, kw))
    try:
        return getattr(module, method)(*args, **kwargs)
    finally:
        del net.__dict__["forward"], module.__dict__["log"]


def _same(given: Any, x: Tensor) -> bool:
    return isinstance(given, Tensor) and given.shape == x.shape and given.dtype == x.dtype and torch.equal(given, x)


def _asked_for_another_input(module: Any, net: nn.Module, method: str, given: tuple, named: dict) -> str:
    """Which of the user's functions called the net on something else, and what it gave."""
    import sys

    caller = f"{type(module).__name__}.{method}"
    frame: Any = sys._getframe(2)
    while frame is not None:
        if frame.f_locals.get("self") is module and frame.f_code.co_name != "_call_impl":
            caller = f"{type(module).__name__}.{frame.f_code.co_name}"
            break
        frame = frame.f_back
    what = (
        f"keyword arguments {sorted(named)}"
        if named
        else f"{len(given)} arguments"
        if len(given) != 1
        else "a tensor other than batch[0]"
    )
    net_name = "forward" if net is module else "self.net"
    return (
        f"trainer=pipeline runs {net_name} in stages on batch[0] alone, but {caller} calls it with {what}: "
        f"compute the net's input inside the net (or in the DataModule), or use trainer=pipe, which runs the net on "
        "whatever it is given"
    )


def loss_of(result: Any) -> Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not isinstance(loss, Tensor):
        raise UserError(
            "trainer=pipeline: training_step must return the loss (a tensor, or a dict with 'loss'); skipping a "
            "batch by returning None is not possible once the other stages have run it"
        )
    return loss


def metrics(module: nn.Module) -> dict[str, Metric]:
    """The torchmetrics objects of a module, by module path (the same on every rank)."""
    return {path: m for path, m in module.named_modules() if isinstance(m, Metric)}


Snapshot = dict[str, tuple[dict[str, Any], int, Any]]


def _states(found: dict[str, Metric], paths: Iterable[str], move: Callable[[Tensor], Tensor]) -> Snapshot:
    return {
        p: (
            {k: apply_to_collection(v, Tensor, move) for k, v in found[p].metric_state.items()},
            found[p]._update_count,
            apply_to_collection(found[p]._forward_cache, Tensor, move),
        )
        for p in paths
    }


def snapshot(found: dict[str, Metric]) -> Snapshot:
    """Copies of every metric's state: the per-micro-batch runs of training_step (which only compute the loss)
    update metrics too, and must leave no trace."""
    return _states(found, found, lambda t: t.detach().clone())


def to_cpu(value: Any) -> Any:
    """Tensors leave a rank on the CPU: a pickled CUDA tensor would arrive on the sender's device index."""
    return apply_to_collection(value, Tensor, lambda t: t.detach().cpu())


def export_states(found: dict[str, Metric], paths: Iterable[str]) -> Snapshot:
    return _states(found, paths, lambda t: t.detach().cpu())


def restore(found: dict[str, Metric], saved: Snapshot, device: torch.device | None = None) -> None:
    """Put back saved states, or (with `device`) take the last stage's, the ones the user's step updated."""
    for path, (state, count, forward_cache) in saved.items():
        metric = found[path]
        for name, value in state.items():
            object.__setattr__(metric, name, value if device is None else move_data_to_device(value, device))
        metric._update_count, metric._computed = count, None
        metric._forward_cache = forward_cache if device is None else move_data_to_device(forward_cache, device)


import_states = restore


def export_records(records: list[Record], found: dict[str, Metric]) -> list[tuple[str, str, Any, dict[str, Any]]]:
    """self.log calls as data: a metric by its path (its state travels separately), a value as a CPU tensor."""
    paths = {id(m): p for p, m in found.items()}
    out: list[tuple[str, str, Any, dict[str, Any]]] = []
    for name, value, kwargs in records:
        if isinstance(value, Metric):
            if id(value) not in paths:
                raise UserError(f"self.log({name!r}, ...) got a metric that is not an attribute of the LightningModule")
            out.append((name, "metric", paths[id(value)], kwargs))
        else:
            out.append((name, "value", torch.as_tensor(to_cpu(value)), kwargs))
    return out


def last_stage_step(
    module: Any, net: nn.Module, found: dict[str, Metric], method: str, args: tuple, kwargs: dict, output: Any
) -> tuple[Any, Payload]:
    """The user's step on the whole batch's output: its result, and what the other stages need to log the same
    (its self.log calls, the states of the metrics it touched, the loss, a prediction)."""
    counts = {path: m._update_count for path, m in found.items()}
    records: list[Record] = []
    result = call_user(module, net, method, args, kwargs, output, records)
    exported = export_records(records, found)
    touched = {p for p, m in found.items() if m._update_count != counts[p]}
    touched |= {value for _, kind, value, _ in exported if kind == "metric"}
    payload: Payload = {"error": None, "records": exported, "states": export_states(found, sorted(touched))}
    payload["loss"] = float(loss_of(result).detach()) if method == "training_step" else None
    payload["result"] = to_cpu(result) if method == "predict_step" else None
    return result, payload


def replay(module: Any, payload: Payload, found: dict[str, Metric], device: torch.device, is_last: bool) -> None:
    """Make the last stage's self.log calls on this rank too, with its metric states: callbacks (ModelCheckpoint,
    EarlyStopping) read them on every rank, and loggers write on rank 0, which holds the first stage."""
    if not is_last:
        import_states(found, payload["states"], device)
    for name, kind, value, kwargs in payload["records"]:
        module.log(name, found[value] if kind == "metric" else value.to(device), **kwargs)
