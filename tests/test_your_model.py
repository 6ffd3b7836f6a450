"""The three ways to bring a model (docs/your-model.md), each through the whole template, at the test profile's
sizes: a tutorial-style CNN of a user's package inside the classifier, a torchvision factory, and a LightningModule of
another task (the autoencoder). One device: train, resume, eval, predict, export; ddp and fsdp on 2 CPU processes;
pipe and pipeline for the LightningModule whose forward is the net (the nets inside the classifier run under pipe
and pipeline in tests/test_pipe.py and tests/test_pipeline.py, equal to one device)."""

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import run_dirs
from hydra.utils import instantiate

from project.data.digit_images import write_digit_images

pytestmark = pytest.mark.slow

TINY = {"PROJECT_PROFILE": "tiny"}
KINDS = {
    # a user's own net in a package of theirs (tests/user_models.py): its checkpoints load where trusted
    "tutorial_cnn": (["~model.net", "+model.net._target_=user_models.TutorialCNN"], ["trusted_packages=[user_models]"]),
    "torchvision_resnet18": (["model=torchvision", "data.channels=3"], []),
    "autoencoder": (["model=autoencoder"], []),
}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    write_digit_images(folder, per_class=3)
    return folder


def _trained(cli, cwd: Path, kind: str) -> Path:
    model, _ = KINDS[kind]
    cli("train.py", *model, "trainer.max_epochs=1", "logger=csv", env=TINY, cwd=cwd)
    (run,) = run_dirs(cwd / "logs")
    return run


@pytest.mark.parametrize("kind", KINDS)
def test_trains_resumes_evaluates_predicts_and_exports(cli, tmp_path, images, kind):
    model, trust = KINDS[kind]
    run = _trained(cli, tmp_path / "train", kind)
    fit = json.loads((run / "fit_metrics.json").read_text())
    monitor = "val/loss" if kind == "autoencoder" else "val/acc"  # the autoencoder picks its own
    assert fit["status"] == "ok" and fit[f"best/{monitor}"] == pytest.approx(fit[monitor])
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")

    cli("train.py", *model, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "stretch_schedule=true", *trust,
        env=TINY, cwd=tmp_path / "resume")  # fmt: skip
    (resumed,) = run_dirs(tmp_path / "resume" / "logs")
    assert torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1  # the second epoch
    if kind == "autoencoder":  # its lr feeds its configure_optimizers: a new one would be ignored on resume
        last = run / "checkpoints" / "last.ckpt"
        refused = cli("train.py", *model, f"ckpt_path={last}", "model.lr=0.01", check=False, env=TINY, cwd=tmp_path)
        assert refused.returncode == 2 and "was trained with model.lr=0.002, this run asks for model.lr=0.01" in (
            refused.stderr
        )

    cli("eval.py", f"ckpt_path={best}", *trust, env=TINY, cwd=tmp_path / "eval")
    (evaluated,) = run_dirs(tmp_path / "eval" / "logs", task="eval")
    tested = json.loads((run / "test_metrics.json").read_text())
    assert json.loads((evaluated / "test_metrics.json").read_text())["test/loss"] == pytest.approx(tested["test/loss"])

    cli("predict.py", f"ckpt_path={best}", f"input={images}", *trust, env=TINY, cwd=tmp_path / "predict")
    (predicted,) = run_dirs(tmp_path / "predict" / "logs", task="predict")
    saved = torch.load(predicted / "predictions.pt", weights_only=True)
    assert len(saved["names"]) == len(saved["outputs"]) == 30
    with open(predicted / "predictions.csv") as f:
        header = next(csv.reader(f))
    if kind == "autoencoder":  # its predict_step: the 16 numbers of each image's code
        assert header == ["name", *(f"output_{i}" for i in range(16))] and saved["outputs"].shape == (30, 16)
    else:  # a classifier: class names and probabilities
        assert header == ["name", "predicted", *(f"prob_{c}" for c in range(10))]
        torch.testing.assert_close(saved["outputs"].sum(1), torch.ones(30))

    cli("export.py", f"ckpt_path={best}", f"output={tmp_path / 'model.onnx'}", *trust, env=TINY, cwd=tmp_path / "x")
    (exported,) = run_dirs(tmp_path / "x" / "logs", task="export")
    summary = json.loads((exported / "export.json").read_text())
    assert summary["max_abs_difference"] <= 1e-4 and (tmp_path / "model.onnx").is_file()
    assert summary["output"]["name"] == ("output" if kind == "autoencoder" else "logits")


def test_a_checkpoint_of_an_untrusted_package_is_refused_in_one_line(cli, tmp_path):
    run = _trained(cli, tmp_path, "tutorial_cnn")
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    proc = cli("eval.py", f"ckpt_path={best}", check=False, env=TINY)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert "user_models.TutorialCNN" in line and "trusted_packages=[...]" in line


