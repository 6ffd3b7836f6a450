"""`strategy="dp"`: torch DataParallel, rebuilt for Lightning 2 (which removed it in 2.0).

Each replica runs the whole *step*, model and loss, on its chunk, and only the step outputs come back to the root:
logits and activations stay off GPU 0, the classic DataParallel memory trap. `self.log`: engine.strategies.pieces."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partialmethod
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from engine.strategies.one_process import OneProcessStrategy
from engine.strategies.pieces import PieceStep, combine, first_tensor, log_once


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
    """Like torch's scatter, on the CPU: every tensor chunked along dim 0, wherever it sits in the batch's
    collections, anything else copied to each piece."""
    leaves, spec = tree_flatten(obj)
    chunks = [list(torch.chunk(leaf, n)) if isinstance(leaf, Tensor) else [leaf] * n for leaf in leaves]
    pieces = min((len(c) for c in chunks), default=n)
    return [tree_unflatten([c[i] for c in chunks], spec) for i in range(pieces)]


def _replicate_sharing_parameters(network: nn.Module, n: int) -> list[nn.Module]:
    """torch's replicate without the copy to other devices: parameters are non-leaf views of the root's, so gradients
    flow back; buffers as torch's (replica 0 shares the root's, the others get copies whose updates are lost)."""
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


class DataParallelStrategy(OneProcessStrategy):
    """Single-process multi-GPU training (torch DataParallel), for where ddp's processes cannot be launched. The global
    batch is `batch_size`, split across the GPUs; BatchNorm statistics are per replica (sync_batchnorm needs ddp)."""

    strategy_name = "dp"

    def __init__(self, ops: ReplicaOps | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # accelerator, parallel_devices, checkpoint_io, precision_plugin
        self.ops = ops

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

    def _step(self, method: str, context: str, *args: Any, **kwargs: Any) -> Any:
        if len(self.devices) < 2:
            return getattr(super(), method)(*args, **kwargs)
        if kwargs:
            raise TypeError(f"strategy=dp passes step arguments by position only, got {sorted(kwargs)}")
        module, ops = self.lightning_module, self.ops
        assert module is not None and ops is not None, "set up by the Trainer before any step"
        inputs = ops.scatter(args, self.devices)
        devices = self.devices[: len(inputs)]  # a batch smaller than the GPU count uses fewer
        sizes = [len(t) if (t := first_tensor(chunk)) is not None and t.dim() else 1 for chunk in inputs]
        replicas = ops.replicate(PieceStep(module, method, getattr(self.precision_plugin, context)), devices)
        results = ops.parallel_apply(replicas, inputs, devices)
        steps = [replica.module for replica in replicas if isinstance(replica, PieceStep)]
        log_once(module, steps, [records for _, records in results], sizes, self.root_device)
        return combine([output for output, _ in results], sizes, self.root_device)

    training_step = partialmethod(_step, "training_step", "train_step_context")
    validation_step = partialmethod(_step, "validation_step", "val_step_context")
    test_step = partialmethod(_step, "test_step", "test_step_context")
    predict_step = partialmethod(_step, "predict_step", "predict_step_context")
