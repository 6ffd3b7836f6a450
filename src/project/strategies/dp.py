"""`strategy="dp"`: torch DataParallel, rebuilt for Lightning 2 (which removed it in 2.0).

One process drives every visible GPU. Each step the batch is split along dim 0 (scatter), the
LightningModule is copied to each GPU (replicate), every copy runs the whole *step*, model and loss,
on its chunk in its own thread (parallel_apply), and only the step outputs come back to the root GPU,
where scalars are averaged weighted by chunk size. Computing the loss in the replicas keeps
logits and activations off GPU 0, the classic DataParallel memory trap.

`self.log` inside a replica would write into the trainer's one result store from several threads at
once. Here replicas record what they log, and the root logs it once: plain values averaged by chunk
size, torchmetrics objects merged into the root's metric (their states add up exactly).
"""

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torchmetrics import Metric

Record = tuple[str, Any, dict[str, Any]]


@dataclass(frozen=True)
class ReplicaOps:
    """How a step's inputs are split, the module copied and the copies run."""

    scatter: Callable[[tuple, Sequence[torch.device]], list[tuple]]
    replicate: Callable[[nn.Module, Sequence[torch.device]], list[nn.Module]]
    parallel_apply: Callable[[list[nn.Module], list[tuple], Sequence[torch.device]], list[Any]]
    needs_cuda: bool


def cuda_ops() -> ReplicaOps:
    """torch's own DataParallel primitives: one replica per GPU, run in parallel threads."""
    from torch.nn.parallel import parallel_apply, replicate
    from torch.nn.parallel.scatter_gather import scatter

    return ReplicaOps(
        scatter=lambda inputs, devices: scatter(inputs, list(devices)),
        replicate=lambda module, devices: replicate(module, list(devices)),
        parallel_apply=lambda modules, inputs, devices: parallel_apply(modules, inputs, devices=list(devices)),
        needs_cuda=True,
    )


def _split(obj: Any, n: int) -> list[Any]:
    """Like torch's scatter: tensors chunked along dim 0, containers split element-wise, anything else copied."""
    if isinstance(obj, Tensor):
        return list(torch.chunk(obj, n))
    if isinstance(obj, tuple) and obj:
        chunks = zip(*(_split(o, n) for o in obj))
        if hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments
            return [type(obj)(*parts) for parts in chunks]
        return [type(obj)(parts) for parts in chunks]
    if isinstance(obj, list) and obj:
        return [list(parts) for parts in zip(*(_split(o, n) for o in obj))]
    if isinstance(obj, dict) and obj:
        return [type(obj)(zip(obj.keys(), parts)) for parts in zip(*(_split(v, n) for v in obj.values()))]
    return [obj] * n


def _replicate_sharing_parameters(network: nn.Module, n: int) -> list[nn.Module]:
    """torch's replicate without the copy to other devices: shallow module copies whose parameters are
    non-leaf views of the root's, exactly as in torch's replicas, so gradients flow back to the root.

    Buffers as in torch: its broadcast hands device 0 the root's own tensors and every other device a copy,
    so replica 0's BatchNorm updates reach the root and the other replicas' updates are lost."""
    replicas = []
    for index in range(n):
        copies = {m: m._replicate_for_data_parallel() for m in network.modules()}
        for module, replica in copies.items():
            for key, child in module._modules.items():
                replica._modules[key] = None if child is None else copies[child]
            for key, param in module._parameters.items():
                setattr(replica, key, None if param is None else param.view_as(param))
            if index > 0:
                for key, buffer in module._buffers.items():
                    if buffer is not None:
                        replica._buffers[key] = buffer.clone()
        replicas.append(copies[network])
    return replicas


def simulated_ops() -> ReplicaOps:
    """DataParallel's replica logic on the CPU: replicas run one after another and share the root's
    parameters. For tests and for debugging a module's dp behaviour without GPUs; it is not faster."""
    return ReplicaOps(
        scatter=lambda inputs, devices: _split(inputs, len(devices)),
        replicate=lambda module, devices: _replicate_sharing_parameters(module, len(devices)),
        parallel_apply=lambda modules, inputs, devices: [m(*args) for m, args in zip(modules, inputs)],
        needs_cuda=False,
    )


