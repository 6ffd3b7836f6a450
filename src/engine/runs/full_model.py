"""A checkpoint's model with all its weights in this one process, also from a sharded (fsdp) checkpoint.

predict.py and export.py run a whole model on one device; a sharded checkpoint is gathered by reading every
shard through torch.distributed.checkpoint without a process group (it reshards to plain tensors).
"""

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.runs import checkpoints

# The key under which Lightning's ModelParallelStrategy stores the module's weights among the shards.
SHARDED_WEIGHTS = "state_dict"


def _load_shards(model: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {SHARDED_WEIGHTS: model.state_dict()}  # tensors that share storage with the model: loaded in place
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(path))
    except Exception as e:
        raise UserError(
            f"ckpt_path={path}: its shards do not hold this model's weights ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})"
        ) from e
    model.load_state_dict(state[SHARDED_WEIGHTS])


def load_full_model(path: str, trusted: Sequence[str] = ()) -> tuple[Any, dict]:
    """(LightningModule in eval mode with its trained weights, the run config), through the safe loader."""
    model, config = checkpoints.load_model(path, trusted)
    p = Path(path).expanduser()
    if checkpoints.is_sharded(p):
        _load_shards(model, p)
    return model.eval(), config


def datamodule_state(path: str, config: dict) -> dict:
    """What the data module saved in the checkpoint (its `state_dict()`, e.g. an image folder's class names),
    read with the same weights-only loader; empty when it saved nothing."""
    target = str((config.get("data") or {}).get("_target_", ""))
    ckpt = checkpoints.load(Path(path).expanduser(), mmap=True)
    state = ckpt.get(target.rpartition(".")[2]) if target else None
    return state if isinstance(state, dict) else {}
