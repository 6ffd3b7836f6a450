"""Every command in the code blocks of README.md and of the documentation site (docs/*.md), run exactly as written.

The commands of one file run in its order, in one fresh copy of the repository of that file's own (what `git clone`
and `make install` give), with the test profile `PROJECT_PROFILE=tiny` (conf/profile/tiny.yaml: a few batches per
epoch, at most 2 epochs): only sizes shrink. A page never depends on another page's commands. The copy holds small
MNIST files in the real format under data/, as on a machine where MNIST was fetched once (docs: Your data).
Placeholders are filled from what the file's earlier commands made: `<run>` is the newest training run with
checkpoints, `<best>` its best checkpoint's name, `<sweep>` the newest sweep.

This file runs README.md's commands; PAGES says which tests/test_docs_*.py file runs each page's, so that `make test`'s
workers run them side by side. Commands that need GPUs, several machines, SLURM or a long-lived server carry a
`# needs ...` comment (or sit in a batch script) and must be listed in ELSEWHERE with the test that covers them most
closely. In ```console blocks, `$ command` lines are run and the `error:` line that follows must match exactly.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, run_python, write_idx

pytestmark = pytest.mark.slow

README = REPO / "README.md"
DOCS = REPO / "docs"

# The test file that runs each page's commands (a page without commands is checked by tests/test_docs.py alone).
PAGES = {
    "index.md": "test_docs.py",
    "configuration.md": "test_docs_config.py",
    "evaluate-and-resume.md": "test_docs_config.py",
    "fault-tolerance.md": "test_docs_config.py",
    "tuning-averaging-throughput.md": "test_docs_training.py",
    "the-engine.md": "test_docs_training.py",
    "tensorboard-and-trackers.md": "test_docs_training.py",
    "sweeps.md": "test_docs_sweeps.py",
    "devices-and-strategies.md": "test_docs_devices_and_predict.py",
    "several-nodes-and-slurm.md": "test_docs_devices_and_predict.py",
    "predict-and-export.md": "test_docs_devices_and_predict.py",
    "your-model.md": "test_docs_your_model.py",
    "your-data.md": "test_docs_your_data.py",
    "performance.md": "test_docs.py",
    "layout.md": "test_docs.py",
    "testing.md": "test_docs.py",
    "contributing.md": "test_docs.py",
}

# Commands that cannot run on a 2-core CPU machine without a network, and the test that comes closest.
ELSEWHERE = {
    "make install": ".ci/run",
    "make test": ".ci/run",
    "make test-fast": ".ci/run",  # a part of make test
    "make test-long": ".ci/run",
    "make fuzz": "tests/test_fuzz.py::test_any_override_composes_or_is_refused_in_one_line",  # its tests, more cases
    "make lint": ".ci/run",
    "make test-gpu": "tests/test_gpu.py::test_a_gpu_step_makes_no_host_sync_of_the_templates_between_agreements",
    "make upgrade": "tests/test_install.py::test_make_knows_install_lock_and_upgrade",
    "make lock": "tests/test_install.py::test_make_knows_install_lock_and_upgrade",
    "python train.py -m hydra/launcher=parallel hydra.launcher.n_jobs=4 hparams_search=digits_optuna": (
        "tests/test_parallel_sweeps.py::test_parallel_workers_get_their_own_cores_and_more_jobs_than_gpus_are_refused"
    ),
    "optuna-dashboard sqlite:///logs/optuna.db": (
        "tests/test_optuna_dashboard.py::test_the_dashboard_shows_the_trials_the_sweep_summary_lists"
    ),
    "mlflow server --backend-store-uri sqlite:///logs/mlflow.db --artifacts-destination logs/mlartifacts "
    "--host 127.0.0.1 --port 5000": (
        "tests/test_trackers.py::test_the_mlflow_server_shows_a_runs_config_metrics_and_best_checkpoint"
    ),
    "wandb sync logs/train/runs/<run>/wandb/offline-run-*": (
        "tests/test_trackers.py::test_wandb_offline_runs_hold_the_config_and_metrics_under_the_run_dir"
    ),
    "source .venv/bin/activate": "tests/test_readme.py::test_the_environment_make_install_makes_can_be_activated",
    "make tensorboard-shots": "tests/test_tensorboard.py::test_screenshots_of_the_scalars_hparams_and_images_pages",
    "tensorboard --logdir logs": "tests/test_tensorboard.py::test_the_server_shows_the_runs_by_name_with_their_scalars",
    "CUDA_VISIBLE_DEVICES=2,3 python train.py trainer=ddp": (
        "tests/test_cli.py::test_ddp_two_cpu_processes_share_one_run_dir_and_split_the_data"
    ),
    "python train.py trainer.devices=4 trainer.strategy=ddp": (
        "tests/test_cli.py::test_ddp_two_cpu_processes_share_one_run_dir_and_split_the_data"
    ),
    "python train.py trainer=dp": "tests/test_dp.py::test_dp_with_two_replicas_trains_exactly_like_one_device",
    "python train.py trainer=pipe trainer.devices=4 trainer.strategy.split_size=16": (
        "tests/test_pipe.py::test_pipe_takes_the_same_steps_as_one_device"
    ),
    "python train.py trainer=pipeline trainer.devices=4 trainer.strategy.schedule=interleaved_1f1b": (
        "tests/test_pipeline.py::test_other_schedules_take_the_same_steps"
    ),
    "python train.py trainer=pipeline trainer.devices=4 trainer.strategy.data_parallel=2": (
        "tests/test_pipeline.py::test_other_schedules_take_the_same_steps"
    ),
    "torchrun --nproc_per_node=4 train.py trainer=ddp trainer.devices=4": (
        "tests/test_cluster.py::test_torchrun_starts_the_ranks_and_lightning_launches_none"
    ),
    "torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=exp1 "
    "train.py trainer=ddp trainer.devices=4 trainer.num_nodes=2": (
        "tests/test_torchrun_nodes.py::test_torchrun_two_nodes_train_one_run_in_one_directory"
    ),  # the page's command, two agents on this host, 1 CPU process each
    "MASTER_ADDR=HOST MASTER_PORT=29500 NODE_RANK=0 python train.py trainer=ddp trainer.devices=4 "
    "trainer.num_nodes=2 hydra.run.dir=/shared/runs/exp1": (
        "tests/test_torchrun_nodes.py::test_nodes_started_by_hand_with_node_rank_share_the_named_directory"
    ),
    # on real SLURM clusters of this host, on CPU (tests/slurm_cluster.py): one node, and 2 nodes
    "sbatch slurm/train.sbatch model=resnet18": "tests/test_slurm.py::test_srun_tasks_are_the_ranks_of_one_run",
    "sbatch --nodes=2 slurm/train.sbatch": "tests/test_slurm_nodes.py::test_one_ddp_run_across_two_nodes",
    "sbatch --nodes=2 slurm/train.sbatch trainer.strategy=fsdp": (
        "tests/test_slurm_nodes.py::test_fsdp_across_two_nodes"
    ),
    "sbatch slurm/requeue.sbatch trainer.max_epochs=100": (
        "tests/test_slurm.py::test_a_job_requeued_mid_epoch_resumes_its_own_checkpoint_bit_for_bit"
    ),
    "python train.py -m hydra/launcher=slurm trainer=ddp trainer.devices=4 trainer.num_nodes=2 "
    "hydra.launcher.partition=gpu hydra.launcher.timeout_min=600 seed=1,2,3": (
        "tests/test_slurm.py::test_a_sweep_on_slurm_runs_its_ddp_jobs_on_the_cluster_and_records_a_failed_one"
    ),
}


def _strip_comment(line: str) -> tuple[str, str]:
    """`command  # comment` -> (command, comment); a # inside quotes is part of the command."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1 :].strip()
    return line.strip(), ""


