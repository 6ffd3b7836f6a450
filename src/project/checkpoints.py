"""Reading checkpoints safely: torch's weights_only loader, and one clear error for a bad file."""

import zipfile
from pathlib import Path
from typing import Any

from project.errors import UserError


def check_readable(path: str) -> Path:
    """Fail before any work if `path` is missing or torn (Lightning's save is not atomic: a kill can truncate it)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"ckpt_path={path}: no such file; pass the path of a .ckpt file (e.g. <run>/checkpoints/last.ckpt)")
    if p.is_dir():
        return p  # a sharded (distributed) checkpoint: its loader checks it
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"ckpt_path={path}: not a readable checkpoint ({e}); it may have been cut off while saving, use another one") from e
    if bad is not None:
        raise UserError(f"ckpt_path={path}: corrupt entry {bad!r}; it may have been cut off while saving, use another one")
    return p


def load_model(path: str) -> tuple[Any, dict]:
    """Rebuild the LightningModule from the run config stored in the checkpoint, then load its weights."""
    import hydra
    import torch

    p = check_readable(path)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"ckpt_path={path}: cannot be loaded safely ({type(e).__name__}: {e})") from e
    config = ckpt.get("hyper_parameters") or {}
    if "model" not in config:
        raise UserError(f"ckpt_path={path}: holds no run config; it was not written by this project's train.py")
    model = hydra.utils.instantiate(config["model"])
    model.load_state_dict(ckpt["state_dict"])
    return model, config
