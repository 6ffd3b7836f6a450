"""Which checkpoint a run continues from, and whether it fits the run's model. A requeued or restarted job continues
from the furthest readable checkpoint in its own directory, even if first started with `ckpt_path`: that was where it
began, not how far it got.
"""

import logging
import re
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.runs import checkpoints
from engine.runs.dirs import holds_checkpoints

log = logging.getLogger(__name__)


def newest_checkpoint(run_dir: Path) -> str | None:
    """The run dir's furthest checkpoint that is not torn (hpc_ckpt_*, last.ckpt, epoch_*), or None; ordered by the
    global step each holds, not mtime (`cp -r` changes it). Unloadable ones are passed over with a warning."""
    from engine.runs.atomic_io import remove_stale_partials

    for folder in (run_dir, run_dir / "checkpoints"):  # what the stop cut off (Lightning's requeue save beside)
        remove_stale_partials(folder)
    candidates = [
        *run_dir.glob("hpc_ckpt_*.ckpt"),
        *(run_dir / "checkpoints").glob("last.ckpt"),
        *(run_dir / "checkpoints").glob(".*.ckpt.old"),  # a sharded checkpoint killed halfway through its swap
        *(run_dir / "checkpoints").glob("epoch_*.ckpt"),
    ]
    steps = {}
    for candidate in candidates:
        try:
            steps[candidate] = _global_step(candidate)
        except Exception as e:  # cut off while saving when the job was stopped, or not a checkpoint of ours
            cause = " ".join(str(e.__cause__ or e).split())[:200]
            log.warning("Not resuming from %s: it cannot be loaded (%s)", candidate, cause)
    order = {candidate: i for i, candidate in enumerate(candidates)}
    for candidate in sorted(steps, key=lambda c: (steps[c], -order[c]), reverse=True):
        try:
            return str(checkpoints.check_readable(str(candidate)))
        except UserError as e:  # loads, but an entry is corrupt: fall back to an older one
            log.warning("Not resuming from %s: %s", candidate, e)
    return None


def _global_step(path: Path) -> int:
    """The step a checkpoint was saved at (its tensors stay on disk: mmap); -1 if it does not say."""
    step = checkpoints.load(path, mmap=True).get("global_step", -1)
    return step if isinstance(step, int) else -1


def check_output_dirs(output_dir: Path, callbacks: Any, restarted: bool) -> None:
    """Where the trainer writes checkpoints must not hold another run's (its last.ckpt would be overwritten); the
    guard checked hydra.run.dir. A restarted job continues its own; started ranks share one already checked."""
    from hydra.core.hydra_config import HydraConfig

    if restarted or (HydraConfig.initialized() and HydraConfig.get().output_subdir is None):
        return
    if holds_checkpoints(output_dir):
        raise UserError(
            f"paths.output_dir={output_dir} already holds checkpoints of an earlier run: to continue it pass "
            f"ckpt_path={output_dir / 'checkpoints' / 'last.ckpt'}; leave paths.output_dir to Hydra for a new run"
        )
    for name, node in (callbacks or {}).items():
        dirpath = node.get("dirpath") if node is not None and hasattr(node, "get") else None
        found = sorted(Path(str(dirpath)).expanduser().glob("*.ckpt")) if dirpath else []
        if found:
            last = next((path for path in found if path.name == "last.ckpt"), found[0])
            raise UserError(
                f"callbacks.{name}.dirpath={dirpath} already holds checkpoints of another run ({found[0].name}, ...): "
                f"this run's would replace them. Name an empty folder, or continue that run with ckpt_path={last}"
            )


def resume_point(run_dir: Path, restarted: bool, ckpt_path: str | None) -> str | None:
    if restarted:
        own = newest_checkpoint(run_dir)
        if own is not None:
            if ckpt_path and Path(ckpt_path).resolve() != Path(own).resolve():
                log.info("Restarted job: continuing from its own %s, not from ckpt_path=%s", own, ckpt_path)
            return own
    return ckpt_path


def best_to_test(best: str, ckpt_path: str | None) -> str:
    """The best checkpoint a resumed run records is where it was written. A run folder moved or copied since
    (to scratch, off a cluster) has it beside the checkpoint it resumed from."""
    if not best or not ckpt_path or Path(best).exists():
        return best
    beside = Path(ckpt_path).expanduser().parent / Path(best).name
    if beside.exists():
        log.info("The best checkpoint %s is not there any more; testing %s, beside ckpt_path", best, beside)
        return str(beside)
    raise UserError(
        f"ckpt_path={ckpt_path} names {best} as its best checkpoint, which is not there any more (nor beside it): "
        "test another checkpoint with eval.py ckpt_path=<file>, or add test=false"
    )


