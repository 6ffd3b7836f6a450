"""The export task: a checkpoint's LightningModule (its forward), input normalization built in, as a file that runs
without this project: ONNX (onnxruntime) or torch.export's `.pt2`. Image models take uint8 pixels (N, C, H, W);
the batch dimension is dynamic, and for integer inputs (tokens) the second too, up to the example's length.
"""

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from engine.console import show_start
from engine.errors import UserError
from engine.runs import checkpoints
from engine.runs.atomic_io import write_file
from engine.runs.dirs import make_output_dirs
from engine.runs.results import write_text
from engine.tasks.seeding import seed_run

log = logging.getLogger(__name__)

SUFFIXES = {"onnx": ".onnx", "torch_export": ".pt2"}
INPUT_NAME, OUTPUT_NAME = "pixels", "logits"
TOLERANCE = 1e-4  # largest absolute difference of logits from PyTorch's that the check accepts


def target_path(cfg: DictConfig) -> Path:
    """`output`, or beside the checkpoint: `epoch_007.ckpt` (file or sharded directory) -> `epoch_007.onnx`."""
    if cfg.output:
        return Path(cfg.output).expanduser()
    checkpoints.refuse_empty(cfg.ckpt_path)
    ckpt = Path(cfg.ckpt_path).expanduser()
    return ckpt.with_name(ckpt.stem + SUFFIXES[cfg.format])


def check_target(path: Path, suffix: str, overwrite: bool) -> None:
    """Export writes a new file: an existing one (a checkpoint, an earlier export) is replaced only when asked."""
    if path.is_dir():
        raise UserError(f"output={path} is a folder; name the file to write (output={path / ('model' + suffix)})")
    if not path.parent.is_dir():
        raise UserError(f"output={path}: its folder {path.parent} does not exist")
    if path.exists() and not overwrite:
        raise UserError(f"output={path} exists; name a new file, or pass overwrite=true to replace it")
    if path.suffix in (".ckpt", ".pt", ".pth", ".safetensors", ".json", ".yaml"):
        raise UserError(f"output={path}: an export is .onnx or .pt2, not {path.suffix}; name a new file")


def example_pixels(spec: Any, n: int, seed: int = 0) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, spec.channels, spec.height, spec.width), dtype=torch.uint8, generator=generator)


def dynamic_dims(example: Any) -> dict[int, Any]:
    """The dimensions the exported file takes in any size: the batch; for a batch of token sequences (integers,
    batch x length) the length too, up to the example's. Integer images (uint8 pixels, 4-D) keep their shape."""
    import torch

    dims = {0: torch.export.Dim("batch")}
    if not example.is_floating_point() and example.dim() == 2 and example.shape[1] > 2:
        dims[1] = torch.export.Dim("sequence", min=2, max=int(example.shape[1]))
    return dims


def write_onnx(module: Any, example: Any, path: Path, classes: list[str], input_name: str, output_name: str) -> None:
    import onnx
    import torch

    program = torch.onnx.export(
        module,
        (example,),
        dynamo=True,
        input_names=[input_name],
        output_names=[output_name],
        dynamic_shapes=(dynamic_dims(example),),
        verbose=False,
    )
    assert program is not None
    program.save(str(path))
    model = onnx.load(str(path))
    described = "uint8 pixels (N, C, H, W), 0-255" if input_name == INPUT_NAME else f"{example.dtype} (N, ...)"
    onnx.helper.set_model_props(model, {"classes": json.dumps(classes), "input": described})
    onnx.save(model, str(path))


def write_torch_export(
    module: Any, example: Any, path: Path, classes: list[str], input_name: str, output_name: str
) -> None:
    import torch

    program = torch.export.export(module, (example,), dynamic_shapes=(dynamic_dims(example),))
    torch.export.save(program, str(path), extra_files={"classes.json": json.dumps(classes)})


def run_exported(
    path: Path, fmt: str, inputs: Any, input_name: str = INPUT_NAME, output_name: str = OUTPUT_NAME
) -> Any:
    """The exported file's output for `inputs`, run the way a user without this project would."""
    import torch

    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run([output_name], {input_name: inputs.numpy()})[0])
    return torch.export.load(str(path)).module()(inputs)


def max_difference(module: Any, path: Path, fmt: str, inputs: Any, input_name: str, output_name: str) -> float:
    import torch

    with torch.no_grad():
        return float((run_exported(path, fmt, inputs, input_name, output_name) - module(inputs)).abs().max())


