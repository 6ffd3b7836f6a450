"""export.py: every template net as ONNX and torch.export files that take raw uint8 pixels and match PyTorch on
the test set within 1e-4 at any batch size, loadable without this project; sharded fsdp checkpoints too."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_dirs
from hydra.utils import instantiate
from omegaconf import OmegaConf

from engine.data.tensors import normalize, split
from engine.tasks.export import export
from project.data.digits import MNIST_MEAN, MNIST_STD, read_mnist_5k

NETS = ["lenet", "mlp", "resnet18", "tiny_cnn"]
FORMATS = ["onnx", "torch_export"]

# Run by a separate interpreter that imports nothing of this project: what a user of the files has.
STANDALONE = """
import json, sys
import numpy as np, onnxruntime, torch
outputs = {}
for onnx_file, pt2_file, pixels_file in json.loads(sys.argv[1]):
    pixels = torch.from_numpy(np.load(pixels_file))
    onnx = onnxruntime.InferenceSession(onnx_file).run(["logits"], {"pixels": pixels.numpy()})[0]
    pt2 = torch.export.load(pt2_file).module()(pixels).detach().numpy()
    outputs[onnx_file] = {"onnx": onnx.tolist(), "pt2": pt2.tolist()}
assert not [m for m in sys.modules if m.split(".")[0] in ("project", "engine")]
print(json.dumps(outputs))
"""


@pytest.fixture(scope="module")
def test_pixels() -> torch.Tensor:
    """The digits test split as a user has it: uint8 (N, 1, 28, 28), 0-255."""
    images, _ = read_mnist_5k()
    return images[split(5000, [3500, 500, 1000], 0)[2]].unsqueeze(1)


def _checkpoint(make_cfg, folder: Path, net: str):
    cfg = make_cfg(f"model={net}")
    module = instantiate(cfg.model).eval()
    folder.mkdir()
    path = folder / "epoch_001.ckpt"
    torch.save({"hyper_parameters": OmegaConf.to_container(cfg, resolve=True), "state_dict": module.state_dict()}, path)
    return module, path


def test_every_net_exports_and_matches_pytorch_on_the_test_set(make_cfg, tmp_path, test_pixels):
    jobs, expected = [], {}
    for net in NETS:
        module, ckpt = _checkpoint(make_cfg, tmp_path / net, net)
        pixels = test_pixels[:200] if net == "resnet18" else test_pixels  # ResNet-18 at 28x28 is slow on 2 cores
        # check=false: the files are run below, as a user runs them (the task's own check: test_your_model)
        written = [
            export(make_cfg(f"ckpt_path={ckpt}", f"format={fmt}", "check=false", name="export")) for fmt in FORMATS
        ]
        assert written == [ckpt.with_suffix(".onnx"), ckpt.with_suffix(".pt2")]  # beside the checkpoint
        summary = json.loads((tmp_path / "out" / "export.json").read_text())
        assert summary["input"] == {"name": "pixels", "dtype": "uint8", "shape": ["N", 1, 28, 28]}
        np.save(tmp_path / net / "pixels.npy", pixels.numpy())
        jobs.append([*map(str, written), str(tmp_path / net / "pixels.npy")])
        with torch.no_grad():
            expected[str(written[0])] = module(normalize(pixels.squeeze(1), MNIST_MEAN, MNIST_STD))

    proc = subprocess.run(
        [sys.executable, "-c", STANDALONE, json.dumps(jobs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, outputs in json.loads(proc.stdout).items():
        for fmt in ("onnx", "pt2"):
            assert (torch.tensor(outputs[fmt]) - expected[name]).abs().max() < 1e-4, (name, fmt)


def test_one_image_at_a_time_gives_the_same_logits_as_a_batch(make_cfg, tmp_path, test_pixels):
    import onnxruntime

    _, ckpt = _checkpoint(make_cfg, tmp_path / "lenet", "lenet")
    path = export(make_cfg(f"ckpt_path={ckpt}", "format=onnx", name="export"))
    session = onnxruntime.InferenceSession(str(path))
    batch = session.run(["logits"], {"pixels": test_pixels[:7].numpy()})[0]
    single = [session.run(["logits"], {"pixels": test_pixels[i : i + 1].numpy()})[0][0] for i in range(7)]
    assert np.abs(batch - np.stack(single)).max() < 1e-5


@pytest.mark.slow
def test_a_sharded_fsdp_checkpoint_is_gathered_and_exported(cli, tmp_path, test_pixels):
    import onnxruntime

    from engine.runs.full_model import load_full_model, load_model

    cli(
        "train.py",
        "model=mlp",
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "test=false",
        env={"PROJECT_PROFILE": "tiny"},
    )
    (best,) = (run_dirs(tmp_path / "logs")[0] / "checkpoints").glob("epoch_*.ckpt")
    assert best.is_dir() and (best / "meta.pt").is_file()  # shards

    refused = cli("export.py", f"ckpt_path={best}", "format=tflite", check=False)
    assert refused.returncode == 2 and refused.stderr == "error: format=tflite: one of onnx, torch_export\n"
    assert not (tmp_path / "logs" / "export").exists()

    cli("export.py", f"ckpt_path={best}", "format=onnx")
    exported = best.with_suffix(".onnx")
    logits = onnxruntime.InferenceSession(str(exported)).run(["logits"], {"pixels": test_pixels.numpy()})[0]
    model, _ = load_full_model(str(best))
    key = "net.layers.1.weight"
    assert not torch.equal(model.state_dict()[key], load_model(str(best))[0].state_dict()[key])  # read from shards
    with torch.no_grad():
        expected = model(normalize(test_pixels.squeeze(1), MNIST_MEAN, MNIST_STD))
    assert (torch.tensor(logits) - expected).abs().max() < 1e-4
    (run,) = run_dirs(tmp_path / "logs", task="export")
    assert json.loads((run / "export.json").read_text())["max_abs_difference"] < 1e-4


def test_only_a_batch_of_token_sequences_gets_a_dynamic_length():
    """Colour pixels are integers too (uint8, N x 3 x H x W): their channels are not a sequence to vary."""
    from engine.tasks.export import dynamic_dims

    assert set(dynamic_dims(torch.zeros(2, 3, 28, 28, dtype=torch.uint8))) == {0}
    assert set(dynamic_dims(torch.zeros(2, 16, dtype=torch.long))) == {0, 1}
    assert set(dynamic_dims(torch.zeros(2, 16))) == {0}  # rows of numbers: the columns are fixed
