"""Reading checkpoints safely: torch's weights_only loader, and one clear error for a bad file.

A checkpoint is a .ckpt file, or (strategy=fsdp) a directory of shards with the rest in meta.pt.
"""

import logging
import zipfile
from pathlib import Path
from typing import Any

from project.errors import UserError

log = logging.getLogger(__name__)

SHARDED_METADATA = "meta.pt"
# A checkpoint names the classes that rebuild its model; only these packages are built from a file.
TRUSTED_TARGETS = (
    "project.",
    "torch.",
    "torchvision.",
)  # Lightning's name for the non-tensor part of a sharded checkpoint


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / SHARDED_METADATA).is_file()


def check_readable(path: str) -> Path:
    """Fail before any work if `path` is missing or torn (Lightning's save is not atomic: a kill can truncate it)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"ckpt_path={path}: no such file; pass the path of a .ckpt file (e.g. <run>/checkpoints/last.ckpt)"
        )
    if p.is_dir() and not is_sharded(p):
        raise UserError(f"ckpt_path={path}: a directory without {SHARDED_METADATA}, so not a sharded checkpoint")
    target = p / SHARDED_METADATA if p.is_dir() else p
    try:
        with zipfile.ZipFile(target) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(
            f"ckpt_path={path}: not a readable checkpoint ({e}); it may have been cut off while saving, use another one"
        ) from e
    if bad is not None:
        raise UserError(
            f"ckpt_path={path}: corrupt entry {bad!r}; it may have been cut off while saving, use another one"
        )
    return p


def _load(path: Path, mmap: bool = False) -> dict:
    import torch

    try:
        # mmap: tensors stay on disk until touched, so reading the config of a large checkpoint is cheap
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise UserError(f"ckpt_path={path}: cannot be loaded safely ({type(e).__name__}: {e})") from e


def _targets(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return own + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


def load_model(path: str) -> tuple[Any, dict]:
    """Rebuild the LightningModule from the run config stored in the checkpoint, with its weights loaded
    unless the checkpoint is sharded (then the fsdp strategy loads them: trainer.test(ckpt_path=...))."""
    import hydra

    p = check_readable(path)
    ckpt = _load(p / SHARDED_METADATA if is_sharded(p) else p)
    config = ckpt.get("hyper_parameters") or {}
    if "model" not in config:
        raise UserError(f"ckpt_path={path}: holds no run config; it was not written by this project's train.py")
    untrusted = [t for t in _targets(config["model"]) if not t.startswith(TRUSTED_TARGETS)]
    if untrusted:
        raise UserError(
            f"ckpt_path={path}: refusing to build {untrusted} named by the checkpoint; only "
            f"{', '.join(TRUSTED_TARGETS)} classes are built from a checkpoint"
        )
    model = hydra.utils.instantiate(config["model"])
    if not is_sharded(p):
        model.load_state_dict(ckpt["state_dict"])
    return model, config


def resume_point(run_dir: Path, restarted: bool) -> str | None:
    """The checkpoint a run continues from without ckpt_path: its own last.ckpt, only when the job is a restart.

    A restart (SLURM requeue, submitit resubmission, torchelastic restart) runs again in the same dir.
    Lightning finds its own hpc_ckpt_*.ckpt, so we stay out of its way then. Anything else that finds
    checkpoints in its dir is a new run in a reused dir, which must not silently continue an unrelated run.
    """
    last = run_dir / "checkpoints" / "last.ckpt"
    has_hpc = any(run_dir.glob("hpc_ckpt_*.ckpt"))
    if not restarted:
        if last.exists() or has_hpc:
            raise UserError(
                f"{run_dir} already holds checkpoints of an earlier run: to continue it pass "
                f"ckpt_path={last}; for a new run use a new directory (with torchrun: a new --rdzv-id)"
            )
        return None
    if has_hpc or not last.exists():
        return None
    candidates = [
        last,
        *sorted((run_dir / "checkpoints").glob("epoch_*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True),
    ]
    for candidate in candidates:
        try:
            return str(check_readable(str(candidate)))
        except UserError as e:  # cut off while saving when the job was stopped: fall back to an older one
            log.warning("Not resuming from %s: %s", candidate, e)
    return None


def check_same_model(path: str, model_cfg: Any) -> None:
    """Resuming with another architecture fails deep in load_state_dict; say which config differs instead."""
    from omegaconf import OmegaConf

    p = check_readable(path)
    config = _load(p / SHARDED_METADATA if is_sharded(p) else p, mmap=not is_sharded(p)).get("hyper_parameters") or {}
    if "model" not in config:
        raise UserError(f"ckpt_path={path}: holds no run config; it was not written by this project's train.py")
    current = OmegaConf.to_container(model_cfg, resolve=True)
    for key in ("_target_", "net"):
        if config["model"].get(key) != current.get(key):
            raise UserError(
                f"ckpt_path={path} was trained with model.{key}={config['model'].get(key)}, this run has "
                f"model.{key}={current.get(key)}: resume with the checkpoint's model config"
            )
