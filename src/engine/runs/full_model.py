"""A checkpoint's model with all its weights in this one process, also from a sharded (fsdp) checkpoint: every shard
is read through torch.distributed.checkpoint without a process group (it reshards to plain tensors).
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


def load_model(path: str, trusted: Sequence[str] = ()) -> tuple[Any, dict]:
    """Rebuild the LightningModule from the run config stored in the checkpoint, with its weights loaded
    unless the checkpoint is sharded (then the fsdp strategy loads them: trainer.test(ckpt_path=...))."""
    p = checkpoints.check_readable(path)
    ckpt = checkpoints.load(p)
    config = checkpoints.run_config(p, ckpt)
    checkpoints.check_buildable(config["model"], "model", kind="model", trusted=trusted)
    state_dict = None if checkpoints.is_sharded(p) else ckpt.get("state_dict")
    if not checkpoints.is_sharded(p) and not isinstance(state_dict, dict):
        raise UserError(f"ckpt_path={path}: holds no weights (state_dict); it is not a checkpoint of a trained model")
    model = checkpoints.build_model(config["model"], p, state_dict)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    if isinstance(config.get("data"), dict):  # a model and data that do not fit: one line, not a traceback later
        from engine.contract import check_fits

        try:
            check_fits(model, None, config["data"])
        except UserError as e:
            what = str(e).split("; make them fit")[0]
            raise UserError(f"ckpt_path={path}: {what}; its config is inconsistent") from e
    return model, config


def load_full_model(path: str, trusted: Sequence[str] = ()) -> tuple[Any, dict]:
    """(LightningModule in eval mode with its trained weights, the run config), through the safe loader."""
    model, config = load_model(path, trusted)
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
