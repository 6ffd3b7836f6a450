"""The export task: a checkpoint's net, with its input normalization built in, as a file that runs without this
project: ONNX (onnxruntime, any language) or torch.export's `.pt2` (torch.export.load).

The file goes beside the checkpoint (<checkpoint name>.onnx or .pt2) unless `output=` names another path;
the run dir keeps export.json (what was written, the input it takes, the largest difference from PyTorch).
Input: uint8 pixels (N, C, H, W), 0-255, any N; output: logits (N, num_classes).
"""

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from project.config.schema import check_config
from project.errors import UserError
from project.runs.dirs import make_output_dirs
from project.tasks.seeding import seed_run

log = logging.getLogger(__name__)

SUFFIXES = {"onnx": ".onnx", "torch_export": ".pt2"}
INPUT_NAME, OUTPUT_NAME = "pixels", "logits"
TOLERANCE = 1e-4  # largest absolute difference of logits from PyTorch's that the check accepts


def target_path(cfg: DictConfig) -> Path:
    """`output`, or beside the checkpoint: `epoch_007.ckpt` (file or sharded directory) -> `epoch_007.onnx`."""
    if cfg.output:
        return Path(cfg.output).expanduser()
    ckpt = Path(cfg.ckpt_path).expanduser()
    return ckpt.with_name(ckpt.stem + SUFFIXES[cfg.format])


def example_pixels(spec: Any, n: int, seed: int = 0) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, spec.channels, spec.height, spec.width), dtype=torch.uint8, generator=generator)


def write_onnx(module: Any, example: Any, path: Path, classes: list[str]) -> None:
    import onnx
    import torch

    batch = torch.export.Dim("batch")
    program = torch.onnx.export(
        module,
        (example,),
        dynamo=True,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_shapes=({0: batch},),
        verbose=False,
    )
    assert program is not None
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {"classes": json.dumps(classes), "input": "uint8 pixels (N, C, H, W), 0-255"})
    onnx.save(model, str(path))


def write_torch_export(module: Any, example: Any, path: Path, classes: list[str]) -> None:
    import torch

    program = torch.export.export(module, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, str(path), extra_files={"classes.json": json.dumps(classes)})


def run_exported(path: Path, fmt: str, pixels: Any) -> Any:
    """The exported file's logits for uint8 `pixels`, run the way a user without this project would."""
    import torch

    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: pixels.numpy()})[0])
    return torch.export.load(str(path)).module()(pixels)


def max_difference(module: Any, path: Path, fmt: str, pixels: Any) -> float:
    import torch

    with torch.no_grad():
        return float((run_exported(path, fmt, pixels) - module(pixels)).abs().max())


def export(cfg: DictConfig) -> Path:
    """Returns the path of the exported file."""
    import torch

    from project.data.spec import input_spec
    from project.models.pixels import RawPixels
    from project.runs.full_model import load_full_model
    from project.tasks.prediction import class_names

    check_config(cfg)
    if cfg.format not in SUFFIXES:
        raise UserError(f"format={cfg.format}: one of {', '.join(SUFFIXES)}")
    seed_run(cfg.seed)
    model, train_config = load_full_model(cfg.ckpt_path)
    spec = input_spec(train_config.get("data"), where=f"ckpt_path={cfg.ckpt_path}: data")
    path = target_path(cfg)
    if not path.parent.is_dir():
        raise UserError(f"output={path}: its folder {path.parent} does not exist")
    make_output_dirs(cfg)
    module = RawPixels(model.net, spec.mean, spec.std).eval()
    example = example_pixels(spec, 2)
    with torch.no_grad():
        classes = class_names(cfg.ckpt_path, train_config, int(module(example).shape[1]))
    try:
        (write_onnx if cfg.format == "onnx" else write_torch_export)(module, example, path, classes)
    except PermissionError as e:
        raise UserError(f"{path}: cannot be written ({e.strerror}); pass output=<a writable path>") from e
    # other batch sizes than the example's: the batch dimension must really be dynamic
    difference = max_difference(module, path, cfg.format, example_pixels(spec, 5, seed=1)) if cfg.check else None
    if difference is not None and not difference <= TOLERANCE:
        raise UserError(f"{path}: its outputs differ from PyTorch's by {difference:.2e} (more than {TOLERANCE})")
    summary = {
        "path": str(path.resolve()),
        "format": cfg.format,
        "input": {"name": INPUT_NAME, "dtype": "uint8", "shape": ["N", spec.channels, spec.height, spec.width]},
        "output": {"name": OUTPUT_NAME, "shape": ["N", len(classes)]},
        "classes": classes,
        "max_abs_difference": difference,
    }
    (Path(cfg.paths.output_dir) / "export.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("Exported %s (largest difference from PyTorch: %s)", path, difference)
    return path
