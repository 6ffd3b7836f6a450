"""trainer=pipeline: one process per stage of the net (torch.distributed.pipelining), 2 gloo processes on CPU.

Pipelining is a memory knob, not a change of the experiment: for one seed and one batch it takes the same steps
as one device (losses, metrics and final weights within 1e-5 in fp32; here they come out bit-equal or 1e-8),
writes the same ordinary checkpoint file, and resumes from it exactly. The tests here run the real CLI;
tests/test_pipeline_parts.py checks the parts that need no processes.
"""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python

# 210 training digits: batches of 64, 64, 64 and 18 per epoch; accumulation 2, so 2 optimizer steps per epoch.
# Clipping at 0.5 clips every step (the MLP's gradient norm starts near 2): the norm must span both stages.
COMMON = [
    "seed=0",
    "model=mlp",
    "model.net.dropout=0.0",
    "model/optimizer=sgd",
    "model/scheduler=none",  # a resumed run continues the same learning rates whatever max_epochs says
    "trainer.accelerator=cpu",
    "data.test_size=4290",
    "trainer.gradient_clip_val=0.5",
    "trainer.accumulate_grad_batches=2",
    "callbacks=checkpoints",
    "+callbacks.probe._target_=pipeline_probes.StepProbe",
    "logger=csv",
    "test=false",
]
# micro_batches=4 divides 64 (4 of 16) but not 18 (M' = 3 of 6); OTHER_SCHEDULES below run 1 and 2.
PIPELINE = ["trainer=pipeline", "trainer.strategy.schedule=1f1b", "trainer.strategy.micro_batches=4"]