def _example_from_data(model: Any, train_config: dict, trusted: list[str]) -> Any:
    """One batch of the checkpoint's own DataModule: its predict_dataloader's inputs, else a validation batch's."""
    import hydra
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from engine.tasks.prediction import batch_input

    data = train_config.get("data")
    if not isinstance(data, dict):
        return None
    checkpoints.check_buildable(data, "data", kind="data", trusted=trusted)
    try:
        datamodule = hydra.utils.instantiate(data)
        if is_overridden("predict_dataloader", datamodule):
            datamodule.setup("predict")
            return batch_input(next(iter(datamodule.predict_dataloader())))
        datamodule.setup("validate")
        return batch_input(next(iter(datamodule.val_dataloader())))
    except Exception as e:  # the data is not on this machine, or its loader needs more: the one-line refusal follows
        log.info("No example batch from the checkpoint's data (%s: %s)", type(e).__name__, e)
        return None


def _example(model: Any, spec: Any, train_config: dict, trusted: list[str]) -> tuple[Any, Any, str]:
    """(the module to export, its example input, the input's name). A batch of one is taken twice: torch.export would
    make a size-1 batch dimension a constant."""
    import torch

    from engine.tasks.pixels import RawPixels

    if spec is not None:
        return RawPixels(model, spec.mean, spec.std).eval(), example_pixels(spec, 2), INPUT_NAME
    example = getattr(model, "example_input_array", None)
    if not isinstance(example, torch.Tensor) or not example.dim():
        example = _example_from_data(model, train_config, trusted)
    if not isinstance(example, torch.Tensor) or not example.dim():
        raise UserError(
            f"{type(model).__name__} has no input to export on: give it an `example_input_array` (one batched "
            "tensor), or give its DataModule a predict_dataloader (docs: your model)"
        )
    if len(example) == 1:
        example = torch.cat([example, example])
    return model.eval(), example, "input"


def export(cfg: DictConfig) -> Path:
    """Returns the path of the exported file."""
    import torch

    from engine.data import spec as spec_module
    from engine.runs.full_model import load_full_model
    from engine.tasks.prediction import class_names

    if cfg.format not in SUFFIXES:
        raise UserError(f"format={cfg.format}: one of {', '.join(SUFFIXES)}")
    seed_run(cfg.seed)
    path = target_path(cfg)
    check_target(path, SUFFIXES[cfg.format], cfg.overwrite)
    model, train_config = load_full_model(cfg.ckpt_path, cfg.trusted_packages)
    spec = spec_module.of_module(model) or spec_module.images_of(
        train_config.get("data"), where=f"ckpt_path={cfg.ckpt_path}: data", trusted=cfg.trusted_packages
    )  # None: not images; the module's own example input
    make_output_dirs(cfg)
    show_start(cfg, cfg.paths.output_dir)
    module, example, input_name = _example(model, spec, train_config, list(cfg.trusted_packages))
    classes = class_names(model, cfg.ckpt_path, train_config)
    output_name = OUTPUT_NAME if classes else "output"
    with torch.no_grad():
        output = module(example)
    if not isinstance(output, torch.Tensor):
        raise UserError(f"{type(model).__name__}.forward returns {type(output).__name__}: export needs one tensor")
    writer = write_onnx if cfg.format == "onnx" else write_torch_export
    # another batch size than the example's (and a shorter sequence): the dynamic dimensions must really be so
    other = example_pixels(spec, 5, seed=1) if spec is not None else torch.cat([example] * 3)[:5]
    if 1 in dynamic_dims(example):
        other = other[:, : max(2, other.shape[1] // 2)]
    difference: float | None = None

    def write_and_check(partial: Path) -> None:
        nonlocal difference
        writer(module, example, partial, classes or [], input_name, output_name)
        if cfg.check:  # the file as written, before it takes its name: a file that fails the check is not left
            difference = max_difference(module, partial, cfg.format, other, input_name, output_name)
            if not difference <= TOLERANCE:
                raise UserError(
                    f"{path}: its outputs differ from PyTorch's by {difference:.2e} (more than {TOLERANCE})"
                )

    write_file(path, write_and_check, "pass output=<a writable path on a disk with room>")
    shape: list[Any] = ["N", spec.channels, spec.height, spec.width] if spec is not None else ["N", *example.shape[1:]]
    if spec is None and 1 in dynamic_dims(example):
        shape[1] = f"T <= {example.shape[1]}"  # tokens: any length up to the example's
    summary = {
        "path": str(path.resolve()),
        "format": cfg.format,
        "input": {"name": input_name, "dtype": "uint8" if spec is not None else str(example.dtype), "shape": shape},
        "output": {"name": output_name, "shape": ["N", *output.shape[1:]]},
        "classes": classes,
        "max_abs_difference": difference,
    }
    write_text(Path(cfg.paths.output_dir) / "export.json", json.dumps(summary, indent=2) + "\n")
    log.info("Exported %s (largest difference from PyTorch: %s)", path, difference)
    return path
