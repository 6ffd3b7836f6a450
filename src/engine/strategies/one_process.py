"""A ParallelStrategy whose devices are all driven by this one process (dp, pipe): rank 0 of 1, whatever the
cluster environment says, with collectives that have nobody to talk to."""

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy


class OneProcessStrategy(ParallelStrategy):
    """Lightning's ParallelStrategy assumes one process per device; these strategies use several devices from
    one process, so ranks, sampler and collectives are those of a single process."""

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
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {}  # one loader for all devices

    @property
    def devices(self) -> list[torch.device]:
        assert self.parallel_devices is not None, "the Trainer sets the devices"
        return self.parallel_devices

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj
