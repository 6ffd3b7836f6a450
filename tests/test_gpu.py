"""On a CUDA GPU: what a CPU run cannot show. Every test here skips without CUDA (`make test` on a CPU machine) and
runs with `make test-gpu` on a machine with one GPU or more. With a single GPU, dp and pipe put two replicas or two
stages on the same GPU: torch's real replicate / parallel_apply, and real copies between stages running in their own
threads on CUDA. That checks the code on CUDA, not the speed of two GPUs. The models are users'
(tests/user_models.py)."""

import collections
import json
import re
import subprocess
import sys
from functools import partial

import lightning.pytorch as L
import pytest
import torch
from conftest import cli_env, run_dirs, tensorboard_scalars
from probes import StepLosses
from user_models import ResidualNet

from engine.strategies.dp import DataParallelStrategy
from engine.strategies.pipe import PipeStrategy
from project.data.digits import DigitsDataModule
from project.models.classifier import ImageClassifier
from project.tasks import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = {"PROJECT_PROFILE": "tiny"}
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # what a laptop or a login node without a GPU sees
TUTORIAL_CNN = ["~model.net", "+model.net._target_=user_models.TutorialCNN", "trusted_packages=[user_models]"]
EVERY = 5


def test_a_users_cnn_trains_on_the_gpu_and_its_checkpoint_evaluates_and_exports_without_one(cli, tmp_path):
    cli("train.py", "trainer=gpu", *TUTORIAL_CNN, env=TINY, cwd=tmp_path / "train", cold=True)
    (run,) = run_dirs(tmp_path / "train" / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "ok"
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    state = torch.load(best, weights_only=True)["state_dict"]
    assert all(t.is_cuda for t in state.values())  # saved from the GPU as it was

    cli("eval.py", f"ckpt_path={best}", *TUTORIAL_CNN[2:], env={**TINY, **NO_GPU}, cwd=tmp_path / "eval", cold=True)
    (evaluated,) = run_dirs(tmp_path / "eval" / "logs", task="eval")
    on_gpu = json.loads((run / "test_metrics.json").read_text())["test/loss"]
    on_cpu = json.loads((evaluated / "test_metrics.json").read_text())["test/loss"]
    assert on_cpu == pytest.approx(on_gpu, abs=5e-3)  # TF32 convolutions on the GPU round a little differently

    onnx = tmp_path / "model.onnx"
    cli("export.py", f"ckpt_path={best}", f"output={onnx}", *TUTORIAL_CNN[2:], env={**TINY, **NO_GPU}, cold=True)
    (exported,) = run_dirs(tmp_path / "logs", task="export")
    assert json.loads((exported / "export.json").read_text())["max_abs_difference"] <= 1e-4 and onnx.is_file()


@pytest.mark.parametrize(("precision", "dtype"), [("bf16_mixed", "torch.bfloat16"), ("fp16_mixed", "torch.float16")])
def test_mixed_precision_computes_in_its_type_on_the_gpu(make_cfg, tmp_path, precision, dtype):
    from probes import DtypeProbe

    DtypeProbe.seen.clear()
    cfg = make_cfg(
        f"precision={precision}",
        "model=lenet",
        "debug=fdr",
        "trainer.accelerator=gpu",
        "+callbacks.dtype._target_=probes.DtypeProbe",
    )
    train(cfg)
    assert DtypeProbe.seen == {dtype}  # autocast ran on CUDA
    metrics = json.loads((tmp_path / "out" / "test_metrics.json").read_text())
    assert torch.isfinite(torch.tensor(metrics["test/loss"]))


@pytest.mark.parametrize("trainer", ["gpu", "ddp"], ids=["one GPU", "ddp over NCCL, 1 process"])
def test_a_gpu_step_makes_no_host_sync_of_the_templates_between_agreements(cli, tmp_path, trainer):
    """torch's sync debug mode names every operation that makes the host wait for the GPU, the implicit ones too
    (tests/sync_counter.py's SyncCounter): the template's own are the agreements of engine.callbacks.checks alone."""
    probe = tmp_path / "probe"
    probe.mkdir()
    cli(
        "train.py",
        f"trainer={trainer}",
        "trainer.devices=1",
        "model=mlp",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=23",
        "test=false",
        f"callbacks.run_checks.every_n_steps={EVERY}",
        "+callbacks.sync._target_=sync_counter.SyncCounter",
        env={"PROBE_DIR": str(probe)},
        cold=True,
    )
    events = [e for e in json.loads((probe / "syncs_rank0.json").read_text()) if e["step"] >= 0]
    cuda = [e for e in events if e["kind"] == "cuda_sync"]
    ours = [e for e in cuda if e["origin"] == "template"]
    # the agreement at the end of every EVERY-th step (the probe names a step by its start), one sync each
    assert collections.Counter(e["step"] for e in ours) == {s: 1 for s in range(23) if (s + 1) % EVERY == 0}, ours
    per_origin = collections.Counter(e["origin"] for e in cuda)
    where = collections.Counter(f"{e['origin']} {e['where']}" for e in cuda)
    print(f"{trainer}: host syncs in 23 steps by origin {dict(per_origin)}; where: {dict(where)}")


def test_fsdp_on_one_gpu_trains_a_users_net_in_bf16_and_its_shards_evaluate(cli, tmp_path):
    cli("train.py", "trainer=fsdp", "trainer.devices=1", "precision=bf16_mixed", *TUTORIAL_CNN, env=TINY, cold=True)
    (run,) = run_dirs(tmp_path / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "ok"
    assert "fsdp: " in (run / "train.log").read_text()
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    assert best.is_dir()  # a sharded checkpoint
    evaluate = ["trainer=fsdp", "trainer.devices=1", *TUTORIAL_CNN[2:]]  # a sharded checkpoint needs fsdp
    cli("eval.py", f"ckpt_path={best}", *evaluate, env=TINY, cwd=tmp_path / "eval", cold=True)
    (evaluated,) = run_dirs(tmp_path / "eval" / "logs", task="eval")
    tested = json.loads((run / "test_metrics.json").read_text())["test/loss"]
    assert json.loads((evaluated / "test_metrics.json").read_text())["test/loss"] == pytest.approx(tested, abs=2e-2)


@pytest.fixture
def float32():
    """Full float32 matrix products and convolutions (no TF32): two ways of computing a step then agree closely."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def fit(strategy, devices: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A user's residual net (no BatchNorm: replicas and micro-batches normalise alike) on the GPU."""
    L.seed_everything(0)
    model = ImageClassifier(net=ResidualNet(), optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9))
    losses = StepLosses()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=devices,
        max_epochs=2,
        limit_train_batches=6,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(model, DigitsDataModule(batch_size=48))
    return losses.losses, {k: v.cpu() for k, v in model.net.state_dict().items()}


@pytest.fixture
def one_gpu(float32):
    return fit("auto")


@pytest.mark.parametrize(
    "strategy",
    [
        lambda gpu: DataParallelStrategy(parallel_devices=[gpu, gpu]),
        lambda gpu: PipeStrategy(micro_batches=4, parallel_devices=[gpu, gpu]),
    ],
    ids=["dp: 2 replicas", "pipe: 2 stages, 4 micro-batches"],
)
def test_dp_and_pipe_take_the_same_steps_on_cuda_as_one_gpu(one_gpu, strategy):
    single_losses, single_weights = one_gpu
    losses, weights = fit(strategy(torch.device("cuda", 0)))
    assert len(losses) == len(single_losses) == 12
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_losses), atol=1e-4, rtol=0)
    for key, value in single_weights.items():
        torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=lambda m: f"{key}: {m}")


