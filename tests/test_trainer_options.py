"""Precision, torch.compile and sync BatchNorm: accepted where they work, refused by name where not."""

import json
import sys

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python, tensorboard_scalars
from hydra.utils import instantiate

from engine import build
from engine.errors import UserError
from project.tasks import train


def test_bf16_mixed_computes_in_bfloat16_on_cpu(make_cfg, tmp_path):
    from probes import DtypeProbe

    DtypeProbe.seen.clear()
    cfg = make_cfg(
        "precision=bf16_mixed",
        "model=lenet",
        "debug=fdr",
        "trainer.accelerator=cpu",
        "+callbacks.dtype._target_=probes.DtypeProbe",
    )
    train(cfg)
    assert DtypeProbe.seen == {"torch.bfloat16"}  # autocast ran: the net's outputs are bfloat16
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "out" / "test_metrics.json").read_text())["test/loss"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs where CUDA is")
def test_fp16_mixed_without_cuda_is_refused_not_swapped_for_bf16(make_cfg):
    cfg = make_cfg("precision=fp16_mixed", "trainer.accelerator=cpu")
    with pytest.raises(UserError, match="16-mixed needs a CUDA GPU.*precision=bf16_mixed"):
        build.trainer(cfg.trainer, [], [])


def test_compile_compiles_the_forward_in_place(make_cfg, tmp_path):
    cfg = make_cfg("model=mlp", "model.compile=eager", "debug=fdr", "trainer.accelerator=cpu")
    model = instantiate(cfg.model)
    keys = set(model.state_dict())
    model.trainer = build.trainer(cfg.trainer, [], [])  # as Lightning attaches it before configure_model
    model.configure_model()
    assert model.net._compiled_call_impl is not None
    assert set(model.state_dict()) == keys  # checkpoints load with or without compile
    train(cfg)  # the compiled module trains end to end
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "out" / "test_metrics.json").read_text())["test/loss"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_mixed_trains_on_a_gpu(make_cfg, tmp_path):
    cfg = make_cfg("precision=fp16_mixed", "model=lenet", "debug=fdr", "trainer.accelerator=gpu")
    assert build.trainer(cfg.trainer, [], []).precision == "16-mixed"
    train(cfg)


@pytest.mark.slow
def test_ddp_with_sync_batchnorm_runs_on_cpu_and_says_it_is_skipped(cli, tmp_path):
    # trainer=ddp turns sync_batchnorm on; LeNet has BatchNorm. Another template crashes here on CPU.
    proc = cli("train.py", "trainer=ddp", "trainer.accelerator=cpu", "model=lenet", "debug=limit", "test=false")
    assert "sync_batchnorm=True has no effect on cpu" in proc.stderr + proc.stdout


def test_a_spawned_ddp_worker_ends_its_process_group_before_it_exits(tmp_path, monkeypatch):
    """A ddp_spawn worker leaves through Python's full exit, whose C++ destructors found gloo's threads still
    running: a rank aborted at the end of about one CPU run in five (SIGABRT after the test had finished). Each
    worker now destroys its process group when Lightning's work in it ends, also when that work failed."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    from engine.strategies.ddp import DDPStrategy, ProcessGroupEndingLauncher

    strategy = DDPStrategy(start_method="spawn")
    strategy.cluster_environment = LightningEnvironment()
    strategy._configure_launcher()
    assert isinstance(strategy.launcher, ProcessGroupEndingLauncher)

    def lightnings_work(self, process_idx: int, store: str, fail: bool = False) -> None:  # the worker's, in short
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / store}", rank=0, world_size=1)
        if fail:
            raise RuntimeError("the fit failed")

    monkeypatch.setattr(_MultiProcessingLauncher, "_wrapping_function", lightnings_work)
    strategy.launcher._wrapping_function(0, "ok")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="the fit failed"):
        strategy.launcher._wrapping_function(0, "failed", fail=True)
    assert not dist.is_initialized()

    # A worker other than rank 0 that lost its connection when rank 0 ended (on an error the main process says)
    # ends quietly: its error, sent back first, took the place of rank 0's as the run's line, one run in two.
    def loses_rank_0(self, process_idx: int) -> None:
        raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:5506")

    monkeypatch.setattr(_MultiProcessingLauncher, "_wrapping_function", loses_rank_0)
    strategy.cluster_environment.set_global_rank(1)
    with pytest.raises(SystemExit) as ended:
        strategy.launcher._wrapping_function(1)
    assert ended.value.code == 0
    strategy.cluster_environment.set_global_rank(0)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # rank 0's own: reported
        strategy.launcher._wrapping_function(0)


def test_unused_parameters_are_told_the_setting_of_the_ddp_flavour_in_use():
    """Lightning's message names its own API; the fix named ddp's setting whatever the flavour (a spawned worker's
    error also came back as a traceback: it is a UserError there now, said by the main process)."""
    from engine.errors import unused_parameters_in, user_error_in_traceback

    lightning_says = RuntimeError("It looks like your LightningModule has parameters that were not used in producing the loss returned by training_step.")  # fmt: skip  # noqa: E501
    for flavour in ("ddp", "ddp_spawn", "ddp_fork"):
        error = unused_parameters_in(lightning_says, flavour)
        assert error is not None and f"trainer.strategy={flavour}_find_unused_parameters_true" in str(error)
    text = f"Traceback (most recent call last):\nengine.errors.UserError: {unused_parameters_in(lightning_says)}"
    assert str(user_error_in_traceback(text)) == str(unused_parameters_in(lightning_says))
    assert unused_parameters_in(RuntimeError("another error")) is None


def test_a_mistake_in_a_spawned_worker_ends_the_run_as_the_same_error():
    """torch sends a worker's error back as the text of its traceback: a UserError in it is rebuilt (class and
    message), to be said in one line; a bug, or an error raised while one was handled, keeps its traceback."""
    import traceback

    from engine.callbacks.checks import DivergedError
    from engine.errors import user_error_in_traceback

    def text_of(raise_it) -> str:
        try:
            raise_it()
        except Exception:
            return f"\n\n-- Process 1 terminated with the following error:\n{traceback.format_exc()}"
        raise AssertionError("nothing raised")

    def diverged() -> None:
        raise DivergedError("diverged in epoch 2, between steps 4 and 8: the loss stopped being finite")

    def bug_while_handling() -> None:
        try:
            diverged()
        except DivergedError:
            raise KeyError("a bug in the handler")  # noqa: B904  the chain is what is tested

    def bug() -> None:
        raise RuntimeError("engine.errors.UserError: quoted in a bug's message")

    error = user_error_in_traceback(text_of(diverged))
    assert type(error) is DivergedError
    assert str(error) == "diverged in epoch 2, between steps 4 and 8: the loss stopped being finite"
    assert user_error_in_traceback(text_of(bug_while_handling)) is None
    assert user_error_in_traceback(text_of(bug)) is None
    assert user_error_in_traceback("") is None


@pytest.mark.slow
def test_ddp_spawn_trains_and_tests_on_two_cpu_processes(cli, tmp_path):
    """The main process learns from rank 0 more than Lightning sends back (the weights and callback_metrics): the
    best score, for fit_metrics.json and a sweep's objective, and the step the test's scalars are logged at."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli("train.py", "trainer.strategy=ddp_spawn", "trainer.accelerator=cpu", "trainer.devices=2", "debug=limit")
    (run,) = run_dirs(tmp_path / "logs")
    assert json.loads((run / "test_metrics.json").read_text())["status"] == "ok"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    fit = json.loads((run / "fit_metrics.json").read_text())
    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    assert fit["best/val/acc"] == max(e.value for e in scalars.Scalars("val/acc"))
    steps = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]  # 3 epochs of 3 batches
    assert [e.step for e in scalars.Scalars("test/acc")] == [steps]
    # the workers log where the main process does: rank 0 into the run's log, rank 1 beside it (they logged nowhere)
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in (run / "train.log").read_text()
    assert "`Trainer.fit` stopped: `max_epochs=3` reached." in (run / "train.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in (run / "train_ddp_process_1.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "devices"), [("ddp_fork", 2), ("ddp_notebook", 1)])
