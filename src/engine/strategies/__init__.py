"""Registers the strategies this project adds or replaces (ddp*, dp, pipe, pipeline) under their names."""

from lightning.pytorch.strategies import StrategyRegistry

from engine.strategies.ddp import DDPStrategy
from engine.strategies.dp import DataParallelStrategy
from engine.strategies.pipe import PipeStrategy
from engine.strategies.pipeline import PipelineStrategy


def register() -> None:
    """Idempotent: safe to call from every process and every test."""
    for name in [n for n in StrategyRegistry if n.startswith("ddp")]:
        del StrategyRegistry[name]
    DDPStrategy.register_strategies(StrategyRegistry)  # Lightning's names and settings, our class
    for name, cls in (("dp", DataParallelStrategy), ("pipe", PipeStrategy), ("pipeline", PipelineStrategy)):
        StrategyRegistry.register(name, cls, override=True)


register()
