"""Reading checkpoints safely: torch's weights_only loader, one clear error for a bad file, and a model rebuilt from
the checkpoint's config only out of a small set of kinds of class. A checkpoint may come from someone else, so nothing
it names may run code: no functions, no modules outside the allowed packages, no interpolations (resolvers).
"""

import inspect
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.errors import UserError

SHARDED_METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
CONFIG_KEY = "run_config"  # where a checkpoint of this project keeps the run's resolved config

# The packages whose classes (and model factories) a checkpoint may name; a module outside them is never imported.
# A user's own package joins them only by the config of the command that loads: trusted_packages=[mypackage].
ALLOWED_MODULES = (
    "project.models.",
    "project.data.",
    "engine.data.",
    "torch.nn.",
    "torch.optim.",
    "torchvision.models.",
)


def allowed(trusted: Sequence[str] = ()) -> tuple[str, ...]:
    """The allowed module prefixes, with the packages the user trusts (`mypackage` -> `mypackage.`)."""
    return ALLOWED_MODULES + tuple(f"{t.strip('.')}." for t in trusted)


def check_strategy_reads(path: str | Path, strategy: Any, task: str) -> None:
    """A sharded checkpoint (a directory, written by fsdp) is read by fsdp alone: Lightning's other strategies look
    for its weights in one file, and fail deep in their restore (KeyError: 'state_dict')."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if is_sharded(Path(path).expanduser()) and not isinstance(strategy, ModelParallelStrategy):
        raise UserError(
            f"ckpt_path={path} is sharded (written by strategy=fsdp): {task} it with trainer=fsdp "
            "(any number of devices; the shards are redistributed)"
        )


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / SHARDED_METADATA).is_file()


def refuse_empty(path: Any) -> None:
    """`ckpt_path=` or `ckpt_path=$UNSET`: Path("") is the current folder, which would mislead every later check."""
    if path is not None and not str(path).strip():
        raise UserError(
            "ckpt_path is empty (an unset shell variable?): pass the path of a .ckpt file (e.g. "
            "<run>/checkpoints/last.ckpt), or leave ckpt_path out"
        )


def check_readable(path: str) -> Path:
    """Fail before any work if `path` is missing or torn (a kill during a save can truncate it)."""
    refuse_empty(path)
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


def load(path: Path, mmap: bool = False) -> dict:
    """torch.load with weights_only=True: tensors and plain data only. Anything else is refused in one line."""
    import torch

    target = path / SHARDED_METADATA if is_sharded(path) else path
    try:
        # mmap: tensors stay on disk until touched, so reading the config of a large checkpoint is cheap
        return torch.load(target, map_location="cpu", weights_only=True, mmap=mmap and not is_sharded(path))
    except Exception as e:
        found = re.search(r"(Unsupported (?:global|operand)[^.\n]*|unsupported GLOBAL [^\n]*?)(?:\.|\n|$)", str(e))
        detail = found.group(1).strip() if found else " ".join(str(e).split())[:200]
        raise UserError(
            f"ckpt_path={path}: refused, it holds more than tensors and plain data ({detail}); "
            "loading it could run code, so it is not loaded (it was not written by this project's train.py)"
        ) from e


def run_config(path: Path, ckpt: dict) -> dict:
    """The run config a checkpoint of this project carries (in its own key; earlier versions: as the module's
    hyperparameters)."""
    config = ckpt.get(CONFIG_KEY) or ckpt.get("hyper_parameters") or {}
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(
            f"ckpt_path={path}: holds no run config; it was not written by this project's train.py, or written "
            "without the run_state callback (conf/callbacks/checkpoints.yaml lists it): keep it in callbacks"
        )
    return config


def _kinds() -> dict[str, tuple[type, ...]]:
    """The base classes a checkpoint may build, by where the node sits."""
    import lightning.pytorch as L
    import torch

    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    parts = (torch.nn.Module, torch.optim.Optimizer, *schedulers)
    return {"model": (L.LightningModule,), "data": (L.LightningDataModule,), "part": parts}


def _class_of(target: str, where: str, prefixes: tuple[str, ...]) -> Any:
    """`package.module.Class` by one attribute of the imported module (`project.models.classifier.L.<anything>` would
    reach beyond the allowed packages); the class (or factory) must be defined in an allowed package."""
    import importlib

    module_name, _, name = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"{where}._target_={target!r}: not a class of a module of the allowed packages; refused") from e
    defined_in = f"{getattr(obj, '__module__', '')}."
    if not defined_in.startswith(prefixes):
        raise UserError(
            f"{where}._target_={target!r}: defined in {defined_in[:-1]}, outside the allowed packages; refused"
        )
    return obj


def _builds(obj: Any) -> Any:
    """The class `obj` builds: itself, or a factory function's declared return class (torchvision's resnet18 ->
    ResNet); None for anything else."""
    if inspect.isclass(obj):
        return obj
    if not inspect.isfunction(obj):
        return None
    try:
        returns = inspect.signature(obj, eval_str=True).return_annotation
    except Exception:  # annotations that do not resolve: not a factory we can vouch for
        return None
    return returns if inspect.isclass(returns) else None


def check_buildable(node: Any, where: str, kind: str = "part", trusted: Sequence[str] = ()) -> None:
    """Raise unless every `_target_` under `node` is a class (or factory returning one) of the allowed packages and
    kind; module paths are checked before anything is imported, so a checkpoint cannot import code."""
    prefixes = allowed(trusted)
    if isinstance(node, list):
        for i, item in enumerate(node):
            check_buildable(item, f"{where}[{i}]", trusted=trusted)
        return
    if isinstance(node, str) and "${" in node:
        raise UserError(f"{where}={node!r}: a checkpoint's config holds resolved values, not interpolations; refused")
    if not isinstance(node, dict):
        return
    for key in node:
        if not isinstance(key, str) or "${" in key:
            raise UserError(f"{where}: a checkpoint's config has plain string keys, not {key!r}; refused")
    if "_target_" in node:
        target = node["_target_"]
        if not isinstance(target, str) or not target.startswith(prefixes):
            raise UserError(
                f"{where}._target_={target!r}: a checkpoint may only name classes of {', '.join(prefixes)}; "
                "refused (the file may come from someone else; trust a package of yours with trusted_packages=[...])"
            )
        built = _builds(_class_of(target, where, prefixes))
        kinds = _kinds()[kind]
        if built is None or not issubclass(built, kinds):
            names = " or ".join(c.__name__ for c in kinds)
            raise UserError(f"{where}._target_={target!r}: not a {names} class (or a factory of one); refused")
    for key, value in node.items():
        check_buildable(value, f"{where}.{key}", trusted=trusted)


def _without_downloads(node: Any) -> Any:
    """A factory's pretrained weights are never fetched for a checkpoint: its own weights replace them."""
    if isinstance(node, list):
        return [_without_downloads(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _without_downloads(v) for k, v in node.items()}
    if str(out.get("_target_", "")).startswith("torchvision.models."):
        out.update({k: None for k in ("weights", "weights_backbone") if k in out})
        out.update({k: False for k in ("pretrained", "pretrained_backbone") if k in out})
    return out


def _check_dense(path: Path, state_dict: dict) -> None:
    """Every stored tensor holds its elements: an expanded (stride 0) or overlapping one claims more memory than
    the file has, and the model built to its shapes would allocate that (a 2 MB file asking for gigabytes)."""
    import torch

    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.numel():
            claimed = value.numel() * value.element_size()
            if value.untyped_storage().nbytes() < claimed:
                raise UserError(
                    f"ckpt_path={path}: its tensor {key!r} claims {claimed:,} bytes but stores "
                    f"{value.untyped_storage().nbytes():,} (not a dense tensor: not written by train.py); refused"
                )


def build_model(config: dict, path: Path, state_dict: dict | None) -> Any:
    """The model of a checkpoint's config: first on the meta device (no memory), checked against the
    checkpoint's own weights, so that a config asking for a 4 TB layer fails before allocating it."""
    import hydra
    import torch

    config = _without_downloads(config)
    if "compile" in config:  # a test needs no compiler run, and the file does not choose one
        config["compile"] = False
    try:
        if state_dict is not None:
            _check_dense(path, state_dict)
            with torch.device("meta"):
                shapes = {k: tuple(v.shape) for k, v in hydra.utils.instantiate(config).state_dict().items()}
            stored = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
            if shapes != stored:
                different = sorted(set(shapes) ^ set(stored)) or [k for k in shapes if shapes[k] != stored[k]]
                raise UserError(
                    f"ckpt_path={path}: its weights do not fit the model its config describes ({different[:3]}); "
                    "refused"
                )
        else:  # sharded: the weights are in the shard files, which bound what the model may claim
            with torch.device("meta"):
                claimed = sum(
                    t.numel() * t.element_size() for t in hydra.utils.instantiate(config).state_dict().values()
                )
            on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            if claimed > on_disk:
                raise UserError(
                    f"ckpt_path={path}: its config describes a model of {claimed:,} bytes, more than its files hold "
                    f"({on_disk:,}); refused"
                )
        return hydra.utils.instantiate(config)
    except UserError:
        raise
    except Exception as e:  # a value the class refuses, folded into one line
        cause = e.__cause__ if e.__cause__ is not None else e
        raise UserError(
            f"ckpt_path={path}: its model config cannot be built ({type(cause).__name__}: "
            f"{' '.join(str(cause).split())[:300]})"
        ) from e


def check_weights_fit(path: str, ckpt: dict, model: Any) -> None:
    """A checkpoint to continue from must hold weights of this model's shapes, or Lightning's restore fails
    deep in load_state_dict."""
    if is_sharded(Path(path).expanduser()):
        return
    stored = ckpt.get("state_dict") or {}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in stored.items() if hasattr(v, "shape")}
    if shapes != found:
        different = sorted(set(shapes) ^ set(found)) or [k for k in shapes if shapes[k] != found[k]]
        raise UserError(f"ckpt_path={path}: its weights do not fit this run's model ({different[:3]}); use its config")


def check_resumable(path: str, ckpt: dict) -> None:
    """The parts of a checkpoint Lightning restores when training continues, present and of the right kind:
    otherwise Lightning fails deep inside the restore with a KeyError or an AttributeError."""
    if is_sharded(Path(path).expanduser()):
        return  # the strategy's distributed checkpoint loader checks its shards itself
    expected = {"epoch": int, "global_step": int, "state_dict": dict, "loops": dict, "optimizer_states": list}
    for key, kind in expected.items():
        if not isinstance(ckpt.get(key), kind):
            raise UserError(f"ckpt_path={path}: its {key!r} is missing or not a {kind.__name__}; cannot resume from it")
    for state in ckpt["optimizer_states"]:
        if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
            raise UserError(f"ckpt_path={path}: its optimizer state is damaged; cannot resume from it")