def test_the_gpu_is_listed_used_by_default_and_refused_in_one_line_once_hidden(cli, tmp_path):
    listed = subprocess.run(
        [sys.executable, "-m", "engine.launch.devices"], capture_output=True, text=True, env=cli_env()
    )
    assert re.search(r"CUDA: [1-9]\d* device\(s\)", listed.stdout), listed.stdout + listed.stderr
    assert "  cuda:0  " in listed.stdout and "picks: CUDAAccelerator on cuda:0" in listed.stdout, listed.stdout
    proc = cli("train.py", "trainer=gpu", env={**TINY, **NO_GPU}, check=False, cold=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert not (tmp_path / "logs" / "train" / "runs").exists() or not run_dirs(tmp_path / "logs")


def test_a_parallel_sweep_gives_each_worker_its_gpu_and_refuses_more_workers_than_gpus(cli, tmp_path):
    gpus = torch.cuda.device_count()
    cli("train.py", "-m", "hydra/launcher=parallel", f"hydra.launcher.n_jobs={gpus}", "trainer=gpu", "seed=1,2",
        env=TINY, cold=True)  # fmt: skip
    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    for job in ("0", "1"):
        (pinned,) = re.findall(
            r"device slot \d of \d+ \(pid \d+\): GPUs (\d+),", (root / job / "train.log").read_text()
        )
        assert int(pinned) < gpus and (root / job / "test_metrics.json").is_file()
    refused = cli("train.py", "-m", "hydra/launcher=parallel", f"hydra.launcher.n_jobs={gpus + 1}", "seed=1,2",
                  env=TINY, check=False, cold=True)  # fmt: skip
    assert refused.returncode == 2 and "run at most one job per GPU" in refused.stderr


def test_throughput_counts_a_users_cnn_and_gives_mfu_against_the_gpus_peak(cli, tmp_path):
    """The FLOPs of the first batch, counted on the GPU (engine.callbacks.throughput), and MFU over the peak of
    Lightning's table for this GPU (an H200 under the name CUDA gives it, which Lightning 2.6 does not parse)."""
    from lightning.fabric.utilities.throughput import get_available_flops
    from test_throughput import tutorial_cnn_flops

    from engine.callbacks.throughput import _peak_lightning_misses

    sizes = ["data.batch_size=64", "trainer.max_epochs=1", "+trainer.limit_train_batches=30", "test=false"]
    cli("train.py", "trainer=gpu", *TUTORIAL_CNN, "callbacks=[default,throughput]", *sizes, cold=True)
    (run,) = run_dirs(tmp_path / "logs")
    scalars = tensorboard_scalars(run)
    flops, batches, mfu = (scalars[f"train/device/{k}"] for k in ("flops_per_sec", "batches_per_sec", "mfu"))
    assert set(mfu) == set(flops) == {9, 19, 29}  # every 10 steps once 10 were timed
    per_batch = tutorial_cnn_flops(64)
    assert f"Throughput: one training batch costs {per_batch:,} FLOPs" in (run / "train.log").read_text()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # the run's float32_matmul_precision: TF32's peak
    try:
        device = torch.device("cuda", 0)
        peak = _peak_lightning_misses(device, torch.float32) or get_available_flops(device, torch.float32)
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak
    for step in mfu:
        assert flops[step] == pytest.approx(per_batch * batches[step], rel=1e-5)
        assert 0 < mfu[step] < 1 and mfu[step] == pytest.approx(flops[step] / peak, rel=1e-5)


@pytest.mark.parametrize("precision", ["fp16_mixed", "bf16_mixed"])
def test_a_mixed_precision_run_killed_on_the_gpu_resumes_bit_for_bit(cli, tmp_path, precision):
    """kill -9 mid-epoch, resume from last.ckpt: the same weights as the unbroken run, to the bit. What only a GPU
    has: dropout drawn from the CUDA generator (engine.callbacks.run_state saves its state) and, in fp16, the
    gradient scaler's state (the scale, and when it next grows)."""
    from test_fault_tolerance import RUN, assert_same_weights, weights

    args = ["trainer=gpu", f"precision={precision}", *RUN]  # RUN: the MLP with dropout, deterministic, shuffled
    cli("train.py", *args, cwd=tmp_path / "unbroken", cold=True)
    killed = cli("train.py", *args, env={"KILL_AT_STEP": "5"}, cwd=tmp_path / "killed", check=False, cold=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3 and "cuda" in saved["callbacks"]["RunState"]["ranks"][0]
    if precision == "fp16_mixed":
        assert saved["MixedPrecision"]["scale"] > 0  # the scaler's state travels with the checkpoint
    cli("train.py", *args, f"ckpt_path={last}", cwd=tmp_path / "resumed", cold=True)
    (unbroken,) = run_dirs(tmp_path / "unbroken" / "logs")
    (resumed,) = run_dirs(tmp_path / "resumed" / "logs")
    assert_same_weights(weights(resumed), weights(unbroken))


def test_the_text_example_trains_in_bf16_on_the_gpu_and_its_checkpoint_generates_without_one(cli, tmp_path):
    """Data that is not images on the GPU: the GPT on bytes of text, bf16 autocast, then predict on a machine
    without a GPU continues prompts from its checkpoint."""
    gpt = ["experiment=gpt_text", "model.max_new_tokens=12", "print_config=false"]
    cli("train.py", *gpt, "trainer=gpu", "precision=bf16_mixed", env=TINY, cwd=tmp_path / "train", cold=True)
    (run,) = run_dirs(tmp_path / "train" / "logs")
    fit = json.loads((run / "fit_metrics.json").read_text())
    assert fit["status"] == "ok" and fit["val/loss"] < 5.5  # below a uniform guess over 256 bytes (ln 256 = 5.55)
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    cli("predict.py", f"ckpt_path={best}", 'data.prompts=["def "]', env={**TINY, **NO_GPU}, cwd=tmp_path, cold=True)
    (predicted,) = run_dirs(tmp_path / "logs", task="predict")
    saved = torch.load(predicted / "predictions.pt", weights_only=True)
    assert saved["names"] == ["def "] and len(saved["outputs"]) == 1