def train(
    out: Path, name: str, *overrides: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python train.py` from a fresh directory out/name, as in tests/conftest.py's cli fixture."""
    cwd = out / name
    cwd.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / "train.py"), *COMMON, *overrides]
    full_env = cli_env(PROBE_DIR=str(cwd), **(env or {}))
    proc = run_python(cmd, cwd, full_env, timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def probe(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / name / f"rank{rank}.json").read_text())


def weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / name / "weights.pt", weights_only=True)


def run_dir(out: Path, name: str) -> Path:
    (run,) = run_dirs(out / name / "logs")
    return run


def assert_close(actual: object, expected: object, what: str) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual), torch.as_tensor(expected), atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}"
    )


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(actual[key], value, f"{what} {key}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One device for 3 epochs; the pipeline for 2 epochs, then resumed from its last.ckpt for the third."""
    out = tmp_path_factory.mktemp("pipeline")
    train(out, "one_device", "trainer.max_epochs=3")
    train(out, "pipeline", *PIPELINE, "trainer.max_epochs=2")
    last = run_dir(out, "pipeline") / "checkpoints" / "last.ckpt"
    train(out, "resumed", *PIPELINE, "trainer.max_epochs=3", f"ckpt_path={last}", "test=true")
    return out


@pytest.mark.slow
def test_pipeline_takes_the_same_steps_as_one_device_and_resumes_exactly(runs: Path) -> None:
    one, first, resumed = probe(runs, "one_device"), probe(runs, "pipeline"), probe(runs, "resumed")
    assert len(one["losses"]) == 12 and one["global_step"] == resumed["global_step"] == 6
    assert_close(first["losses"] + resumed["losses"], one["losses"], "losses per batch")
    assert_same_weights(weights(runs, "resumed"), weights(runs, "one_device"), "final weights")
    for key, value in one["metrics"].items():  # val/acc_best too: a metric state restored from the checkpoint
        assert_close(resumed["metrics"][key], value, key)
    for name in ("pipeline", "resumed"):  # the first stage's rank logs what the last stage computed
        assert probe(runs, name, rank=1)["metrics"] == probe(runs, name)["metrics"]
        assert probe(runs, name, rank=1)["losses"] == probe(runs, name)["losses"]


@pytest.mark.slow
def test_rank_zero_logs_and_checkpoints_like_one_device(runs: Path) -> None:
    def rows(name: str) -> list[dict[str, str]]:
        with open(run_dir(runs, name) / "csv" / "metrics.csv") as f:
            return [r for r in csv.DictReader(f) if r["epoch"] == "2" and not r.get("test/acc")]

    assert rows("one_device")  # the third epoch's train and validation rows
    for got, want in zip(rows("resumed"), rows("one_device"), strict=True):
        for key, value in want.items():
            assert (got[key] == value == "") or abs(float(got[key]) - float(value)) < 1e-5, key

    ours = torch.load(run_dir(runs, "pipeline") / "checkpoints" / "last.ckpt", weights_only=True)
    theirs = torch.load(run_dir(runs, "one_device") / "checkpoints" / "last.ckpt", weights_only=True)
    assert list(ours["state_dict"]) == list(theirs["state_dict"])  # one ordinary file, the same keys in order
    (opt,), (ref,) = ours["optimizer_states"], theirs["optimizer_states"]
    assert opt["param_groups"][0]["params"] == ref["param_groups"][0]["params"]
    assert {i: s["momentum_buffer"].shape for i, s in opt["state"].items()} == {
        i: s["momentum_buffer"].shape for i, s in ref["state"].items()
    }


@pytest.mark.slow
def test_a_pipeline_checkpoint_evaluates_on_one_device(runs: Path, cli, tmp_path: Path) -> None:
    resumed = run_dir(runs, "resumed")  # it tested its best checkpoint through the pipeline
    (best,) = (resumed / "checkpoints").glob("epoch_*.ckpt")
    cli("eval.py", f"ckpt_path={best}", "trainer.accelerator=cpu", "logger=none")  # the default trainer: 1 device
    (evaluated,) = run_dirs(tmp_path / "logs", task="eval")
    ours = json.loads((evaluated / "test_metrics.json").read_text())
    assert ours == json.loads((resumed / "test_metrics.json").read_text())


@pytest.mark.slow
def test_the_pipeline_tests_under_no_grad_when_lightning_would_take_inference_mode(cli, tmp_path: Path) -> None:
    """On GPUs (NCCL) Lightning evaluates under torch.inference_mode; with gloo it takes no_grad, the only context any
    run here has evaluated the stages in. The probe turns Lightning's gloo exemption off on both ranks."""
    probe = tmp_path / "probe"
    probe.mkdir()
    cli("train.py", "trainer=pipeline", "trainer.accelerator=cpu", "+callbacks.grad_mode._target_=probes.GradModeProbe",
        env={"PROBE_DIR": str(probe), "PROJECT_PROFILE": "tiny"})  # fmt: skip
    (run,) = run_dirs(tmp_path / "logs")
    assert torch.isfinite(torch.tensor(json.loads((run / "test_metrics.json").read_text())["test/loss"]))
    for rank in (0, 1):
        assert json.loads((probe / f"grad_mode_rank{rank}.json").read_text()) == {"test": False}


OTHER_SCHEDULES = {
    "gpipe": ["trainer.strategy.schedule=gpipe", "trainer.strategy.micro_batches=1"],
    # 2 pipelines of 4 stages (2 per process) on 4 processes, each on half of every batch: 2 x 32 = 64 samples.
    # Micro-batches: 32 -> 2 of 16, the last 9 -> 1 of 9. By parameters, a process would get no weights.
    "interleaved_data_parallel": [
        "trainer.strategy.schedule=interleaved_1f1b",
        "trainer.strategy.balance=[2,1,2,1]",
        "trainer.strategy.micro_batches=2",
        "trainer.strategy.data_parallel=2",
        "trainer.devices=4",
        "launch.allow_oversubscribe=true",  # 4 processes on a 2-core CI machine
        "data.batch_size=32",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_SCHEDULES)
def test_other_schedules_take_the_same_steps(runs: Path, name: str) -> None:
    train(runs, name, "trainer=pipeline", *OTHER_SCHEDULES[name], "trainer.max_epochs=2")
    assert_close(probe(runs, name)["losses"], probe(runs, "pipeline")["losses"], "losses per batch")
    assert_same_weights(weights(runs, name), weights(runs, "pipeline"), "final weights")


# Nets written the way users write them, cut by name or automatically: each against one device. One intra-op
# thread in both runs: the ranks get one each on 2 cores, and another thread count sums in another order.
USER_NETS = {
    "tutorial_cnn split_points=[conv2]": [  # BatchNorm: exact with one micro-batch
        "+model.net._target_=user_models.TutorialCNN",
        "trainer.strategy.split_points=[conv2]",
        "trainer.strategy.micro_batches=1",
    ],
    "residual net, cut chosen": ["+model.net._target_=user_models.ResidualNet"],  # a skip over the cut
    "torchvision resnet18 split_points=[layer3]": [
        "+model.net._target_=torchvision.models.resnet18",
        "+model.net.num_classes=10",
        "data.channels=3",
        "trainer.strategy.split_points=[layer3]",
        "trainer.strategy.micro_batches=1",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", USER_NETS)
def test_nets_written_as_users_write_them_take_the_same_steps_as_one_device(tmp_path: Path, name: str) -> None:
    net = [o for o in USER_NETS[name] if not o.startswith("trainer.")]
    env = {"OMP_NUM_THREADS": "1"}
    train(tmp_path, "one_device", "~model.net", *net, "trainer.max_epochs=1", env=env)
    train(tmp_path, "pipeline", "~model.net", *USER_NETS[name], *PIPELINE[:2], "trainer.max_epochs=1", env=env)
    assert_close(probe(tmp_path, "pipeline")["losses"], probe(tmp_path, "one_device")["losses"], "losses per batch")
    assert_same_weights(weights(tmp_path, "pipeline"), weights(tmp_path, "one_device"), "final weights")


@pytest.mark.slow
def test_ranks_with_batches_of_different_shapes_fail_at_once_with_one_error_each(tmp_path: Path) -> None:
    """Each rank finds it; rank 0 says it (rank 1 in its own log, which goes with the run dir of a refused run)."""
    proc = train(tmp_path, "skewed", *PIPELINE, "data._target_=pipeline_probes.SkewedDigits", check=False)
    assert proc.returncode == 2
    said = "error: trainer=pipeline: the ranks of one pipeline got batches of different shapes"
    assert proc.stderr.count(said) == 1 and "died" not in proc.stderr, proc.stderr[-3000:]


# A table regression of a user's own (tests/user_tables.py): its forward squeezes the net's (N, 1) output to the
# targets' (N,). The pipeline runs the net in stages; the user's forward around the net must still run.
TABLE = [
    "~model",
    "+model._target_=user_tables.Regressor",
    "~data",
    "+data._target_=user_tables.DiabetesData",
    "monitor.metric=val/mse",
    "monitor.mode=min",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=2",
    "logger=csv",
]


@pytest.mark.slow
def test_a_forward_around_the_net_runs_under_the_pipeline_as_on_one_device(cli, tmp_path: Path) -> None:
    """Its plain DataLoader, shuffled, is ordered alike on one device and in the pipeline's processes
    (engine.callbacks.resumable_data)."""
    env = {"OMP_NUM_THREADS": "1"}
    cli("train.py", *TABLE, env=env, cwd=tmp_path / "one")
    cli("train.py", *TABLE, *PIPELINE, env=env, cwd=tmp_path / "pipeline")
    (one,), (piped,) = run_dirs(tmp_path / "one" / "logs"), run_dirs(tmp_path / "pipeline" / "logs")
    # the best is the second epoch's: every process must agree that it is a new best (ModelCheckpoint asks them)
    best = [sorted(p.name for p in (run / "checkpoints").glob("epoch_*")) for run in (one, piped)]
    assert best == [["epoch_001.ckpt"]] * 2
    for name in ("fit_metrics.json", "test_metrics.json"):
        ours, theirs = json.loads((piped / name).read_text()), json.loads((one / name).read_text())
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, float):
                assert_close(ours[key], value, f"{name} {key}")


@pytest.mark.slow
def test_a_forward_that_changes_the_input_before_the_net_is_refused_under_the_pipeline(cli, tmp_path: Path) -> None:
    table = [o.replace("user_tables.Regressor", "user_tables.ScaledInput") for o in TABLE]
    proc = cli("train.py", *table, *PIPELINE, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: trainer=pipeline") and "ScaledInput.forward" in line
    assert not (tmp_path / "logs" / "train" / "runs").exists() or not run_dirs(tmp_path / "logs")


# A GPT exactly as nanoGPT writes it (tests/user_text.py): `assert t <= self.block_size` in its forward, weight tying,
# its own LightningModule and character DataModule. Cut before its third transformer block.
GPT = [
    "~model",
    "+model._target_=user_text.CharGPT",
    "+model.tie_weights=false",  # a cut between tied embedding and output layers is refused: test_parallelize.py
    "~data",
    "+data._target_=user_text.PydocText",
    "monitor.metric=val/loss",
    "monitor.mode=min",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=8",
    "logger=csv",
    "test=false",
    "print_config=false",
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pipe", "pipeline"])
def test_a_gpt_written_the_nanogpt_way_is_cut_at_a_block_and_trains_as_on_one_device(cli, tmp_path, strategy):
    """Its forward asserts on the sequence length: the trace keeps the assert (torch._assert) and cuts around it."""
    env = {"OMP_NUM_THREADS": "1"}
    cut = [f"trainer={strategy}", "trainer.strategy.split_points=[model.blocks.2]", "trainer.strategy.micro_batches=2"]
    cli("train.py", *GPT, env=env, cwd=tmp_path / "one")
    cli("train.py", *GPT, *cut, env=env, cwd=tmp_path / "cut")
    (one,), (cut_run,) = run_dirs(tmp_path / "one" / "logs"), run_dirs(tmp_path / "cut" / "logs")
    ours = torch.load(cut_run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    theirs = torch.load(one / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # AdamW divides by the gradients' running RMS: micro-batches' summation
        torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=0, msg=key)  # order shows at 1e-5
