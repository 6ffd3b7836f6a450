"""Refused starts of the entry points, in subprocesses: one `error:` line, exit 2, nothing written or overwritten."""

import pytest
import torch
from test_cluster import free_port

pytestmark = pytest.mark.slow


# (The README's own examples, +trainer.max_epoch, max_epochs=many, lr=-1 among them, run in tests/test_readme.py.)
BAD_INPUTS = [
    ("train.py", ["trainer.max_epoch=3"], "trainer.max_epoch: no such key; did you mean trainer.max_epochs?"),
    ("train.py", ["model=lenett"], "Could not find 'model/lenett'"),
    # found by a blind new-user try: Hydra's own words suggested +modle=mlp; val_size was the close key offered
    ("train.py", ["modle=mlp"], "modle: no such group or key; did you mean model?"),
    ("train.py", ["data.image_size=32"], "data.image_size: no such key; data=image_folder has it (pick that option"),
    ("train.py", ["seed=-1"], "seed=-1: a seed is an integer from 0 to 4294967295"),
    ("train.py", ["paths.log_dir=/proc/x"], "cannot create a run directory under /proc/x/train/runs"),
    ("train.py", ["ckpt_path=/no/such.ckpt"], "ckpt_path=/no/such.ckpt: no such file"),
    ("train.py", ["ckpt_path="], "ckpt_path is empty (an unset shell variable?)"),
    ("eval.py", [], "ckpt_path: required; pass the checkpoint to use"),
    (
        "train.py",
        ["trainer.devices=64", "trainer.accelerator=cpu", "trainer.strategy=ddp"],
        "trainer.devices=64 CPU processes on a machine with",
    ),
    (
        "train.py",
        ["trainer.num_nodes=2", "trainer.accelerator=cpu"],
        "trainer.num_nodes=2 without torchrun or srun: set MASTER_ADDR, MASTER_PORT, NODE_RANK on every node",
    ),
    (
        "train.py",
        ["model.scheduler.T_max=0"],
        "model.scheduler: its first step fails with T_max=0 (ZeroDivisionError: integer modulo by zero)",
    ),
    (  # the scheduler's length comes from the epochs: the message names where it was typed
        "train.py",
        ["trainer.max_epochs=0"],
        "model.scheduler: its first step fails with T_max=0 (from trainer.max_epochs) (ZeroDivisionError",
    ),
    ("train.py", ["precision=16"], "precision=16: precision is a config group, which takes the name of an option: "),
    ("train.py", ["model=1"], "model=1: model is a config group, which takes the name of an option: autoencoder,"),
    ("train.py", ["-m", "model=mlp,nope"], "Could not find 'model/nope'"),  # left the sweep dir, multirun.yaml in it
    (  # Hydra's advice was +model=mlp, which fails too
        "eval.py",
        ["ckpt_path=x.ckpt", "model=mlp"],
        "model=...: eval.py takes the model from the checkpoint (ckpt_path), not model=",
    ),
    ("train.py", ["precision=inf"], "precision=inf: precision is a config group, which takes the name of an option"),
    ("train.py", ["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch=0: must be at least 1"),
    ("train.py", ["model.compile=nonsense"], "compile='nonsense' is not a torch.compile backend"),
    ("train.py", ["model.net.hidden=0"], "model.net: ValueError: widths must be >= 1"),
    # found by a blind new-user try: Hydra's multi-line ERROR log, then a line with its text's line breaks escaped
    ("train.py", ["model.net._target_=project.models.my_net.Net"], "No module named 'project.models.my_net' ("),
    ("train.py", ["model.net._target_=project.models.lenet.LeNett"], "has no 'LeNett'; did you mean 'LeNet'?"),
    ("train.py", ["logger.tensorboard.flush_secs=0"], "flush_secs must be a number of seconds from 0.1 to 1e7"),
    ("train.py", ["logger.tensorboard.flush_secs=true"], "flush_secs must be a number of seconds from 0.1 to 1e7"),
    ("train.py", ["logger.tensorboard.flush_secs=1e-9"], "flush_secs must be a number of seconds from 0.1 to 1e7"),
    ("train.py", ["logger.tensorboard.flush_secs=inf"], "flush_secs must be a number of seconds from 0.1 to 1e7"),
    ("train.py", ["callbacks.rich_progress_bar.refresh_rate=abc"], "ProgressBar expects an integer for 'refresh_rate'"),
    ("train.py", ["callbacks.rich_progress_bar.refresh_rate=-5"], "refresh_rate must be a whole number of redraws"),
    ("train.py", ["paths.output_dir=/proc/x"], "paths.output_dir=/proc/x: cannot be created"),
    ("train.py", ["hydra.run.dir=/proc/x"], "hydra.run.dir=/proc/x: cannot be created"),
    (
        "train.py",
        ["callbacks.model_checkpoint.dirpath=/proc/x"],
        "callbacks.model_checkpoint.dirpath=/proc/x: cannot be created",
    ),
    (  # an existing folder this process cannot write to (a read-only mount): at start, not after an epoch
        "train.py",
        ["callbacks.model_checkpoint.dirpath=/proc/self"],
        "callbacks.model_checkpoint.dirpath=/proc/self: not writable",
    ),
    ("train.py", ["hydra.run.dir=/proc/self"], "hydra.run.dir=/proc/self: not writable"),
    ("train.py", ["task_name=../../etc"], "task_name='../../etc': a name"),
    pytest.param(
        "train.py",
        ["trainer=gpu"],
        "trainer.accelerator=gpu: torch sees no GPU here; use trainer=cpu, or trainer.accelerator=auto",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"),
    ),
    pytest.param(
        "train.py",
        ["trainer=dp"],
        "On CPU use trainer.strategy=ddp trainer.accelerator=cpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="dp runs where CUDA is"),
    ),
]


def _ids(value):
    return " ".join(value) if isinstance(value, list) else None


@pytest.mark.parametrize(("script", "overrides", "expected"), BAD_INPUTS, ids=_ids)
def test_bad_input_is_one_error_line_and_no_output(cli, tmp_path, script, overrides, expected):
    proc = cli(script, *overrides, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: not even an empty logs/ folder
    # nor said: no run directory that is gone again, no config tree of a run that never starts (a blind user went
    # looking for the directory a refused run had printed)
    assert "Run directory" not in proc.stdout and "── " not in proc.stdout, proc.stdout[:500]


def test_a_refused_run_leaves_the_earlier_runs_files_alone(cli, tmp_path):
    earlier = tmp_path / "earlier"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / ".hydra").mkdir()
    files = {
        earlier / "checkpoints" / "last.ckpt": b"a checkpoint",
        earlier / ".hydra" / "config.yaml": b"the earlier run's config",
        earlier / "train.log": b"the earlier run's log",
    }
    for path, content in files.items():
        path.write_bytes(content)
    proc = cli("train.py", f"hydra.run.dir={earlier}", "model=mlp", check=False)
    assert proc.returncode == 2
    assert f"error: {earlier} already holds checkpoints of an earlier run" in proc.stderr
    assert f"to continue it pass ckpt_path={earlier / 'checkpoints' / 'last.ckpt'}" in proc.stderr
    # continuing it into its own directory: the advice is not the ckpt_path already given, but where a resume writes
    last = earlier / "checkpoints" / "last.ckpt"
    resumed = cli("train.py", f"hydra.run.dir={earlier}", f"ckpt_path={last}", "model=mlp", check=False)
    assert resumed.returncode == 2 and "to continue it pass" not in resumed.stderr, resumed.stderr
    assert f"a run from ckpt_path={last} writes a directory of its own: leave out hydra.run.dir" in resumed.stderr
    assert {path: path.read_bytes() for path in files} == files
    assert sorted(p.name for p in earlier.rglob("*")) == sorted(["checkpoints", ".hydra", *(p.name for p in files)])


def test_a_run_may_not_write_into_another_runs_directory(cli, tmp_path):
    earlier = tmp_path / "earlier"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / "checkpoints" / "last.ckpt").write_bytes(b"a checkpoint")
    inside = cli("train.py", f"hydra.run.dir={earlier / 'checkpoints' / 'new'}", check=False)
    assert inside.returncode == 2 and f"is inside the directory of another run ({earlier})" in inside.stderr
    into = cli("train.py", f"paths.output_dir={earlier}", "model=mlp", check=False)
    assert into.returncode == 2 and f"paths.output_dir={earlier} already holds checkpoints" in into.stderr
    assert sorted(p.name for p in earlier.rglob("*")) == ["checkpoints", "last.ckpt"]
    assert (earlier / "checkpoints" / "last.ckpt").read_bytes() == b"a checkpoint"