def doc_commands(path: Path) -> list[tuple[str, str | None, bool]]:
    """(command, expected error line or None, runs here) for every command of a Markdown file, in order."""
    found = []
    for lang, body in re.findall(r"```(bash|console)\n(.*?)```", path.read_text(), re.S):
        script = body.startswith("#!")
        lines = body.replace("\\\n", " ").splitlines()
        for i, raw in enumerate(lines):
            if lang == "console":
                if raw.startswith("$ "):
                    expected = lines[i + 1] if i + 1 < len(lines) else ""
                    found.append((raw[2:].strip(), expected, True))
                continue
            command, comment = _strip_comment(raw)
            if not command:
                continue
            command = " ".join(command.split())
            elsewhere = script or comment.startswith("needs ") or command in ELSEWHERE
            found.append((command, None, not elsewhere))
    return found


def page_cases(test_file: str) -> list:
    """pytest params (page, command, expected error) of every runnable command of the pages `test_file` runs."""
    return [
        pytest.param(page, command, expected, id=f"{page}: {command}")
        for page, runner in PAGES.items()
        if runner == Path(test_file).name
        for command, expected, runs in doc_commands(DOCS / page)
        if runs
    ]


RUNNABLE = [(c, e) for c, e, runs in doc_commands(README) if runs]


