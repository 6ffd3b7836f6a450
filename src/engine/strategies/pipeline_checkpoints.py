"""How `trainer=pipeline` saves and loads one ordinary .ckpt file, the one one device writes: rank 0 gathers every
stage's part of the state_dict and of the optimizer state and merges them in the unsplit model's order; on load,
each stage takes its part back. So a pipeline checkpoint loads on one device, under ddp and in eval.py, and back.
"""

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device

from engine.errors import UserError
from engine.strategies.ddp import DDPStrategy
from engine.strategies.pipeline_stages import to_cpu

Layout = list[list[str]]  # per param group, the names of its parameters in the group's order


class OneCheckpointFile(DDPStrategy):
    """The checkpoint hooks of engine.strategies.pipeline.PipelineStrategy, its base class. They use what that
    sets: its pipeline's process group and the names it recorded when it cut the net."""

    pp_group: Any  # this rank's pipeline: the processes that hold the other stages
    data_parallel: int  # pipelines side by side; only the first one's stages take part in a save
    _order: list[str]  # state_dict keys of the unsplit model, in order
    _param_order: list[str]  # its parameter names, in order
    _foreign: set[str]  # state_dict keys that other stages hold

    def _gather_on_zero(self, obj: Any) -> list[Any] | None:
        """Every stage's `obj` on rank 0 (the stages of the first pipeline take part), None elsewhere."""
        if self.global_rank % self.data_parallel:
            return None
        parts: list[Any] | None = [None] * dist.get_world_size(self.pp_group) if self.is_global_zero else None
        dist.gather_object(obj, parts, dst=0, group=self.pp_group)
        return parts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        parts = self._gather_on_zero(to_cpu(module.state_dict()))
        return merge_state_dicts(parts, self._order) if parts and self.is_global_zero else {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        parts = self._gather_on_zero((self._layout(optimizer), to_cpu(optimizer.state_dict())))
        return merge_optimizer_states(parts, self._param_order) if parts and self.is_global_zero else {}

    def _layout(self, optimizer: torch.optim.Optimizer) -> Layout:
        module = self.lightning_module
        assert module is not None
        return layout(optimizer, {id(p): n for n, p in module.named_parameters()})

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k not in self._foreign}, strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            mine = self._layout(optimizer)
            parts: list[Any] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(parts, mine, group=self.pp_group)
            full = global_layout(parts, self._param_order)
            optimizer.load_state_dict(split_optimizer_state(saved, full, mine))
            _optimizer_to_device(optimizer, self.root_device)


def layout(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Layout:
    """Which parameter each index of `optimizer.state_dict()` stands for (indices run over the groups in order)."""
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError as e:
        raise UserError(
            "trainer=pipeline: the optimizer holds a parameter that is not the LightningModule's; configure_optimizers "
            "must optimize self.parameters() (each stage holds only its own)"
        ) from e


def global_layout(parts: Sequence[Layout], order: Sequence[str]) -> Layout:
    """The layout one device would have: each group's parameters from every stage, in the model's order."""
    rank = {name: i for i, name in enumerate(order)}
    counts = {len(p) for p in parts}
    if len(counts) != 1:
        raise UserError(f"trainer=pipeline: the stages' optimizers have different numbers of param groups: {counts}")
    return [sorted(chain.from_iterable(p[g] for p in parts), key=rank.__getitem__) for g in range(len(parts[0]))]


def merge_optimizer_states(parts: Sequence[tuple[Layout, dict]], order: Sequence[str]) -> dict:
    """One optimizer state_dict, as one device would save it, from each stage's (layout, state_dict)."""
    full = global_layout([lay for lay, _ in parts], order)
    index = {name: i for i, name in enumerate(chain.from_iterable(full))}
    state: dict[int, Any] = {}
    for lay, sd in parts:
        local = list(chain.from_iterable(lay))
        state.update({index[local[i]]: value for i, value in sd["state"].items()})
    first = parts[0][1]["param_groups"]
    groups = [
        {**{k: v for k, v in first[g].items() if k != "params"}, "params": [index[n] for n in full[g]]}
        for g in range(len(full))
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def split_optimizer_state(saved: dict, full: Layout, mine: Layout) -> dict:
    """This stage's part of a one-device optimizer state_dict (from a pipeline checkpoint or from one device)."""
    groups = saved.get("param_groups", [])
    if len(groups) != len(full) or any(len(g["params"]) != len(names) for g, names in zip(groups, full)):
        raise UserError(
            "the checkpoint's optimizer state does not fit this model's optimizer (other parameters or param groups)"
        )
    names = {i: name for g, group in enumerate(groups) for i, name in zip(group["params"], full[g])}
    local = {name: i for i, name in enumerate(chain.from_iterable(mine))}
    state = {local[names[i]]: value for i, value in saved["state"].items() if names[i] in local}
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [local[n] for n in mine[g]]}
        for g, group in enumerate(groups)
    ]
    return {"state": state, "param_groups": param_groups}


def merge_state_dicts(parts: Sequence[dict[str, Any]], order: Sequence[str]) -> dict[str, Any]:
    """The stages' state_dicts as one, in the key order of the unsplit model. Keys outside the net (metric
    states, buffers) are on every stage and equal; the first stage's copy is kept."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            merged.setdefault(key, value)
    rank = {key: i for i, key in enumerate(order)}
    return dict(sorted(merged.items(), key=lambda item: rank.get(item[0], len(rank))))