def _first_tensor(obj: Any) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _to(value: Any, device: torch.device) -> Any:
    """A metric state (a tensor, or a list of them for cat states) on `device`."""
    return value.to(device) if isinstance(value, Tensor) else [v.to(device) for v in value]


def _fresh_metric_states(module: nn.Module, device: torch.device) -> None:
    """Make a replica's metrics its own. Replicas are shallow copies, and a torchmetrics Metric keeps its
    wrapped `update`/`compute` in its instance dict bound to the original: a replica would update the root's
    state, from several threads at once. So: rebind them to the replica, and give it empty states on its
    device (not via reset(), which clears list states in place, the root's included)."""
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


class _ReplicaStep(nn.Module):
    """Runs one LightningModule step in a replica, recording `self.log` calls instead of logging."""

    def __init__(self, module: nn.Module, method: str, context: Callable[[], AbstractContextManager]) -> None:
        super().__init__()
        self.module = module
        self.method, self.context = method, context

    def forward(self, *args: Any) -> tuple[Any, list[Record]]:
        module, records = self.module, []
        tensor = _first_tensor(args)
        device = tensor.device if tensor is not None else torch.device("cpu")
        module.__dict__["_device"] = device  # LightningModule.device of this replica
        _fresh_metric_states(module, device)
        # An instance attribute shadows LightningModule.log in this replica only (log_dict calls it too).
        module.__dict__["log"] = lambda name, value, **kwargs: records.append((name, value, kwargs))
        try:
            with self.context():  # autocast is thread-local: enter the precision context in each replica's thread
                output = getattr(module, self.method)(*args)
        finally:
            del module.__dict__["log"]
        return output, records


