"""`trainer.strategy=fsdp`: FSDP2 (torch's `fully_shard`) through Lightning's ModelParallelStrategy.

Lightning's own "fsdp" wraps FSDP1, which PyTorch is retiring, and refuses CPU; FSDP2 runs the same code on CUDA and
CPU (gloo), so the CPU tests cover the GPU path. What is one unit: engine.strategies.parallelize."""

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from torch.distributed.constants import default_pg_timeout

from engine.errors import UserError
from engine.launch.ranks import RankWatchingLauncher
from engine.runs.atomic_io import fsync_dir
from engine.strategies import parallelize, rendezvous
from engine.strategies.ddp import in_floating_point


class FSDPStrategy(ModelParallelStrategy):
    """Pure data-parallel sharding: the device mesh is one dimension over all N processes."""

    rendezvous_timeout_s = 300  # set from launch.rendezvous_timeout_s by engine.build

    def __init__(
        self,
        units: list[str] | None = None,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.units = [str(u) for u in units] if units else None
        self.activation_checkpointing = activation_checkpointing

    def setup_environment(self) -> None:
        # ModelParallelStrategy's "auto" makes the mesh nodes x devices (devices for tensor parallelism);
        # for FSDP every process is a data-parallel shard, or two ranks would get the same batches.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint is written into a staging directory and swapped in by rename, so a kill mid-save
        leaves the previous one whole (Lightning rewrites the shards in place and writes meta.pt last)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # one file: AtomicCheckpointIO
        path = Path(self.broadcast(str(filepath)))
        staging, old = path.with_name(f".{path.name}.staging"), path.with_name(f".{path.name}.old")
        if self.global_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier("checkpoint staging")
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("checkpoint written")
        if self.global_rank == 0:
            fsync_dir(staging)
            if path.exists():
                path.rename(old)
            staging.rename(path)  # the only moment without a checkpoint at `path`; resume then takes `old`
            fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier("checkpoint swapped")

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return super().reduce(in_floating_point(tensor, reduce_op), group, reduce_op)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = RankWatchingLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def parallelize(self, net: Any) -> None:
        """Shard `net` over this strategy's mesh: called by a LightningModule's configure_model that hands its net
        over (ImageClassifier does, to compile after sharding), else by setup. Idempotent."""
        assert self.lightning_module is not None
        mesh = self.device_mesh["data_parallel"]
        parallelize.shard(self.lightning_module, net, mesh, self.units, self.activation_checkpointing)

    def setup(self, trainer: Any) -> None:
        """ModelParallelStrategy.setup, with our sharding policy for a module that did not shard itself (in place of
        Lightning's demand for configure_model); evaluation runs under no_grad, as Lightning's FSDP strategy does."""
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
        from lightning.pytorch.strategies.model_parallel import _materialize_distributed_module
        from lightning.pytorch.trainer.states import TrainerFn

        module = self.lightning_module
        assert self.model is not None and self.accelerator is not None and module is not None
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False  # no_grad, as gloo takes: FSDP2 cannot gather under inference_mode
        self.accelerator.setup(trainer)
        self.parallelize(parallelize.net_of(module))
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()  # move all remaining layers if any left on CPU.
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def post_backward(self, closure_loss: Any) -> None:
        """A parameter without a gradient after the first backward never gets an optimizer state under FSDP, so no
        checkpoint of the run would load ("Missing optimizer state for parameter"): refused then, on every rank."""
        super().post_backward(closure_loss)
        if getattr(self, "_gradients_checked", False):
            return
        self._gradients_checked = True
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:  # a loss of its own per optimizer (a GAN's): not ours
            return
        params = self.lightning_module.named_parameters()
        missing = [name for name, p in params if p.requires_grad and p.grad is None]
        anywhere = torch.tensor(float(bool(missing)), device=self.root_device)
        torch.distributed.all_reduce(anywhere, op=torch.distributed.ReduceOp.MAX)  # every rank refuses, or none
        if anywhere.item():
            missing = missing or ["a parameter on another rank"]
            raise UserError(
                f"trainer=fsdp: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} got no gradient in the "
                "first training step (forward does not use it): under fsdp it would get no optimizer state, and no "
                "checkpoint of this run could be loaded. Remove what forward does not use, or train it with "
                "trainer.strategy=ddp_find_unused_parameters_true"
            )

    def _setup_distributed(self) -> None:
        ParallelStrategy.setup_environment(self)
        rendezvous.connect(self, self.rendezvous_timeout_s)
