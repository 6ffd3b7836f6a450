"""predict.py: a checkpoint's model on an IDX file, a folder of images or one image, into predictions.csv;
the same file on one device and under ddp; bad inputs end in one line. Inputs and conversion in-process."""

import csv
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_dirs
from PIL import Image

from engine.data.inputs import PredictInputs
from engine.data.spec import InputSpec, input_spec
from engine.data.tensors import normalize
from engine.errors import UserError
from project.data.digits import MNIST_MEAN, MNIST_STD, read_mnist_5k

SPEC = InputSpec(channels=1, height=28, width=28, mean=(MNIST_MEAN,), std=(MNIST_STD,))


def write_idx_images(path: Path, images: np.ndarray) -> Path:
    n, h, w = images.shape
    path.write_bytes(struct.pack(">IIII", 2051, n, h, w) + images.astype(np.uint8).tobytes())
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def probabilities(rows: list[dict[str, str]]) -> np.ndarray:
    return np.array([[float(v) for k, v in row.items() if k.startswith("prob_")] for row in rows])


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    return read_mnist_5k()[0][:30].numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint: the MLP trained for a few batches (PROJECT_PROFILE=tiny)."""
    import sys

    from conftest import REPO, cli_env, run_python

    work = tmp_path_factory.mktemp("train")
    proc = run_python([sys.executable, str(REPO / "train.py"), "model=mlp"], work, cli_env(PROJECT_PROFILE="tiny"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (best,) = (run_dirs(work / "logs")[0] / "checkpoints").glob("epoch_*.ckpt")
    return best


def test_the_spec_of_each_data_config():
    assert input_spec({"_target_": "project.data.digits.DigitsDataModule"}) == SPEC
    fashion = input_spec({"_target_": "project.data.mnist.MNISTDataModule", "dataset": "FashionMNIST"})
    assert (fashion.mean, fashion.std) == ((0.2860,), (0.3530,))
    folder = {"_target_": "project.data.image_folder.ImageFolderDataModule", "channels": 3, "image_size": [32, 48]}
    assert input_spec(folder) == InputSpec(3, 32, 48, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(UserError, match="may only name classes"):
        input_spec({"_target_": "os.system"})
    with pytest.raises(UserError, match="its inputs are not images that input= can read"):
        input_spec({"_target_": "engine.data.tensors.TensorDataModule"})


def test_idx_images_are_normalized_exactly_as_training_did(tmp_path, digits):
    inputs = PredictInputs(str(write_idx_images(tmp_path / "x-idx3-ubyte", digits)), SPEC)
    item = inputs[3]
    x = item["input"]
    assert item["name"] == inputs.names[3] == "x-idx3-ubyte[3]"
    assert torch.allclose(x, normalize(torch.from_numpy(digits[3:4]), MNIST_MEAN, MNIST_STD)[0], atol=1e-6)


def test_colour_transparent_and_larger_images_are_converted_like_the_training_data(tmp_path, digits):
    grey = Image.fromarray(digits[0])
    grey.save(tmp_path / "a.png")
    grey.convert("RGB").resize((56, 56), Image.NEAREST).save(tmp_path / "b_big_rgb.png")
    rgba = np.zeros((28, 28, 4), np.uint8)
    rgba[..., :3], rgba[..., 3] = 255, digits[0]  # a white digit drawn by its alpha channel
    Image.fromarray(rgba, "RGBA").save(tmp_path / "c_alpha.png")
    inputs = PredictInputs(str(tmp_path), SPEC)
    assert inputs.names == ["a.png", "b_big_rgb.png", "c_alpha.png"]
    original = inputs[0]["input"]
    assert inputs[1]["input"].shape == (1, 28, 28) and (inputs[1]["input"] - original).abs().mean() < 0.1
    assert (inputs[2]["input"] - original).abs().max() < 0.05  # composited onto black: the same digit
    with pytest.raises(UserError, match=r"b_big_rgb.png is 56x56 pixels, the model takes 28x28"):
        PredictInputs(str(tmp_path), SPEC, resize=False)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (struct.pack(">II", 2049, 3) + bytes(3), "an IDX file of labels, not images"),
        (struct.pack(">IIII", 2051, 5, 28, 28) + bytes(100), "the file is cut off"),
        (b"\x89PNG\r\n\x1a\n broken", "not a readable image"),
    ],
    ids=["labels", "truncated", "broken-png"],
)
def test_bad_inputs_are_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "input.png"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as info:
        PredictInputs(str(path), SPEC)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_predict_writes_one_row_per_input_in_order_with_the_models_probabilities(cli, tmp_path, checkpoint, digits):
    from engine.runs.full_model import load_model

    idx = write_idx_images(tmp_path / "t10k-images-idx3-ubyte", digits)
    cli("predict.py", f"ckpt_path={checkpoint}", f"input={idx}", "batch_size=8")
    (run,) = run_dirs(tmp_path / "logs", task="predict")
    rows = read_csv(run / "predictions.csv")
    assert [r["name"] for r in rows] == [f"t10k-images-idx3-ubyte[{i}]" for i in range(len(digits))]
    assert list(rows[0]) == ["name", "predicted", *(f"prob_{c}" for c in range(10))]
    model, _ = load_model(str(checkpoint))
    with torch.no_grad():
        expected = model.eval()(normalize(torch.from_numpy(digits), MNIST_MEAN, MNIST_STD)).softmax(1).numpy()
    assert np.abs(probabilities(rows) - expected).max() < 2e-6
    assert [int(r["predicted"]) for r in rows] == expected.argmax(1).tolist()

    # under ddp (2 CPU processes, 30 inputs in batches of 7: the last shard padded): the same single file
    ddp = tmp_path / "ddp"
    cli(
        "predict.py",
        f"ckpt_path={checkpoint}",
        f"input={idx}",
        "batch_size=7",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        cwd=ddp,
    )
    (ddp_run,) = run_dirs(ddp / "logs", task="predict")
    assert [p.name for p in ddp_run.glob("*.csv")] == ["predictions.csv"]
    ddp_rows = read_csv(ddp_run / "predictions.csv")
    assert [r["name"] for r in ddp_rows] == [r["name"] for r in rows]
    assert np.abs(probabilities(ddp_rows) - probabilities(rows)).max() < 2e-6


@pytest.mark.slow
def test_bad_inputs_end_in_one_line_and_leave_no_run_dir(cli, tmp_path, checkpoint):
    (tmp_path / "broken.png").write_bytes(b"not an image")
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": 0.1}}, foreign)
    cases = {
        ("input=missing",): "error: input=missing: no such file or folder",
        (f"input={tmp_path / 'broken.png'}",): "is not a readable image",
        (f"input={tmp_path / 'broken.png'}", f"ckpt_path={foreign}"): "holds no run config",
    }
    for overrides, message in cases.items():
        ckpt = [] if any(o.startswith("ckpt_path") for o in overrides) else [f"ckpt_path={checkpoint}"]
        proc = cli("predict.py", *ckpt, *overrides, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert not (tmp_path / "logs" / "predict").exists()


def test_a_list_of_predict_loaders_keeps_every_loaders_outputs(tmp_path):
    """Two predict loaders of 7 rows each: both count sample 0..6, and the writer, dropping a repeated index as ddp's
    padding, kept only the first loader's 7 (a blind hostile try; on one device too). Each loader's are kept, in
    loader order."""
    from types import SimpleNamespace

    from engine.callbacks.predictions import PredictionsWriter

    writer = PredictionsWriter(tmp_path)
    for loader in (0, 1):
        for batch_idx, rows in enumerate(([0, 1, 2, 3], [4, 5, 6])):
            outputs = torch.tensor([[10.0 * loader + r] for r in rows])
            writer.write_on_batch_end(None, None, outputs, rows, {"x": outputs}, batch_idx, loader)
    writer.on_predict_epoch_end(SimpleNamespace(world_size=1, is_global_zero=True), None)
    saved = torch.load(tmp_path / "predictions.pt", weights_only=True)
    assert saved["outputs"].flatten().tolist() == [*range(7), *range(10, 17)]
    assert len(saved["names"]) == 14
