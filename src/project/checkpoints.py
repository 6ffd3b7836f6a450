"""Reading checkpoints safely: torch's weights_only loader, and one clear error for a bad file.

A checkpoint is a .ckpt file, or (strategy=fsdp) a directory of shards with the rest in meta.pt.
"""

import zipfile
from pathlib import Path
from typing import Any

from project.errors import UserError

SHARDED_METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / SHARDED_METADATA).is_file()


def check_readable(path: str) -> Path:
    """Fail before any work if `path` is missing or torn (Lightning's save is not atomic: a kill can truncate it)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"ckpt_path={path}: no such file; pass the path of a .ckpt file (e.g. <run>/checkpoints/last.ckpt)")
    if p.is_dir() and not is_sharded(p):
        raise UserError(f"ckpt_path={path}: a directory without {SHARDED_METADATA}, so not a sharded checkpoint")
    target = p / SHARDED_METADATA if p.is_dir() else p
    try:
        with zipfile.ZipFile(target) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"ckpt_path={path}: not a readable checkpoint ({e}); it may have been cut off while saving, use another one") from e
    if bad is not None:
        raise UserError(f"ckpt_path={path}: corrupt entry {bad!r}; it may have been cut off while saving, use another one")
    return p


def _load(path: Path) -> dict:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"ckpt_path={path}: cannot be loaded safely ({type(e).__name__}: {e})") from e


def load_model(path: str) -> tuple[Any, dict]:
    """Rebuild the LightningModule from the run config stored in the checkpoint, with its weights loaded
    unless the checkpoint is sharded (then the fsdp strategy loads them: trainer.test(ckpt_path=...))."""
    import hydra

    p = check_readable(path)
    ckpt = _load(p / SHARDED_METADATA if is_sharded(p) else p)
    config = ckpt.get("hyper_parameters") or {}
    if "model" not in config:
        raise UserError(f"ckpt_path={path}: holds no run config; it was not written by this project's train.py")
    model = hydra.utils.instantiate(config["model"])
    if not is_sharded(p):
        model.load_state_dict(ckpt["state_dict"])
    return model, config


def resume_point(run_dir: Path) -> str | None:
    """The checkpoint a restarted run continues from, when its own directory already has one.

    That happens only when a run is started again in the same directory: a SLURM requeue (Lightning then
    finds its hpc_ckpt_*.ckpt itself, and we stay out of its way), a submitit resubmission, or a user
    pointing hydra.run.dir at an interrupted run.
    """
    if any(run_dir.glob("hpc_ckpt_*.ckpt")):
        return None
    last = run_dir / "checkpoints" / "last.ckpt"
    return str(last) if last.exists() else None
