"""Generated inputs, looking for the next case of each kind a hostile user found: override keys and values, Optuna
search-space expressions, files given to predict.py (images of odd sizes, modes and headers, truncated, special
files, names in odd encodings) and damaged checkpoints. The promise each must keep: it works, or it is refused
with exactly one line (a UserError; exit 2 at the command line) and nothing of a run left behind.

Hypothesis draws from a fixed seed (derandomize) with a small budget in `make test`; `make fuzz` runs
FUZZ_EXAMPLES (default 500) of each.
"""

import io
import os
import stat
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, cli_env, run_python
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from engine.errors import UserError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0")) or None
settings.register_profile(
    "suite", derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
settings.load_profile("suite")


def examples(default: int):
    return settings(max_examples=EXAMPLES or default)


# ---------------------------------------------------------------- the command line


KEYS = st.one_of(
    st.sampled_from(
        ["seed", "trainer.max_epochs", "model.optimizer.lr", "data.batch_size", "ckpt_path", "paths.log_dir"]
    ),
    st.text(st.characters(codec="utf-8", exclude_characters="=\x00"), min_size=1, max_size=300),
)
VALUES = st.one_of(
    st.integers(min_value=-(10**400), max_value=10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=5000),
    st.sampled_from(["null", "true", "[]", "{}", "[1,2", "${oc.env:HOME}", "${nope}", "a,b", "'", "~", "?"]),
)


@examples(12)
@given(prefix=st.sampled_from(["", "+", "++", "~"]), key=KEYS, value=VALUES)
@example(prefix="", key="\r", value="0")  # found: Hydra's message quoted the key, its line break and all
@example(prefix="", key="k" * 260, value="0")  # the issue's: an OSError traceback from a file name
@example(prefix="", key="seed", value="9" * 5000)  # Python refuses to parse integers of thousands of digits
def test_any_override_composes_or_is_refused_in_one_line(tmp_path_factory, prefix, key, value):
    cwd = tmp_path_factory.mktemp("cli")
    argv = [sys.executable, str(REPO / "train.py"), f"{prefix}{key}={value}", "--cfg", "job"]
    proc = run_python(argv, cwd, cli_env())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    if proc.returncode == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (cwd / "logs").exists()


# ---------------------------------------------------------------- Optuna's search space


NUMBERS = st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=True, width=32))


@st.composite
def sweep_expressions(draw) -> str:
    a, b = draw(NUMBERS), draw(NUMBERS)
    kind = draw(st.sampled_from(["interval", "log", "int", "range", "choice", "intlog"]))
    return {
        "interval": f"interval({a},{b})",
        "log": f"tag(log,interval({a},{b}))",
        "int": f"int(interval({a},{b}))",
        "intlog": f"tag(log,int(interval({a},{b})))",
        "range": f"range({a},{b},{draw(NUMBERS)})",
        "choice": f"choice({a},{b})",
    }[kind]


@examples(150)
@given(expression=sweep_expressions())
def test_any_search_space_expression_is_a_distribution_or_one_line(expression):
    """Validated before any sweep dir or study exists (engine_optuna_sweeper.space.distribution)."""
    import optuna
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.engine_optuna_sweeper.space import distribution

    try:
        (override,) = OverridesParser.create().parse_overrides([f"model.optimizer.lr={expression}"])
    except Exception:  # Hydra's grammar refuses it: one line at the command line (engine.entry)
        return
    try:
        found = distribution(override)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(found, optuna.distributions.BaseDistribution)


# ---------------------------------------------------------------- files given to predict.py


SPEC = None


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, its pixel data cut off after a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))


@st.composite
def image_files(draw) -> bytes:
    kind = draw(st.sampled_from(["image", "truncated", "header", "bytes"]))
    if kind == "header":
        return _png_header(draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1)))
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    mode = draw(st.sampled_from(["1", "L", "LA", "P", "RGB", "RGBA", "I", "F", "I;16", "CMYK"]))
    size = (draw(st.integers(1, 64)), draw(st.integers(1, 64)))
    fmt = draw(st.sampled_from(["PNG", "BMP", "TIFF", "GIF", "WEBP", "JPEG"]))
    buffer = io.BytesIO()
    try:
        Image.new(mode, size).save(buffer, format=fmt)
    except (OSError, ValueError, KeyError):  # a mode the format cannot hold
        Image.new("L", size).save(buffer, format="PNG")
    data = buffer.getvalue()
    return data[: draw(st.integers(1, len(data) - 1))] if kind == "truncated" else data


NAMES = st.binary(min_size=1, max_size=40).filter(
    lambda b: b"/" not in b and b"\x00" not in b and b not in (b".", b"..")
)