STRATEGIES = {
    "ddp": ["trainer=ddp", "trainer.accelerator=cpu"],
    "fsdp": ["trainer=fsdp", "trainer.accelerator=cpu"],
    "pipe": ["trainer=pipe"],
    "pipeline": ["trainer=pipeline", "trainer.accelerator=cpu"],
}
RUNS = [(k, s) for k in KINDS for s in ("ddp", "fsdp")] + [("autoencoder", "pipe"), ("autoencoder", "pipeline")]


@pytest.mark.parametrize(("kind", "strategy"), RUNS, ids=[f"{k}-{s}" for k, s in RUNS])
def test_trains_under_the_strategy(cli, tmp_path, kind, strategy):
    model, _ = KINDS[kind]
    cli("train.py", *model, *STRATEGIES[strategy], "trainer.max_epochs=1", "test=false", env=TINY)
    (run,) = run_dirs(tmp_path / "logs")
    fit = json.loads((run / "fit_metrics.json").read_text())
    assert fit["status"] == "ok" and fit["train/loss" if kind == "autoencoder" else "train/acc"] is not None
    log = (run / "train.log").read_text()
    if strategy == "fsdp":  # sharded by the policy: the repeated block, or the top-level layers
        unit = {"tutorial_cnn": "Conv2d", "torchvision_resnet18": "BasicBlock x8", "autoencoder": "Linear x4"}[kind]
        assert "fsdp: " in log and unit in log


def test_a_users_module_that_logs_other_names_is_told_the_monitor_setting_that_works(cli, tmp_path):
    """The message named `monitor=val_loss`, a config group option that means val/loss: followed, the same error."""
    from user_models import LIT_AUTOENCODER_3_EPOCHS

    unmonitored = [arg for arg in LIT_AUTOENCODER_3_EPOCHS if not arg.startswith("monitor.")]
    proc = cli("train.py", *unmonitored, check=False)
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "which LitAutoEncoder never logged; it logged: lr-Adam, train_loss." in line
    advice = line.split("e.g. ")[1].split(", or log one")[0]
    assert advice == "monitor.metric=train_loss monitor.mode=min"
    followed = cli("train.py", *unmonitored, *advice.split(), cwd=tmp_path / "followed")
    assert followed.returncode == 0


def test_a_validation_metric_nobody_logs_is_refused_before_the_first_training_step(cli, tmp_path):
    """It was refused at the first validation's end, after an epoch of training, and its run dir stayed."""
    table = ["~model", "+model._target_=user_tables.Regressor", "~data", "+data._target_=user_tables.DiabetesData"]
    proc = cli("train.py", *table, "monitor.metric=val/nope", "trainer.accelerator=cpu", check=False, env=TINY)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "watches 'val/nope', which Regressor never logged; it logged: val/mse." in proc.stderr
    assert "train" not in proc.stderr.split("it logged:")[1]  # before any training step
    assert not (tmp_path / "logs").exists()


def test_a_validation_metric_logged_only_after_the_sanity_check_is_not_refused(cli, tmp_path):
    """The sanity check's metrics decide early only for a name the module's code does not hold."""
    table = [
        "~model",
        "+model._target_=user_tables.QuietInSanityCheck",
        "~data",
        "+data._target_=user_tables.DiabetesData",
    ]
    cli(
        "train.py",
        *table,
        "monitor.metric=val/mse",
        "monitor.mode=min",
        "trainer.accelerator=cpu",
        "test=false",
        env=TINY,
    )


@pytest.mark.parametrize(
    ("net", "said"),
    [
        ("DictOutCNN", "DictOutCNN returns a dict, not a tensor of class scores (batch, classes)"),
        ("AuxOutCNN", "AuxOutCNN returns a tuple in training, not a tensor of class scores (batch, classes)"),
        ("NoWeights", "NoWeights has no weights to train"),
        ("TakesTwo", "TakesTwo's forward takes more than the images (TypeError: "),  # "fix data.channels"
        (  # it said "set model.num_classes=10", the value already set
            "SevenOutputs",
            "SevenOutputs has 7 outputs (model.num_classes=10) but the data has 10 classes: make its last layer's",
        ),
    ],
)
def test_a_net_outside_the_classifiers_contract_is_refused_at_start(make_cfg, net, said):
    """Each failed in the first step with a traceback (cross_entropy of a dict or a tuple; an optimizer with an empty
    parameter list) and left a run dir behind; googlenet's training-only tuple passed the start check. The checks
    train.py makes before anything else is built (a UserError there is one line, exit 2, no run dir:
    test_cli_errors)."""
    from omegaconf import OmegaConf

    from engine import contract
    from engine.errors import UserError

    cfg = make_cfg("model=tiny_cnn", f"model.net._target_=user_models.{net}", "~model.net.width")
    datamodule, model = instantiate(cfg.data), instantiate(cfg.model)
    with pytest.raises(UserError) as refused:
        contract.check(model, datamodule, test=cfg.test, train=cfg.train)
        contract.check_fits(model, datamodule, OmegaConf.to_container(cfg.data, resolve=True))
    assert said in str(refused.value)