def test_the_environment_make_install_makes_can_be_activated():
    assert (Path(sys.executable).parent / "activate").is_file()


def fresh_copy(tmp_path_factory) -> Path:
    """A fresh copy of the repository's files, as a clone has them after `make install` (its .venv: this one), with
    MNIST files in data/."""
    work = tmp_path_factory.mktemp("clone")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        if (REPO / name).is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, work / name)
    write_idx(work / "data", "MNIST", n_train=5100)  # data=mnist's 5,000 validation images + 100
    (work / ".venv").symlink_to(sys.prefix)  # for the make targets a page shows (make docs-build)
    return work


def _fill(command: str, work: Path) -> str:
    """`<run>` and `<best>` from what the earlier commands wrote."""
    if "<sweep>" in command:
        sweeps = sorted((work / "logs" / "train" / "multiruns").glob("*"), key=lambda p: p.stat().st_mtime)
        assert sweeps, f"{command}: no earlier sweep"
        command = command.replace("<sweep>", sweeps[-1].name)
    if "<run>" not in command and "<best>" not in command:
        return command
    runs = sorted((work / "logs" / "train" / "runs").glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    assert runs, f"{command}: no earlier run with checkpoints"
    run = runs[-1].parent.parent
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    return command.replace("<run>", run.name).replace("<best>", best.stem)


def _python_argv(command: str) -> list[str] | None:
    """`python <args>` (or `pytest <args>`) as the argv the interpreter would get from bash (quotes, variables and
    globs expanded by bash itself), or None for a command that is more than one program (pipes, redirections, `&&`)
    or not python."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words = list(lex)
    if len(words) < 2 or words[0] not in ("python", "pytest") or any(set(w) <= set("|&;<>()") for w in words):
        return None
    expanded = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + command.split(None, 1)[1]], capture_output=True, text=True
    )
    module = ["-m", "pytest"] if words[0] == "pytest" else []  # the venv's `pytest` script is `python -m pytest`
    return [sys.executable, *module, *expanded.stdout.split("\0")[:-1]] if expanded.returncode == 0 else None


def run_command(workdir: Path, command: str, expected: str | None) -> None:
    # the copy's own code, as an editable install of a fresh clone would give: a file a page has a user add (a net
    # of their own) is found
    env = cli_env(PROJECT_PROFILE="tiny", PATH=f"{Path(sys.executable).parent}:{cli_env()['PATH']}")
    env["PYTHONPATH"] = str(workdir / "src")
    command = _fill(command, workdir)
    argv = _python_argv(command)
    if argv is not None:  # exactly `python ...` as written, in the warm interpreter (tests/warm.py)
        proc = run_python(argv, workdir, env)
    else:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=600
        )
    if expected is None:
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    else:
        assert proc.returncode == 2 and expected in proc.stderr.splitlines(), proc.stderr[-3000:]


def run_page_command(copies: dict[str, Path], tmp_path_factory, page: str, command: str, expected: str | None) -> None:
    """A page's command in the page's own fresh copy, made at its first command (tests/test_docs_*.py)."""
    if page not in copies:
        copies[page] = fresh_copy(tmp_path_factory)
    run_command(copies[page], command, expected)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return fresh_copy(tmp_path_factory)


@pytest.mark.parametrize(("command", "expected"), RUNNABLE, ids=[c for c, _ in RUNNABLE])
def test_readme_command(workdir, command, expected):
    run_command(workdir, command, expected)