def test_forked_workers_train_and_test_with_the_default_logger(tmp_path, strategy, devices):
    """Both waited for ever. A forked worker had its parent's TensorBoard writer without the thread that writes it
    (its first flush, at the first checkpoint); the test's worker, forked after the fit had run the parent's OpenMP
    threads, waited for them in its first parallel op (one process: two threads each on 2 cores)."""
    command = [sys.executable, str(REPO / "train.py"), f"trainer.strategy={strategy}", "trainer.accelerator=cpu"]
    env = {k: v for k, v in cli_env().items() if k != "OMP_NUM_THREADS"}  # as a user's shell has it; tests set 1
    proc = run_python([*command, f"trainer.devices={devices}", "debug=limit"], tmp_path, env, timeout=120, cold=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = run_dirs(tmp_path / "logs")
    assert json.loads((run / "test_metrics.json").read_text())["status"] == "ok"
    assert "val/acc" in tensorboard_scalars(run) and "test/acc" in tensorboard_scalars(run)


@pytest.mark.slow
def test_ddp_spawn_trains_a_users_own_lightning_module(cli, tmp_path):
    """Lightning's README autoencoder (another task, its own self.log) in two spawned CPU workers: its checkpoints,
    and its TensorBoard scalars, which a spawned worker's logger writes as they come."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from user_models import LIT_AUTOENCODER_3_EPOCHS

    cli("train.py", *LIT_AUTOENCODER_3_EPOCHS, "trainer.strategy=ddp_spawn", "trainer.devices=2")
    (run,) = run_dirs(tmp_path / "logs")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_002.ckpt", "last.ckpt"]
    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in scalars.Scalars("lr-Adam")] == [0, 4, 8] and scalars.Scalars("train_loss")
