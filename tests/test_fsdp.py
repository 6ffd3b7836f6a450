"""strategy=fsdp (FSDP2) with 2 CPU processes: sharded training, sharded checkpoints, resume and eval."""

import json

import pytest
import torch
from conftest import run_dirs

from engine import build
from engine.strategies.fsdp import FSDPStrategy

FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "model=mlp", "debug=limit", "~callbacks.early_stopping"]


def test_the_strategy_name_fsdp_builds_fsdp2_on_any_trainer(make_cfg):
    cfg = make_cfg("trainer.strategy=fsdp", "trainer.devices=2", "trainer.accelerator=cpu")
    trainer = build.trainer(cfg.trainer, [], [])
    assert isinstance(trainer.strategy, FSDPStrategy)


@pytest.mark.slow
def test_fsdp_shards_trains_checkpoints_resumes_and_evaluates(cli, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    cli("train.py", *FSDP, "+callbacks.probe._target_=probes.ShardProbe", env={"PROBE_DIR": str(probe)})
    (run,) = run_dirs(tmp_path / "logs")

    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:  # each rank holds about half of every parameter
        assert r["world_size"] == 2 and r["local_params"] < 0.6 * r["params"]
    assert not set(ranks[0]["seen"]["0"]) & set(ranks[1]["seen"]["0"])  # and sees its own data

    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2 and (last / "meta.pt").is_file()
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["epoch"] == 2 and meta["run_config"]["trainer"]["strategy"]["_target_"].endswith("FSDPStrategy")

    resumed_logs = tmp_path / "resumed"
    cli("train.py", *FSDP, f"ckpt_path={last}", "trainer.max_epochs=4", "stretch_schedule=true", cwd=resumed_logs)
    (resumed,) = run_dirs(resumed_logs / "logs")
    meta2 = torch.load(resumed / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta2["epoch"] == 3 and meta2["global_step"] == meta["global_step"] + meta["global_step"] // 3

    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    eval_logs = tmp_path / "eval"
    # at 1 device: the shards are redistributed; 4 batches of 64 are the same 256 test digits as 2 x 2 x 64
    cli(
        "eval.py",
        f"ckpt_path={best}",
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "+trainer.limit_test_batches=4",
        cwd=eval_logs,
    )
    (evaluated,) = run_dirs(eval_logs / "logs", task="eval")
    assert (
        json.loads((evaluated / "test_metrics.json").read_text())["test/acc"]
        == json.loads((run / "test_metrics.json").read_text())["test/acc"]
    )

    refused = cli("eval.py", f"ckpt_path={best}", check=False, cwd=eval_logs)
    assert refused.returncode == 2 and "evaluate it with trainer=fsdp" in refused.stderr
    # resumed under another strategy: Lightning's looked for the weights in one file (KeyError: 'state_dict')
    ddp = ["trainer=ddp", *FSDP[1:], f"ckpt_path={last}"]
    refused = cli("train.py", *ddp, check=False, cwd=tmp_path / "elsewhere")
    (line,) = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and line.startswith(f"error: ckpt_path={last} is sharded (written by "), line
    assert "resume it with trainer=fsdp" in line and not (tmp_path / "elsewhere" / "logs").exists()


@pytest.mark.slow
def test_fsdp_with_bf16_mixed_trains_on_two_processes(cli, tmp_path):
    cli("train.py", *FSDP, "precision=bf16_mixed", "test=false")
    (run,) = run_dirs(tmp_path / "logs")
    meta = torch.load(run / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta["run_config"]["trainer"]["precision"] == "bf16-mixed"
    assert 0.5 < json.loads((run / "fit_metrics.json").read_text())["val/acc"] <= 1.0


@pytest.mark.slow
def test_fsdp_evaluates_under_no_grad_not_inference_mode_whatever_the_backend(cli, tmp_path):
    """FSDP2's gathered parameters break under torch.inference_mode ("Inference tensors do not track version
    counter": eval.py of a sharded checkpoint on one H200, NCCL). Lightning evaluates under no_grad with gloo, so on
    CPU the problem hides: the probe turns that exemption off, as on GPUs; a user's own net is trained and its sharded
    checkpoint evaluated (in processes of their own: a process group left in this one would outlive the test)."""
    probe, net = tmp_path / "probe", ["~model.net", "+model.net._target_=user_models.TutorialCNN"]
    probe.mkdir()
    trust, grad_mode = "trusted_packages=[user_models]", "+callbacks.grad_mode._target_=probes.GradModeProbe"
    env = {"PROBE_DIR": str(probe), "PROJECT_PROFILE": "tiny"}
    cli("train.py", "trainer=fsdp", "trainer.devices=1", "trainer.accelerator=cpu", *net, trust, grad_mode, env=env)
    (run,) = run_dirs(tmp_path / "logs")
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    cli("eval.py", f"ckpt_path={best}", "trainer=fsdp", "trainer.devices=1", "trainer.accelerator=cpu", trust,
        grad_mode, env=env, cwd=tmp_path / "eval")  # fmt: skip
    (evaluated,) = run_dirs(tmp_path / "eval" / "logs", task="eval")
    tested = json.loads((run / "test_metrics.json").read_text())["test/loss"]
    assert json.loads((evaluated / "test_metrics.json").read_text())["test/loss"] == pytest.approx(tested, abs=1e-6)
    assert json.loads((probe / "grad_mode_rank0.json").read_text()) == {"test": False}