def test_predict_runs_a_users_module_without_a_predict_step_on_its_images(cli, tmp_path, images):
    """Lightning's own predict_step hands forward the whole batch, (images, indices): Lightning's README autoencoder
    failed in its forward (AttributeError: 'list' object has no attribute 'view'). Its forward now gets the images."""
    from user_models import LIT_AUTOENCODER_3_EPOCHS

    cli("train.py", *LIT_AUTOENCODER_3_EPOCHS, cwd=tmp_path / "train")
    (run,) = run_dirs(tmp_path / "train" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    predict = ["predict.py", f"ckpt_path={last}", f"input={images}", "trusted_packages=[user_models]"]
    cli(*predict, cwd=tmp_path / "p")
    (predicted,) = run_dirs(tmp_path / "p" / "logs", task="predict")
    saved = torch.load(predicted / "predictions.pt", weights_only=True)
    assert saved["outputs"].shape == (30, 3)  # each image's code, as its forward makes it
    with open(predicted / "predictions.csv") as f:
        assert next(csv.reader(f)) == ["name", "output_0", "output_1", "output_2"]
    # the module travels to ddp_spawn's workers as a pickle: the predict_step it was given goes with it
    import pickle

    from engine.runs.full_model import load_full_model
    from engine.tasks.prediction import _predict_with_forward

    model, _ = load_full_model(str(last), ["user_models"])
    _predict_with_forward(model)
    spawned = pickle.loads(pickle.dumps(model))
    images = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(spawned.predict_step({"input": images, "name": ["a", "b"]}, 0), model(images))


def test_resuming_a_users_module_with_other_arguments_is_refused_in_one_line(cli, tmp_path):
    """Lightning restores the optimizer as saved: a module of the user's that took a new learning rate on resume
    trained on at the old one, while its new checkpoints recorded the new. The template's classifier was refused."""
    from user_models import LIT_AUTOENCODER_3_EPOCHS

    cli("train.py", *LIT_AUTOENCODER_3_EPOCHS, "model.hidden=64", cwd=tmp_path / "train")
    (run,) = run_dirs(tmp_path / "train" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    resume = [*LIT_AUTOENCODER_3_EPOCHS, f"ckpt_path={last}", "trusted_packages=[user_models]"]
    proc = cli("train.py", *resume, "model.hidden=32", check=False, cwd=tmp_path / "resumed")
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "was trained with model.hidden=64, this run asks for model.hidden=32" in line
    assert not (tmp_path / "resumed" / "logs").exists()


def test_a_net_with_a_layer_forward_does_not_use_is_refused_in_one_line_by_ddp_and_fsdp(cli, tmp_path):
    """DDP's error came as a traceback on each rank, naming Lightning's API; the strategy name it suggested built
    Lightning's own DDP, without the template's (the rank watcher, the rendezvous, the CPU sync BatchNorm)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from engine.strategies.ddp import DDPStrategy

    assert StrategyRegistry["ddp_find_unused_parameters_true"]["strategy"] is DDPStrategy
    net = ["model=tiny_cnn", "model.net._target_=user_models.UnusedHead", "~model.net.width"]
    args = [*net, "trainer=ddp", "trainer.accelerator=cpu", "trainer.max_epochs=1", "test=false"]
    proc = cli("train.py", *args, check=False, env={"PROJECT_PROFILE": "tiny"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "trainer.strategy=ddp_find_unused_parameters_true" in errors[0]
    # fsdp: the fit ended well, and then none of its checkpoints loaded ("Missing optimizer state for parameter")
    fsdp = [*net, "trainer=fsdp", "trainer.accelerator=cpu", "trainer.max_epochs=1", "test=false"]
    proc = cli("train.py", *fsdp, check=False, env={"PROJECT_PROFILE": "tiny"}, cwd=tmp_path / "fsdp")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: trainer=fsdp: net.aux_head.weight, net.aux_head.bias got no gradient in")


def test_fsdp_keeps_tied_weights_in_one_unit(cli, tmp_path):
    """A decoder sharing the encoder's weight: the default policy made each layer a unit, and torch refused the
    split ("is shared with a parameter already managed by another FSDP group"), in a traceback on every rank."""
    net = ["model=tiny_cnn", "model.net._target_=user_models.TiedAutoEncoderNet", "~model.net.width"]
    fsdp = [*net, "~model.net.in_channels", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.max_epochs=1"]
    cli("train.py", *fsdp, env={"PROJECT_PROFILE": "tiny"})
    (run,) = run_dirs(tmp_path / "logs")
    assert json.loads((run / "test_metrics.json").read_text())["status"] == "ok"