def _combine(outputs: list[Any], sizes: list[int], root: torch.device) -> Any:
    """Scalars: mean weighted by chunk size (the full-batch mean). Batched tensors: concatenated in order."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            total = sum(sizes)
            return sum(o.to(root) * (n / total) for o, n in zip(outputs, sizes))
        return torch.cat([o.to(root) for o in outputs])
    if isinstance(first, Mapping):
        mapping: Any = type(first)
        return mapping((k, _combine([o[k] for o in outputs], sizes, root)) for k in first)
    if isinstance(first, (list, tuple)):
        return type(first)(_combine(list(parts), sizes, root) for parts in zip(*outputs))
    if isinstance(first, (int, float)):
        return sum(o * n for o, n in zip(outputs, sizes)) / sum(sizes)
    return first


class DataParallelStrategy(ParallelStrategy):
    """Single-process multi-GPU training (torch DataParallel) as a Lightning 2 strategy.

    Prefer ddp: it is faster and scales past one machine. dp is for one machine when multi-process
    launching is not possible (notebooks, some schedulers). The global batch is `batch_size`, split
    across the GPUs; BatchNorm statistics are per replica (sync_batchnorm needs ddp).
    """

    strategy_name = "dp"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        ops: ReplicaOps | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.ops = ops

    # One process: rank 0 of 1, whatever the cluster environment says.
    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {}  # one loader; the batch is split per step

    @property
    def devices(self) -> list[torch.device]:
        assert self.parallel_devices is not None, "the Trainer sets the devices"
        return self.parallel_devices

    @property
    def root_device(self) -> torch.device:
        return self.devices[0]

    def _configure_launcher(self) -> None:
        # The Trainer calls this once, when accelerator and devices are known: the place to refuse a
        # device that DataParallel cannot drive, before any output is written.
        ops = self.ops or cuda_ops()
        if ops.needs_cuda and not isinstance(self.accelerator, CUDAAccelerator):
            raise MisconfigurationException(
                f"strategy=dp replicates the model across CUDA GPUs, but this run's accelerator is "
                f"{type(self.accelerator).__name__}. On CPU use trainer.strategy=ddp trainer.accelerator=cpu "
                f"(one process per device); on GPUs set trainer.accelerator=gpu."
            )
        self.ops = ops
        self._launcher = None

    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        if len(self.devices) > 1 and any(
            getattr(m, "_compiled_call_impl", None) for m in self.lightning_module.modules()
        ):
            # A compiled forward is bound to the root module: every replica would run the root's weights.
            raise MisconfigurationException(
                "model.compile does not work with strategy=dp; use ddp, or model.compile=false"
            )
        super().setup(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor  # one process: the step outputs are already combined

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, method: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        if len(self.devices) < 2:
            return getattr(super(), method)(*args, **kwargs)
        if kwargs:
            raise TypeError(f"strategy=dp passes step arguments by position only, got {sorted(kwargs)}")
        module, ops = self.lightning_module, self.ops
        assert module is not None and ops is not None, "set up by the Trainer before any step"
        inputs = ops.scatter(args, self.devices)
        devices = self.devices[: len(inputs)]  # a batch smaller than the GPU count uses fewer
        sizes = [len(t) if (t := _first_tensor(chunk)) is not None and t.dim() else 1 for chunk in inputs]
        replicas = ops.replicate(_ReplicaStep(module, method, context), devices)
        results = ops.parallel_apply(replicas, inputs, devices)
        steps = [replica.module for replica in replicas if isinstance(replica, _ReplicaStep)]
        self._log_on_root(module, steps, [records for _, records in results], sizes)
        return _combine([output for output, _ in results], sizes, self.root_device)

    def _log_on_root(
        self, module: Any, replicas: list[nn.Module], records: list[list[Record]], sizes: list[int]
    ) -> None:
        """Log once what every replica logged: metric states combined, plain values reduced by their reduce_fx."""
        names = [[name for name, _, _ in replica_records] for replica_records in records]
        if any(n != names[0] for n in names[1:]):
            raise MisconfigurationException(
                f"strategy=dp: the replicas logged different keys ({names}); a step's self.log calls must not "
                "depend on which part of the batch a replica got"
            )
        total, root = sum(sizes), self.root_device
        paths = {id(m): p for p, m in replicas[0].named_modules()}
        combined: set[int] = set()
        for i, (name, value, kwargs) in enumerate(records[0]):
            values = [r[i][1] for r in records]
            if isinstance(value, Metric):
                metric = module.get_submodule(paths[id(value)])
                assert isinstance(metric, Metric)
                if id(metric) not in combined:  # the same metric logged under two names is combined once
                    _combine_metric(metric, values, root)
                    combined.add(id(metric))
                module.log(name, metric, **kwargs)
            else:
                module.log(
                    name,
                    _reduce_values(values, sizes, kwargs.get("reduce_fx", "mean"), root),
                    **{"batch_size": total, **kwargs},
                )


def _combine_metric(metric: Metric, replica_metrics: list[Metric], root: torch.device) -> None:
    """Add the replicas' states into the root metric, and set its step value to the whole batch's.

    States are combined through their own reductions (`_reduce_states`), as Metric.forward and DDP's
    metric sync do: exact for sums, counts, maxima and concatenations, whatever `full_state_update` says.
    """
    step = metric.clone()
    step.reset()
    for replica in replica_metrics:
        state = {k: _to(v, root) for k, v in replica.metric_state.items()}
        for target in (metric, step):
            target._update_count += replica._update_count  # first: mean-reduced states divide by it
            target._reduce_states(state)
    metric._computed = None
    metric._forward_cache = step.compute()  # what Lightning logs for on_step=True


def _reduce_values(values: list[Any], sizes: list[int], reduce_fx: Any, root: torch.device) -> Tensor:
    """Plain logged values of the replicas as one: the mean weighted by chunk size, or their sum, max or min."""
    tensors = [torch.as_tensor(v, dtype=torch.float32).to(root) for v in values]
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
