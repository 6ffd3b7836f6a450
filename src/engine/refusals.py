"""A user's DataModule or model refusing the run, found in the traceback of what a task raised: one line each,
by where it was raised, not by its message. Raised anywhere else, or of another kind, it is a bug and keeps its
traceback (PROJECT_FULL_ERROR=1 shows it for these too)."""

import re
from collections.abc import Iterator
from typing import Any

from engine.errors import UserError

# What a DataModule raises when it refuses its input (a cell that is not a number, a file that is not there)
_DATA_REFUSALS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
# What a model's step raises on a batch whose sizes it does not take (torch's shape errors, an index past an
# embedding, an assert on the sequence length, a loss given targets of another batch size)
_MISFITS = (RuntimeError, IndexError, AssertionError, ValueError)


def _frames(error: BaseException) -> Iterator[Any]:
    tb = error.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def data_refusal_in(error: BaseException) -> UserError | None:
    """A value or file that a DataModule refused in one of its hooks (its setup reading a CSV, say): one line naming
    the data, as a value its constructor refuses is (engine.build.one_line)."""
    if not isinstance(error, _DATA_REFUSALS):
        return None
    import lightning.pytorch as L

    if not any(isinstance(f.f_locals.get("self"), L.LightningDataModule) for f in _frames(error)):
        return None
    return UserError(f"data: {type(error).__name__}: {' '.join(str(error).split())}")


def unshardable_loader_in(error: BaseException) -> UserError | None:
    """A DataLoader that Lightning cannot rebuild with its distributed sampler (a batch sampler of the user's own,
    not torch's BatchSampler), raised in Lightning's module that rebuilds it: one line with Lightning's fix, in
    this project's words."""
    frames = list(_frames(error))
    if not isinstance(error, TypeError) or not frames:
        return None
    if frames[-1].f_globals.get("__name__") != "lightning.pytorch.utilities.data":
        return None
    said = " ".join(str(error).split()).replace(
        "Trainer(use_distributed_sampler=False)", "trainer.use_distributed_sampler=false"
    )
    return UserError(f"data: under several processes, {said}")


def unresumable_loader_in(error: BaseException) -> UserError | None:
    """A checkpoint that holds the training loader's position, resumed with a loader that keeps none (another sampler
    than it was saved with): Lightning's RuntimeError from where it restores loader states, as one line."""
    frames = list(_frames(error))
    where = frames[-1].f_globals.get("__name__") if frames else None
    if not isinstance(error, RuntimeError) or where != "lightning.pytorch.utilities.combined_loader":
        return None
    if "stateful loaders" not in str(error):
        return None
    return UserError(
        "data: the checkpoint holds its training loader's position mid-epoch, and this run's training loader keeps no "
        "position (a sampler or batch sampler of its own, an iterable data set): resume with the loader it was "
        "saved with, or start a new run"
    )


def misfit_in(error: BaseException, model_config: Any) -> UserError | None:
    """A model failing on the data's batches before its first optimizer step (model and data disagree on a size):
    one line with the batch's shapes and the quoted settings, in place of torch's deep traceback; else None."""
    import lightning.pytorch as L
    import torch

    if not isinstance(error, _MISFITS) or isinstance(error, torch.OutOfMemoryError) or _raised_by_a_statement(error):
        return None
    steps = [f for f in _frames(error) if isinstance(f.f_locals.get("self"), L.LightningModule)]
    if not steps:
        return None
    module = steps[0].f_locals["self"]
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer: not a run's step
        return None
    if trainer is None or trainer.global_step > 0:
        return None  # after training steps: a bug of the model's, with its traceback
    batch = next((f.f_locals["batch"] for f in steps if "batch" in f.f_locals), None)
    if batch is None:  # not on a batch (configure_optimizers, a hook of the module's own): not the data's doing
        return None
    said = " ".join(str(error).split())[:300]
    shapes = f" (its batch: {_shapes(batch)})"
    quoted = _quoted_settings(_plain(model_config), said)
    hint = f"; {', '.join(quoted)} appear in the message" if quoted else ""
    return UserError(
        f"model: {type(module).__name__} does not take the data{shapes}: {type(error).__name__}: {said}; make the "
        f"model's sizes in its config fit the data's{hint}"
    )


def _raised_by_a_statement(error: BaseException) -> bool:
    """A `raise` of the user's own code, not torch's refusal of a size: the user's error, with its traceback (a model
    that raises on one rank said it did not take the data)."""
    import linecache

    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_globals.get("__name__", "").startswith(("torch", "lightning")):
        return False
    return linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).lstrip().startswith("raise ")


def _plain(config: Any) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else config
    except Exception:  # an interpolation that does not resolve: no settings to quote
        return None


def _shapes(batch: Any, depth: int = 0) -> str:
    """`float32 (32, 10), float32 (32,)`: what a batch holds, briefly."""
    import torch

    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')} {tuple(batch.shape)}"
    if depth < 2 and isinstance(batch, (list, tuple)) and len(batch) <= 4:
        return ", ".join(_shapes(item, depth + 1) for item in batch)
    if depth < 2 and isinstance(batch, dict) and len(batch) <= 4:
        return ", ".join(f"{key}: {_shapes(item, depth + 1)}" for key, item in batch.items())
    return type(batch).__name__


def _quoted_settings(model_config: Any, message: str, path: str = "model") -> list[str]:
    """The model's whole-number settings whose value the message quotes (`model.features=10` for `10x64`)."""
    numbers = set(re.findall(r"(?<![\d.])\d+(?![\d.])", message))
    found: list[str] = []
    if isinstance(model_config, dict):
        for key, value in model_config.items():
            where = f"{path}.{key}"
            if isinstance(value, dict):
                found += _quoted_settings(value, message, where)
            elif isinstance(value, int) and not isinstance(value, bool) and value > 1 and str(value) in numbers:
                found.append(f"{where}={value}")
    return found[:4]
