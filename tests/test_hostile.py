"""A hostile user's moves at the edges of every entry point: nothing is overwritten that the command did not
create, every failure is one line with exit 2 and no run directory left, bad files found mid-epoch are named,
and a checkpoint's stored paths and sizes are checked before use. Each test failed before its fix."""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python
from PIL import Image

pytestmark = pytest.mark.slow

TINY = {"PROJECT_PROFILE": "tiny"}


def run(cwd: Path, script: str, *args: str, env: dict | None = None):
    cwd.mkdir(parents=True, exist_ok=True)
    return run_python([sys.executable, str(REPO / script), *args], cwd, cli_env(**{**TINY, **(env or {})}))


def refused(proc, *fragments: str) -> str:
    """Exit 2 and one line on stderr holding every fragment."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def tree(root: Path) -> dict[str, int]:
    """Every file under root with its size and modification time: what 'nothing changed' compares."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """One tiny training run: (working directory, its run directory)."""
    work = tmp_path_factory.mktemp("hostile")
    proc = run(work, "train.py", "model=mlp", "logger=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(work / "logs")
    return work, run_dir


def test_no_entry_point_overwrites_what_it_did_not_create(trained):
    work, run_dir = trained
    best = next((run_dir / "checkpoints").glob("epoch_*.ckpt"))
    before = tree(run_dir)
    # export onto a checkpoint, into a folder, over an earlier export
    refused(run(work, "export.py", f"ckpt_path={best}", f"output={run_dir / 'checkpoints' / 'last.ckpt'}"), "exists")
    refused(run(work, "export.py", f"ckpt_path={best}", f"output={run_dir}"), "is a folder")
    refused(run(work, "export.py", f"ckpt_path={best}", f"output={work / 'new.ckpt'}"), "not .ckpt")
    # eval into a training run, predict into an earlier predict run
    refused(run(work, "eval.py", f"ckpt_path={best}", f"paths.output_dir={run_dir}"), "already holds an earlier run")
    refused(run(work, "eval.py", f"ckpt_path={best}", f"hydra.run.dir={run_dir}"), "holds checkpoints of an earlier")
    assert tree(run_dir) == before

    digits = work / "digits"
    digits.mkdir()
    Image.new("L", (28, 28)).save(digits / "a.png")
    first = run(work, "predict.py", f"ckpt_path={best}", f"input={digits}")
    assert first.returncode == 0, first.stderr[-2000:]
    (predicted,) = run_dirs(work / "logs", "predict")
    kept = tree(predicted)
    again = run(work, "predict.py", f"ckpt_path={best}", f"input={digits}", f"hydra.run.dir={predicted}")
    refused(again, "already holds an earlier run's files")
    assert tree(predicted) == kept

    # the explicit way: a new file, or overwrite=true
    target, fmt = work / "model.pt2", "format=torch_export"  # a quarter of an ONNX export's time; the same writes
    assert run(work, "export.py", f"ckpt_path={best}", f"output={target}", fmt).returncode == 0
    refused(run(work, "export.py", f"ckpt_path={best}", f"output={target}", fmt), "exists", "overwrite=true")
    replaced = run(work, "export.py", f"ckpt_path={best}", f"output={target}", fmt, "overwrite=true")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert not list(work.glob(".model.partial-*"))  # written beside under a hidden name, then renamed


def test_nodes_started_by_hand_share_the_directory_the_user_names(tmp_path):
    """Node 1 starting after node 0 has written into the named directory joins it (here it waits for node 0's
    rendezvous and times out: what matters is that it was not refused as another run's directory)."""
    shared = tmp_path / "shared"
    (shared / ".hydra").mkdir(parents=True)
    (shared / ".hydra" / "config.yaml").write_text("{}\n")  # node 0 was first
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29563", "NODE_RANK": "1"}
    args = [f"hydra.run.dir={shared}", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1"]
    node_1 = run(tmp_path, "train.py", *args, "trainer.num_nodes=2", "launch.rendezvous_timeout_s=2", env=env)
    assert "earlier run" not in node_1.stderr and "gave up" in node_1.stderr, node_1.stderr[-2000:]


def test_two_runs_started_at_once_into_one_named_directory_cannot_both_have_it(trained, tmp_path):
    """Both find the directory empty (the guard's check), then both claim it: exactly one gets it, the other is
    refused in one line. A run the guard let in holds the claim (a later run is refused for it too)."""
    import multiprocessing

    from engine.errors import UserError
    from engine.runs.dirs import CLAIM, claim, earlier_files

    assert (trained[1] / CLAIM).is_file()
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()

    def start() -> None:
        empty = not earlier_files(tmp_path)
        barrier.wait()
        try:
            claim(tmp_path, "hydra.run.dir")
            results.put((empty, "claimed"))
        except UserError as e:
            results.put((empty, str(e)))

    starts = [context.Process(target=start) for _ in range(2)]
    for process in starts:
        process.start()
    outcomes = sorted((results.get(timeout=60) for _ in starts), key=lambda o: o[1] != "claimed")
    for process in starts:
        process.join(30)
    assert [empty for empty, _ in outcomes] == [True, True]
    assert outcomes[0][1] == "claimed" and outcomes[1][1] == (
        f"hydra.run.dir={tmp_path} is being used by another run started at the same time; name a new directory, "
        "or leave hydra.run.dir out for a fresh one"
    )


def test_a_failed_start_leaves_no_run_directory_even_one_the_user_named(trained):
    work, run_dir = trained
    best = next((run_dir / "checkpoints").glob("epoch_*.ckpt"))
    named = work / "named" / "run"
    refused(run(work, "eval.py", f"ckpt_path={best}.missing", f"hydra.run.dir={named}"), "no such file")
    assert not (work / "named").exists()


def test_an_unwritable_export_target_is_one_line(trained):
    """A read-only filesystem (/proc here: even root cannot create files there)."""
    work, run_dir = trained
    best = next((run_dir / "checkpoints").glob("epoch_*.ckpt"))
    refused(run(work, "export.py", f"ckpt_path={best}", "output=/proc/model.onnx"), "could not be written")


def test_bad_image_files_are_named_or_skipped_and_counted(tmp_path):
    root = tmp_path / "images"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(12):
            Image.new("L", (28, 28), color=i * 20).save(root / label / f"{i:02d}.png")
    (root / "a" / "05.png").write_bytes((root / "a" / "05.png").read_bytes()[:40])  # truncated
    (root / "b" / "notes.png").write_text("not an image")
    args = ["data=image_folder", f"data.root={root}", "model=mlp", "model.num_classes=2", "logger=none"]
    args += ["data.num_workers=0", "trainer.max_epochs=1", "data.batch_size=4"]
    stopped = run(tmp_path, "train.py", *args, env={"PROJECT_PROFILE": ""})
    line = refused(stopped, "not a readable image", "data.skip_bad_images=true")
    assert "05.png" in line or "notes.png" in line
    assert run_dirs(tmp_path / "logs") == []

    skipped = run(tmp_path, "train.py", *args, "data.skip_bad_images=true", env={"PROJECT_PROFILE": ""})
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    said = [line for line in (skipped.stdout + skipped.stderr).splitlines() if "Skipped " in line]
    assert {Path(line.split("Skipped ")[1].split(":")[0]).name for line in said} == {"05.png", "notes.png"}

    (root / "c").mkdir()  # an empty class folder
    refused(run(tmp_path, "train.py", *args, "model.num_classes=3", env={"PROJECT_PROFILE": ""}), "c/ holds no image")


def test_a_checkpoints_stored_paths_and_sizes_are_checked_before_use(trained, tmp_path):
    """A data root of / is refused, not walked; an image size of 20000x20000 is refused, not allocated."""
    work, run_dir = trained
    best = next((run_dir / "checkpoints").glob("epoch_*.ckpt"))
    ckpt = torch.load(best, map_location="cpu", weights_only=True)
    walks = {
        **ckpt,
        "run_config": {
            **ckpt["run_config"],
            "data": {"_target_": "project.data.image_folder.ImageFolderDataModule", "root": "/", "num_classes": 10},
        },
    }
    torch.save(walks, tmp_path / "walks.ckpt")
    refused(run(work, "eval.py", f"ckpt_path={tmp_path / 'walks.ckpt'}"), "data.root=/", "holds no image files")

    huge = {
        **ckpt,
        "run_config": {
            **ckpt["run_config"],
            "data": {
                "_target_": "project.data.image_folder.ImageFolderDataModule",
                "root": str(tmp_path),
                "image_size": 20000,
            },
        },
    }
    torch.save(huge, tmp_path / "huge.ckpt")
    refused(run(work, "export.py", f"ckpt_path={tmp_path / 'huge.ckpt'}"), "20000x20000", "larger than")

    misfit = {**ckpt, "run_config": {**ckpt["run_config"], "data": {**ckpt["run_config"]["data"], "channels": 3}}}
    torch.save(misfit, tmp_path / "misfit.ckpt")
    for script in ("eval.py", "export.py"):  # export with check=false too: the file would not run
        refused(
            run(work, script, f"ckpt_path={tmp_path / 'misfit.ckpt'}", *(["check=false"] * (script == "export.py"))),
            "does not take the data's images (3 channels",
        )


def test_resume_says_nothing_a_user_cannot_act_on(trained, tmp_path):
    work, run_dir = trained
    resumed = run(
        work,
        "train.py",
        "model=mlp",
        "logger=none",
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        "trainer.max_epochs=3",
        "stretch_schedule=true",
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "dirpath has changed" not in resumed.stderr and "Warning" not in resumed.stderr
    assert json.loads((run_dirs(work / "logs")[-1] / "fit_metrics.json").read_text())["status"] == "ok"


@pytest.mark.parametrize("strategy", ["auto", "ddp"])  # ddp_spawn's lost rank 1: test_fault_tolerance.py
def test_data_missing_offline_leaves_no_run_directory_with_the_default_logger(tmp_path, strategy):
    """The data is found missing once the run has begun (prepare_data, on rank 0 after the rendezvous), after the
    TensorBoard logger has written the run's settings: the run dir stayed, holding an event file and nothing else
    (the tests that checked "no run directory" ran with logger=none). Under ddp, rank 1's "lost the connection"
    line followed (under ddp_spawn it was, one run in two, the only line, with exit code 1)."""
    ddp = [f"trainer={strategy}", "trainer.accelerator=cpu"] if strategy != "auto" else []
    stopped = run(tmp_path, "train.py", "data=mnist", f"paths.data_dir={tmp_path / 'none'}", *ddp)
    refused(stopped, "MNIST is not in", "data=digits")
    assert not (tmp_path / "logs").exists(), sorted((tmp_path / "logs").rglob("*"))


def test_eval_on_data_the_checkpoints_model_cannot_take_is_one_line(trained):
    """train.py checked this at start; eval.py ran into it in the first batch (a 112-line traceback, a run dir)."""
    work, run_dir = trained
    best = next((run_dir / "checkpoints").glob("epoch_*.ckpt"))
    line = refused(run(work / "eval", "eval.py", f"ckpt_path={best}", "data=digits", "data.channels=3"), "channels")
    assert line.startswith("error: MLP does not take the data's images (3 channels, 28x28)"), line
    assert not (work / "eval" / "logs").exists()


def test_two_launches_into_one_named_directory_one_is_refused_and_each_launchs_processes_join(tmp_path):
    """Two sbatch jobs with the same hydra.run.dir both ran to the end in one dir, their checkpoints interleaved: a
    launch (a SLURM job's step, a torchrun) shares its dir among its own processes, so the guard's emptiness check
    is skipped there. The claim now names the launch: its processes join, any other launch is refused."""
    import subprocess

    from engine.runs.dirs import CLAIM

    named = tmp_path / "shared"

    def job(job_id: str, *extra: str) -> dict:
        return {
            "SLURM_NTASKS": "1",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_JOB_ID": job_id,
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "localhost",
        }

    jobs = {
        job_id: subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "model=mlp", "logger=none", f"hydra.run.dir={named}"],
            cwd=tmp_path,
            env=cli_env(**TINY, **job(job_id)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job_id in ("101", "102")
    }  # both started at once: both find the directory empty
    ended = {job_id: (process.wait(timeout=600), process.stderr.read()) for job_id, process in jobs.items()}
    assert sorted(code for code, _ in ended.values()) == [0, 2], ended
    (winner,) = [job_id for job_id, (code, _) in ended.items() if code == 0]
    (loser,) = set(jobs) - {winner}
    refused(
        subprocess.CompletedProcess([], 2, "", ended[loser][1]),
        f"hydra.run.dir={named} is being used by another run launched as slurm_{winner}_0",
    )
    assert (named / CLAIM).read_text() == f"slurm_{winner}_0"
    # another process of the first launch (a rank of the same job step) joins it
    from engine.runs.dirs import claim

    claim(named, "hydra.run.dir", f"slurm_{winner}_0")


def test_a_key_of_data_eval_takes_from_the_checkpoint_says_how_to_pick_data(tmp_path):
    """eval.py's data is the checkpoint's: `data.path=...` said "no such key; valid keys: " and an empty list."""
    proc = run(tmp_path, "eval.py", "ckpt_path=x.ckpt", "data.path=rows.csv")
    refused(proc, "data.path: no such key; eval.py takes data from the checkpoint; to give other data, pick it first")
    assert not (tmp_path / "logs").exists()