def epochs_trained(ckpt: dict) -> int:
    """Epochs a checkpoint has trained whole: the one it was saved in counts when it was saved at the epoch's end
    (Lightning's epoch progress has it processed, and a resume starts the next), not when saved within it."""
    try:
        return int(ckpt["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return int(ckpt.get("epoch") or 0)


def schedule_length(path: str, ckpt: dict, model_cfg: Any, stretch: bool) -> int | None:
    """The new length to stretch a restored schedule to, or None to restore it as saved; without
    `stretch_schedule=true` a different length (training past the cosine's end) stops the run with the choices."""
    from omegaconf import OmegaConf

    stored = [s.get("T_max") for s in ckpt.get("lr_schedulers") or [] if isinstance(s, dict)]
    wanted = OmegaConf.select(model_cfg, "scheduler.T_max")
    if not stored or stored[0] is None or wanted is None or stored[0] == wanted:
        return None
    begun = epochs_trained(ckpt)
    if stretch and wanted <= begun:  # Lightning would train nothing and test the old best file
        raise UserError(
            f"ckpt_path={path} was saved after {begun} epochs: trainer.max_epochs={wanted} leaves nothing to train. "
            f"Ask for more than {begun}, or test it with eval.py ckpt_path={path}"
        )
    if stretch:
        log.info(
            "Stretching the restored schedule from T_max=%s to T_max=%s (stretch_schedule=true)", stored[0], wanted
        )
        return int(wanted)
    what = (
        f"the restored schedule would end at epoch {stored[0]} and go up again after it"
        if wanted > stored[0]
        else f"the run would stop at epoch {wanted}, before the restored schedule's end at epoch {stored[0]}"
    )
    raise UserError(
        f"ckpt_path={path} follows a schedule of T_max={stored[0]} epochs and this run asks for {wanted} "
        f"(trainer.max_epochs): {what}. Keep trainer.max_epochs={stored[0]} to finish the planned run, add "
        "stretch_schedule=true to spread the rest of the decay over the new length, or start a new run"
    )


def check_same_model(path: str, ckpt: dict, model_cfg: Any) -> None:
    """Resuming with another architecture fails deep in load_state_dict; say which config differs instead."""
    from omegaconf import OmegaConf

    config = checkpoints.run_config(Path(path), ckpt)
    checkpoints.check_resumable(path, ckpt)
    current = OmegaConf.to_container(model_cfg, resolve=True)
    assert isinstance(current, dict)
    for key in ("_target_", "net"):
        if config["model"].get(key) != current.get(key):
            raise UserError(
                f"ckpt_path={path} was trained with model.{key}={config['model'].get(key)}, this run has "
                f"model.{key}={current.get(key)}: resume with the checkpoint's model config"
            )
    _check_same_settings(path, config["model"], current)
    # Lightning restores the optimizer and scheduler states as saved (learning rate included): a changed setting
    # would be ignored while the new checkpoints recorded it. T_max follows max_epochs: schedule_length's to judge.
    for group in ("optimizer", "scheduler"):
        saved, wanted = (_flat(node.get(group), f"model.{group}") for node in (config["model"], current))
        changed = [
            k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k) and not k.endswith(".T_max")
        ]
        if changed:
            key = changed[0] if changed[0] in saved and changed[0] in wanted else f"model.{group}"
            was, now = saved.get(key, config["model"].get(group)), wanted.get(key, current.get(group))
            raise UserError(
                f"ckpt_path={path} was trained with {key}={was}, this run asks for {key}={now}: a resume restores the "
                "optimizer and its schedule as they were saved, it cannot take other settings. Resume with the "
                "checkpoint's, or start a new run"
            )


# compile changes no weights; what a plateau schedule watches follows the run's monitor; the optimizer and scheduler
# are judged by check_same_model, T_max by its stretch
_MAY_CHANGE = re.compile(r"model\.(compile|monitor)|model\.(optimizer|scheduler)\..*")


def _check_same_settings(path: str, saved: dict, wanted: dict) -> None:
    """Every module argument stays as saved: any may feed configure_optimizers (the autoencoder's learning rate), and a
    resume restores the optimizer as saved, so a change would be ignored while new checkpoints recorded it."""
    saved_flat, wanted_flat = _flat(saved, "model"), _flat(wanted, "model")
    keys = [k for k in sorted(set(saved_flat) | set(wanted_flat)) if not _MAY_CHANGE.fullmatch(k)]
    changed = [k for k in keys if saved_flat.get(k) != wanted_flat.get(k)]
    if changed:
        key = changed[0]
        raise UserError(
            f"ckpt_path={path} was trained with {key}={saved_flat.get(key)}, this run asks for "
            f"{key}={wanted_flat.get(key)}: a resume continues the saved run as it was (its weights, and its optimizer "
            "as saved, learning rate included). Resume with the checkpoint's model config, or start a new run"
        )


def _flat(node: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    return {key: value for name, child in node.items() for key, value in _flat(child, f"{prefix}.{name}").items()}
