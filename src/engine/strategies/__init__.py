"""Strategies this project adds to Lightning's, registered by name so `trainer.strategy=<name>` works.

- dp: DataParallel, removed from Lightning 2.0, rebuilt here (dp.py).
- pipe: model parallelism in one process, a stage of the net per device, micro-batches pipelined (pipe.py).
- pipeline: pipeline parallelism, one process per stage, on torch.distributed.pipelining (pipeline.py).
- ddp, ddp_spawn: Lightning's, with sync_batchnorm that is skipped (not fatal) on CPU, a rendezvous that says whom it
  waits for, and spawned workers that end their process group before they exit (ddp.py).
- fsdp: FSDP2 through Lightning's ModelParallelStrategy, on CPU and GPU (fsdp.py); built by
  engine.build from the name, because Lightning reserves the string "fsdp" for its GPU-only FSDP1.
"""

from lightning.pytorch.strategies import StrategyRegistry

from engine.strategies.ddp import DDPStrategy
from engine.strategies.dp import DataParallelStrategy
from engine.strategies.pipe import PipeStrategy
from engine.strategies.pipeline import PipelineStrategy


def register() -> None:
    """Idempotent: safe to call from every process and every test."""
    DDPStrategy.register_strategies(StrategyRegistry)
    StrategyRegistry.register(
        "dp", DataParallelStrategy, description="DataParallel: one process, several GPUs", override=True
    )
    StrategyRegistry.register(
        "pipe", PipeStrategy, description="Pipelined model parallelism: one process, a stage per device", override=True
    )
    StrategyRegistry.register(
        "pipeline", PipelineStrategy, description="Pipeline parallelism: one process per stage", override=True
    )


register()