def test_a_monitored_metric_that_is_never_logged_is_one_line(cli, tmp_path):
    proc = cli(
        "train.py", "callbacks.model_checkpoint.monitor=val/nonexistent", check=False, env={"PROJECT_PROFILE": "tiny"}
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: BestCheckpoint watches 'val/nonexistent', which ")
    assert "it logged: " in lines[0] and "val/acc" in lines[0] and "monitor.metric" in lines[0]


def test_a_sweep_into_a_used_sweep_dir_is_refused_before_any_job(cli, tmp_path):
    job = tmp_path / "sweep" / "0"
    (job / "checkpoints").mkdir(parents=True)
    (job / "checkpoints" / "last.ckpt").write_bytes(b"a checkpoint")
    proc = cli("train.py", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "seed=1,2", check=False)
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["0"]


def test_nodes_that_never_meet_end_with_one_line_after_the_timeout(cli, tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    args = ["trainer.num_nodes=2", "trainer.accelerator=cpu", "model=mlp", "launch.rendezvous_timeout_s=3"]
    proc = cli("train.py", *args, check=False, env=env)
    assert proc.returncode == 2
    assert f"waiting for 2 processes on 2 nodes at 127.0.0.1:{env['MASTER_PORT']}" in proc.stdout + proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "rank 0 gave up: waited 3 s" in error and "NODE_RANK=1..1" in error
    assert "Traceback" not in proc.stderr


def test_a_pickle_in_a_checkpoint_is_one_line(cli, tmp_path):
    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "pickle.ckpt"
    torch.save({"hyper_parameters": {"model": {}}, "x": Exploit()}, path)
    proc = cli("eval.py", f"ckpt_path={path}", check=False)
    assert proc.returncode == 2 and "pwned" not in proc.stdout
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "refused, it holds more than tensors and plain data" in error and "Traceback" not in proc.stderr


def test_a_failed_start_leaves_a_dir_the_user_named_alone(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.log").write_text("keep me")
    proc = cli("train.py", f"hydra.run.dir={mine}", "+foo=1", check=False)
    assert proc.returncode == 2 and (mine / "notes.log").read_text() == "keep me"
