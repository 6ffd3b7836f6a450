"""`model.compile` on a user's CNN, through the CLI: the compiled run trains as the eager one does, its checkpoints
carry the net's own keys, and eval.py loads them without compiling. On CPU with `aot_eager` (dynamo and AOTAutograd
without a code generator: the same kernels, so the same numbers to the bit); on a GPU with inductor, the default,
in tests/test_gpu.py style (skipped without CUDA)."""

import json

import pytest
import torch
from conftest import run_dirs, tensorboard_scalars

pytestmark = pytest.mark.slow

TINY = {"PROJECT_PROFILE": "tiny"}
TUTORIAL_CNN = ["~model.net", "+model.net._target_=user_models.TutorialCNN", "trusted_packages=[user_models]"]


def trained(cli, where, *overrides: str, env: dict, cold: bool = False) -> tuple[dict, float]:
    cli("train.py", *TUTORIAL_CNN, *overrides, env=env, cwd=where, cold=cold)
    (run,) = run_dirs(where / "logs")
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    return state, json.loads((run / "test_metrics.json").read_text())["test/loss"]


def evaluated(cli, where, run_dir, *overrides: str, env: dict, cold: bool = False) -> float:
    (best,) = (run_dir / "checkpoints").glob("epoch_*.ckpt")
    cli("eval.py", f"ckpt_path={best}", *TUTORIAL_CNN[2:], *overrides, env=env, cwd=where, cold=cold)
    (run,) = run_dirs(where / "logs", task="eval")
    return json.loads((run / "test_metrics.json").read_text())["test/loss"]


def test_a_compiled_users_cnn_trains_as_the_eager_one_and_its_checkpoint_evaluates_uncompiled(cli, tmp_path):
    compiled, compiled_test = trained(cli, tmp_path / "compiled", "model.compile=aot_eager", env=TINY)
    eager, eager_test = trained(cli, tmp_path / "eager", env=TINY)
    assert compiled.keys() == eager.keys() and not [k for k in compiled if "_orig_mod" in k]
    for key, value in eager.items():
        assert torch.equal(compiled[key], value), key
    assert compiled_test == eager_test
    (run,) = run_dirs(tmp_path / "compiled" / "logs")
    assert evaluated(cli, tmp_path / "eval", run, env=TINY) == compiled_test


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_compiles_a_users_cnn_on_the_gpu_and_its_checkpoint_evaluates_uncompiled(cli, tmp_path):
    gpu = {"env": TINY, "cold": True}  # processes of their own, as every CLI run on the GPU in tests/test_gpu.py
    compiled, compiled_test = trained(cli, tmp_path / "compiled", "trainer=gpu", "model.compile=true", **gpu)
    eager, eager_test = trained(cli, tmp_path / "eager", "trainer=gpu", **gpu)
    assert compiled.keys() == eager.keys() and not [k for k in compiled if "_orig_mod" in k]
    # Step by step the same losses, to rounding: inductor's fused kernels round differently. (Not every weight: the
    # bias of a convolution before BatchNorm gets a gradient of rounding noise alone, which Adam scales to full steps
    # whose sign differs between any two kernels, as the first run on an H200 showed.)
    losses = [tensorboard_scalars(run_dirs(tmp_path / w / "logs")[0])["train/loss_step"] for w in ("compiled", "eager")]
    assert losses[0].keys() == losses[1].keys() == set(range(6))  # the tiny profile's 2 epochs of 3 batches
    for step, loss in losses[1].items():
        assert losses[0][step] == pytest.approx(loss, abs=1e-3), step
    assert compiled_test == pytest.approx(eager_test, abs=1e-3)
    (run,) = run_dirs(tmp_path / "compiled" / "logs")
    assert evaluated(cli, tmp_path / "eval", run, "trainer=gpu", **gpu) == pytest.approx(compiled_test, abs=1e-3)


def test_a_backend_whose_package_is_missing_is_one_line_naming_it(cli, tmp_path):
    """torch lists tvm and openxla whether or not their packages are installed; it says so at the first batch."""
    import importlib.util

    if importlib.util.find_spec("tvm") is not None:
        pytest.skip("tvm is installed here")
    proc = cli("train.py", "model.compile=tvm", env=TINY, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: model.compile=tvm: that backend cannot run here (ImportError: Please install apache-tvm")
    )
    swept = cli("train.py", "-m", "model.compile=tvm", env=TINY, check=False, cwd=tmp_path / "sweep")  # a job's
    assert swept.returncode == 2  # failure: the same line in its error.txt
    (job,) = (tmp_path / "sweep" / "logs" / "train" / "multiruns").glob("*/0")
    assert (job / "error.txt").read_text().startswith("model.compile=tvm: that backend cannot run here")
    bad = cli("train.py", "model.compile=relu", env=TINY, check=False)
    line = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and "TESTING_ONLY" not in line and "inductor" in line and "aot_eager" in line, line
