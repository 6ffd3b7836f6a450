"""Running a LightningModule step on pieces of a batch and logging once, as one step on the whole batch would.

Each piece's `self.log` calls are recorded, not logged (several threads must not write into the trainer's one
result store), then logged once: values by their `reduce_fx`, torchmetrics states merged into the module's metric."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torchmetrics import Metric

Record = tuple[str, Any, dict[str, Any]]


def first_tensor(obj: Any) -> Tensor | None:
    """The first tensor anywhere in a batch or step output (torch's pytree walks the collections)."""
    return next((leaf for leaf in tree_leaves(obj) if isinstance(leaf, Tensor)), None)


def fresh_metric_states(module: nn.Module, device: torch.device) -> None:
    """Make a replica's metrics its own: a shallow copy's `update`/`compute` stay bound to the root's state (updated
    from several threads). Rebound, with empty states on its device (reset() would clear the root's list states)."""
    for metric in module.modules():
        if isinstance(metric, Metric):
            cls = type(metric)
            metric.__dict__["update"] = metric._wrap_update(cls.update.__get__(metric, cls))
            metric.__dict__["compute"] = metric._wrap_compute(cls.compute.__get__(metric, cls))
            for name, default in metric._defaults.items():
                fresh: Tensor | list[Tensor] = (
                    default.detach().clone().to(device) if isinstance(default, Tensor) else []
                )
                object.__setattr__(metric, name, fresh)
            metric._update_count, metric._forward_cache, metric._computed = 0, None, None


class PieceStep(nn.Module):
    """Runs one LightningModule step on a piece of a batch (in a dp replica), recording `self.log` calls."""

    def __init__(self, module: nn.Module, method: str, context: Callable[[], AbstractContextManager]) -> None:
        super().__init__()
        self.module = module
        self.method, self.context = method, context

    def forward(self, *args: Any) -> tuple[Any, list[Record]]:
        module, records = self.module, []
        tensor = first_tensor(args)
        device = tensor.device if tensor is not None else torch.device("cpu")
        module.__dict__["_device"] = device  # LightningModule.device of this replica
        fresh_metric_states(module, device)
        # An instance attribute shadows LightningModule.log in this replica only (log_dict calls it too).
        module.__dict__["log"] = lambda name, value, **kwargs: records.append((name, value, kwargs))
        try:
            with self.context():  # autocast is thread-local: enter the precision context in each replica's thread
                output = getattr(module, self.method)(*args)
        finally:
            del module.__dict__["log"]
        return output, records


def combine(outputs: list[Any], sizes: list[int], root: torch.device) -> Any:
    """The pieces' step outputs as the whole batch's, leaf by leaf: scalars (tensors or numbers) as their mean
    weighted by piece size, batched tensors concatenated in order, anything else the first piece's."""
    total = sum(sizes)

    def merge(*parts: Any) -> Any:
        first = parts[0]
        if isinstance(first, Tensor):
            if first.dim() == 0:
                return sum(p.to(root) * (n / total) for p, n in zip(parts, sizes))
            return torch.cat([p.to(root) for p in parts])
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return sum(p * n for p, n in zip(parts, sizes)) / total
        return first

    if outputs[0] is None:
        return None
    flat = [tree_flatten(out) for out in outputs]
    return tree_unflatten([merge(*leaves) for leaves in zip(*(f[0] for f in flat))], flat[0][1])


def log_once(
    module: Any, pieces: list[nn.Module], records: list[list[Record]], sizes: list[int], root: torch.device
) -> None:
    """Log once what every piece logged: metric states combined (also of metrics updated but not logged), plain values
    reduced by their reduce_fx. `pieces`: the module copies that ran the pieces (their metrics hold the states)."""
    names = [[name for name, _, _ in piece_records] for piece_records in records]
    if any(n != names[0] for n in names[1:]):
        raise MisconfigurationException(
            f"the pieces of one batch logged different keys ({names}); a step's self.log calls must not "
            "depend on which part of the batch it got"
        )
    total = sum(sizes)
    paths = {id(m): p for p, m in pieces[0].named_modules()}
    combined: set[int] = set()
    for i, (name, value, kwargs) in enumerate(records[0]):
        values = [r[i][1] for r in records]
        if isinstance(value, Metric):
            metric = module.get_submodule(paths[id(value)])
            assert isinstance(metric, Metric)
            if id(metric) not in combined:  # the same metric logged under two names is combined once
                combine_metric(metric, values, root)
                combined.add(id(metric))
            module.log(name, metric, **kwargs)
        else:
            module.log(
                name,
                reduce_values(values, sizes, kwargs.get("reduce_fx", "mean"), root),
                **{"batch_size": total, **kwargs},
            )
    # Metrics the step updated without logging them (logged once an epoch, say) hold the pieces' states too.
    for path, piece_metric in pieces[0].named_modules():
        if isinstance(piece_metric, Metric):
            metric = module.get_submodule(path)
            piece_metrics = [m for m in (piece.get_submodule(path) for piece in pieces) if isinstance(m, Metric)]
            if id(metric) not in combined and any(m._update_count for m in piece_metrics):
                combine_metric(metric, piece_metrics, root, step_value=False)
                combined.add(id(metric))


def combine_metric(metric: Metric, replica_metrics: list[Metric], root: torch.device, step_value: bool = True) -> None:
    """Add the replicas' states into the root metric, and set its step value to the whole batch's. Through their own
    reductions (`_reduce_states`), as DDP's metric sync does: exact whatever `full_state_update` says."""
    step = metric.clone() if step_value else None  # the whole batch's value, for on_step=True logging
    if step is not None:
        step.reset()
    for replica in replica_metrics:
        state = move_data_to_device(dict(replica.metric_state), root)
        for target in (metric, step) if step is not None else (metric,):
            target._update_count += replica._update_count  # first: mean-reduced states divide by it
            target._reduce_states(state)
    metric._computed = None
    if step is not None:
        metric._forward_cache = step.compute()


def reduce_values(values: list[Any], sizes: list[int], reduce_fx: Any, root: torch.device) -> Tensor:
    """Plain logged values of the replicas as one: the mean weighted by chunk size, or their sum, max or min."""
    # non_blocking: a logged Python number's copy to the GPU would otherwise wait for the queued kernels
    tensors = [torch.as_tensor(v, dtype=torch.float32).to(root, non_blocking=True) for v in values]
    fx = getattr(reduce_fx, "__name__", reduce_fx)
    if fx == "mean":
        total = sum(sizes)
        return torch.stack([t * (n / total) for t, n in zip(tensors, sizes)]).sum(0)
    stacked = torch.stack(tensors)
    if fx == "sum":
        return stacked.sum(0)
    if fx == "max":
        return stacked.amax(0)
    if fx == "min":
        return stacked.amin(0)
    raise MisconfigurationException(
        f"strategy=dp cannot combine values logged with reduce_fx={reduce_fx!r}; "
        "use mean, sum, max or min, or log a torchmetrics Metric"
    )