@examples(40)
@given(files=st.lists(st.tuples(NAMES, image_files()), min_size=1, max_size=4, unique_by=lambda f: f[0]))
@example(files=[(b"\n", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")])  # found: a name with a line break, quoted
@example(files=[(b"\xff\xfe.png", b"not an image")])  # a name that is not UTF-8
def test_any_folder_of_files_is_read_or_refused_in_one_line(tmp_path_factory, files):
    from engine.data.inputs import PredictInputs
    from engine.data.spec import InputSpec

    folder = Path(tmp_path_factory.mktemp("inputs"))
    for name, data in files:
        path = os.path.join(os.fsencode(folder), name + b".png")  # any bytes the file system takes as a name
        with open(path, "wb") as f:
            f.write(data)
    spec = InputSpec(1, 28, 28, (0.1307,), (0.3081,))
    try:
        inputs = PredictInputs(str(folder), spec)
    except UserError as e:
        assert "\n" not in str(e)
        return
    for i in range(len(inputs)):
        item = inputs[i]
        assert item["input"].shape == (1, 28, 28) and isinstance(item["name"], str)


def test_a_fifo_or_a_huge_image_is_refused_before_it_is_read(cli, tmp_path):
    """A FIFO given to input= hung predict.py; a 20000x20000 PNG was PIL's DecompressionBombError traceback."""
    os.mkfifo(tmp_path / "pipe")
    proc = cli("predict.py", "ckpt_path=x.ckpt", f"input={tmp_path / 'pipe'}", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: input={tmp_path / 'pipe'}: a FIFO, not a file or a folder; pass a regular file"
    )
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "huge.png").write_bytes(_png_header(20000, 20000))
    from engine.data.inputs import PredictInputs
    from engine.data.spec import InputSpec

    with pytest.raises(
        UserError,
        match=r"huge.png is not a readable image .*400000000 pixels: more than PROJECT_MAX_IMAGE_PIXELS=67108864",
    ):
        PredictInputs(str(tmp_path / "big"), InputSpec(1, 28, 28, (0.1,), (0.3,)))


# ---------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from omegaconf import OmegaConf

    from project.models.mlp import MLP

    cfg = {
        "model": {
            "_target_": "project.models.classifier.ImageClassifier",
            "num_classes": 10,
            "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.001},
            "net": {"_target_": "project.models.mlp.MLP", "in_features": 784, "hidden": [16], "num_classes": 10},
        }
    }
    from project.models.classifier import ImageClassifier

    model = ImageClassifier(MLP(784, [16], 10), optimizer=lambda p: torch.optim.Adam(p))
    path = tmp_path_factory.mktemp("ckpt") / "good.ckpt"
    torch.save({"run_config": OmegaConf.to_container(OmegaConf.create(cfg)), "state_dict": model.state_dict()}, path)
    return path


@examples(40)
@given(
    damage=st.sampled_from(["flip", "cut", "resize", "drop_key", "drop_tensor", "type"]), where=st.integers(0, 10**9)
)
def test_any_damaged_checkpoint_loads_or_is_refused_in_one_line(tmp_path_factory, checkpoint, damage, where):
    from engine.runs.full_model import load_model

    data = bytearray(checkpoint.read_bytes())
    path = Path(tmp_path_factory.mktemp("damaged")) / "damaged.ckpt"
    if damage in ("flip", "cut"):
        at = where % len(data)
        if damage == "flip":
            data[at] ^= 0xFF
        else:
            data = data[:at]
        path.write_bytes(bytes(data))
    else:
        ckpt = torch.load(checkpoint, weights_only=True)
        keys = sorted(ckpt["state_dict"])
        key = keys[where % len(keys)]
        if damage == "resize":
            ckpt["state_dict"][key] = torch.zeros(3, 7)
        elif damage == "drop_tensor":
            del ckpt["state_dict"][key]
        elif damage == "drop_key":
            del ckpt[sorted(ckpt)[where % len(ckpt)]]
        else:
            ckpt["run_config"]["model"]["num_classes"] = "ten"
        torch.save(ckpt, path)
    try:
        model, _ = load_model(str(path))
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(model, torch.nn.Module)


def test_a_config_path_that_is_a_special_file_is_refused_wherever_it_is(make_cfg, tmp_path):
    """Every path of the config alike: the data's, a checkpoint's, a user's own key (the mechanism, not a list)."""
    from engine.config.schema import check_files

    os.mkfifo(tmp_path / "fifo")
    for key in ("ckpt_path", "paths.data_dir", "callbacks.model_checkpoint.dirpath"):
        with pytest.raises(UserError, match=rf"^{key}=.*fifo: a FIFO, not a file or a folder"):
            check_files(make_cfg(f"{key}={tmp_path / 'fifo'}"))
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)
    assert np is not None
