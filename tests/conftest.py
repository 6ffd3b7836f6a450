"""Shared fixtures: run the real entry points in a subprocess, or compose configs in-process."""

import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

# One OpenMP thread per process the suite starts (set before torch loads): `make test` runs three test files at
# a time on 2 cores, and with more OpenMP threads than cores libgomp's threads wait on each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from slurm_cluster import slurm_cluster  # noqa: F401  a fixture: a real one-node SLURM cluster
from warm import Warm

from engine.config import register

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

register()

if (REPO / "conf" / "local" / "default.yaml").exists():  # docs/configuration.md: this machine's own settings
    raise pytest.UsageError("conf/local/default.yaml changes every run's config, the tests' too: move it aside")


def run_dirs(log_dir: Path, task: str = "train") -> list[Path]:
    return sorted(p for p in (log_dir / task / "runs").glob("*") if p.is_dir())


def tensorboard_scalars(run: Path) -> dict[str, dict[int, float]]:
    """Every scalar of a run's TensorBoard event files: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for path in (run / "tensorboard").rglob("events.*"):
        events = EventAccumulator(str(path))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return found


def dead_pid() -> int:
    """The pid of a process of this machine that has ended (a writer `kill -9` stopped, as far as its files tell)."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(ended.stdout)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run in a test: tests/ importable (for probes.* targets), nothing else changed."""
    inherited = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # set by an in-process wandb run
    return {
        **inherited,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


# The longest test files (seconds on 2 cores, measured), started first: `make test` hands whole files to its
# workers in collection order, and a long file started last would run alone at the end on an idle core.
LONGEST_FIRST = (
    "test_readme.py",
    "test_docs_your_model.py",
    "test_trainer_options.py",
    "test_cli.py",
    "test_your_model.py",
    "test_fault_tolerance.py",
    "test_signals.py",
    "test_slurm.py",
    "test_config.py",
    "test_trackers.py",
    "test_hostile.py",
    "test_parallel_sweeps.py",
    "test_pipeline.py",
    "test_export.py",
    "test_optuna.py",
    "test_tensorboard.py",
)


# The longest tests that no doc command needs (14 s or more each on a busy 2-core machine, measured with
# `pytest --durations`): marked `long`, so `make test` stays within minutes; CI runs them too (`make test-long`).
LONG_FILES = (
    "test_torchrun_nodes.py",
    "test_slurm_nodes.py",
    "test_slurm_three_nodes.py",
    "test_trackers.py",
    "test_bench_gpu.py",
    "test_service_failures.py",
    "test_service_failures_disk.py",
)
LONG = (
    "test_resume_exact.py::test_a_resumed_run_keeps_the_unbroken_runs_best_checkpoint_and_tests_it",
    "test_resume_exact.py::test_a_plateau_scheduler_resumes_with_the_unbroken_runs_learning_rate",
    "test_sweep_metric.py::test_a_config_file_that_changes_the_metric_starts_another_study",
    "test_sweep_leftovers.py::test_a_nan_objective_is_a_failed_job_and_a_failed_trial",
    "test_sweep_dirs.py::test_two_sweeps_started_at_once_into_one_sweep_dir_one_is_refused",
    "test_resume_exact.py::test_a_run_accumulating_gradients_killed_between_steps_resumes_bit_for_bit",
    "test_resume_exact.py::test_resuming_mid_epoch_with_another_batch_size_is_one_line",
    "test_resume_exact.py::test_a_loader_that_cannot_resume_mid_epoch_says_so_and_another_sampler_is_one_line",
    "test_resume_exact.py::test_a_resume_with_persistent_loader_workers_says_their_draws_start_over",
    "test_signals.py::test_a_second_sigterm_ends_ranks_that_wait_on_each_other_at_once",
    "test_example_table.py::test_ddp_scores_each_test_row_once_as_one_device_does",
    "test_eval_shards.py::test_fsdp_predicts_every_input_once_in_as_many_batches_on_each_rank",
    "test_eval_shards.py::test_a_value_logged_with_sync_dist_is_one_devices_when_the_ranks_scored_an_odd_number",
    "test_eval_shards.py::test_the_templates_data_scores_each_test_digit_once_under_two_processes",
    "test_example_table.py::test_fsdp_predicts_three_rows_one_per_batch_as_one_device_does",
    "test_example_table.py::test_a_csv_wider_or_narrower_than_the_model_is_one_line_and_leaves_no_run",
    "test_example_text.py::test_sequences_longer_than_the_nets_context_are_one_line_and_leave_no_run",
    "test_your_model.py::test_a_validation_metric_nobody_logs_is_refused_before_the_first_training_step",
    "test_install.py::test_make_install_checks_every_hash_again_when_the_lock_changed",
    "test_averaging.py::test_a_killed_run_resumes_the_average_bit_for_bit_and_not_without_the_callback",
    "test_averaging.py::test_swa_on_a_users_module_is_the_mean_of_the_epoch_ends_from_start_epoch_on",
    "test_checkpoints.py::test_eval_py_refuses_a_hostile_checkpoint_and_touches_nothing",
    "test_cli.py::test_an_epoch_resumed_at_its_end_logs_no_empty_train_metrics",
    "test_cli.py::test_ddp_two_cpu_processes_share_one_run_dir_and_split_the_data",
    "test_cli.py::test_default_run_reaches_95_percent_on_real_digits",
    "test_cli.py::test_resume_continues_at_the_next_epoch_with_the_best_so_far",
    "test_cli_errors.py::test_bad_input_is_one_error_line_and_no_output",
    "test_cluster.py::test_torchrun_starts_the_ranks_and_lightning_launches_none",
    "test_compile.py::test_a_compiled_users_cnn_trains_as_the_eager_one_and_its_checkpoint_evaluates_uncompiled",
    "test_config.py::test_option_composes_builds_and_trains",
    "test_disk_errors.py::test_a_full_disk_in_a_checkpoint_write_keeps_the_templates_own_words",
    "test_equivalence.py::test_every_strategy_takes_the_same_steps_as_one_device",
    "test_example_table.py::test_it_trains_and_evaluates_on_its_own_metric",
    "test_example_text.py::test_a_run_killed_mid_epoch_resumes_bit_for_bit",
    "test_example_text.py::test_fsdp_shards_a_unit_per_block_and_recomputing_them_changes_nothing",
    "test_example_text.py::test_it_exports_for_any_prompt_length_up_to_its_context",
    "test_example_text.py::test_the_pipeline_cut_at_a_block_takes_one_devices_steps",
    "test_export.py::test_a_sharded_fsdp_checkpoint_is_gathered_and_exported",
    "test_export.py::test_every_net_exports_and_matches_pytorch_on_the_test_set",
    "test_fault_tolerance.py::test_a_diverging_sweep_job_is_recorded_and_the_sweep_goes_on",
    "test_fault_tolerance.py::test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole",
    "test_fault_tolerance.py::test_a_run_diverging_in_two_processes_says_so_once",
    "test_fsdp.py::test_fsdp_shards_trains_checkpoints_resumes_and_evaluates",
    "test_fuzz.py::test_any_override_composes_or_is_refused_in_one_line",
    "test_hostile.py::test_a_checkpoints_stored_paths_and_sizes_are_checked_before_use",
    "test_hostile.py::test_an_unwritable_export_target_is_one_line",
    "test_hostile.py::test_bad_image_files_are_named_or_skipped_and_counted",
    "test_hostile.py::test_no_entry_point_overwrites_what_it_did_not_create",
    "test_hostile.py::test_nodes_started_by_hand_share_the_directory_the_user_names",
    "test_hostile.py::test_two_launches_into_one_named_directory_one_is_refused_and_each_launchs_processes_join",
    "test_models.py::test_model_fast_dev_run_on_default_data",
    "test_optuna.py::test_a_killed_search_resumes_without_repeating_finished_trials",
    "test_optuna.py::test_a_search_of_a_metric_lower_is_better_minimizes_it",
    "test_optuna_dashboard.py::test_the_dashboard_shows_the_trials_the_sweep_summary_lists",
    "test_optuna_dashboard.py::test_the_summary_adds_optunas_plots_of_the_study",
    "test_parallel_sweeps.py::test_a_kill_9_of_the_sweep_stops_its_workers_jobs_as_a_sigterm_would",
    "test_parallel_sweeps.py::test_an_optuna_search_starts_the_next_trial_as_soon_as_a_worker_is_free",
    "test_pipeline.py::test_a_forward_around_the_net_runs_under_the_pipeline_as_on_one_device",
    "test_pipeline.py::test_a_gpt_written_the_nanogpt_way_is_cut_at_a_block_and_trains_as_on_one_device",
    "test_pipeline.py::test_nets_written_as_users_write_them_take_the_same_steps_as_one_device",
    "test_predict.py::test_predict_writes_one_row_per_input_in_order_with_the_models_probabilities",
    "test_signals.py::test_a_signal_between_training_steps_is_honoured",
    "test_signals.py::test_a_signal_to_ddp_spawns_main_process_as_its_workers_start_ends_the_run_in_one_line",
    "test_signals.py::test_a_signal_to_ddp_spawns_main_process_stops_its_workers_as_under_ddp",
    "test_signals.py::test_the_jobs_of_a_sequential_sweep_start_with_the_signal_handlers_the_sweep_had",
    "test_slurm.py::test_a_job_requeued_mid_epoch_resumes_its_own_checkpoint_bit_for_bit",
    "test_slurm.py::test_the_signal_before_the_time_limit_checkpoints_and_requeues",
    "test_slurm.py::test_a_sweep_on_slurm_runs_its_ddp_jobs_on_the_cluster_and_records_a_failed_one",
    "test_summary.py::test_a_sweep_with_a_failed_job_gets_its_summary_before_the_non_zero_exit",
    "test_sweeps.py::test_ddp_sweep_runs_each_jobs_config_on_all_its_ranks_and_goes_on_after_a_crashed_rank",
    "test_tensorboard.py::test_the_server_shows_the_runs_by_name_with_their_scalars",
    "test_tensorboard_figures.py::test_an_evaluation_draws_the_test_sets_figures_for_a_users_net",
    "test_throughput.py::test_under_pipeline_counting_is_refused_and_the_rates_are_the_pipelines_not_the_stages",
    "test_trainer_options.py::test_ddp_spawn_trains_a_users_own_lightning_module",
    "test_trainer_options.py::test_ddp_spawn_trains_and_tests_on_two_cpu_processes",
    "test_trainer_options.py::test_forked_workers_train_and_test_with_the_default_logger",
    "test_tune.py::test_apply_trains_with_the_value_as_the_override_would",
    "test_tune.py::test_the_lr_finder_on_a_users_net_writes_its_plot_and_the_override_and_trains_nothing",
    "test_your_data.py::test_a_plain_dataloader_resumes_mid_epoch_bit_for_bit",
    "test_your_data.py::test_a_batch_sampler_lightning_cannot_shard_is_one_line_under_ddp",
    "test_your_model.py::test_a_net_with_a_layer_forward_does_not_use_is_refused_in_one_line_by_ddp_and_fsdp",
    "test_your_model.py::test_predict_runs_a_users_module_without_a_predict_step_on_its_images",
    "test_your_model.py::test_resuming_a_users_module_with_other_arguments_is_refused_in_one_line",
    "test_your_model.py::test_trains_resumes_evaluates_predicts_and_exports",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first; the order within a file stays as written (the README's commands run in order). The
    tests in LONG and LONG_FILES get the `long` mark."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    long = set(LONG)
    for item in items:
        if item.path.name in LONG_FILES or item.nodeid.removeprefix("tests/").split("[")[0] in long:
            item.add_marker(pytest.mark.long)


WARM = Warm()  # this test process's warm interpreter (tests/warm.py), started on first use


@pytest.fixture(scope="session", autouse=True)
def _warm_interpreter() -> Iterator[None]:
    yield
    WARM.close()


@pytest.fixture(autouse=True)
def _own_meeting_port() -> Iterator[None]:
    """A run in this process that starts ranks leaves MASTER_PORT in its environment (Lightning does so): undone after
    each test, or every later CLI run of this test process would inherit that port as one the user chose."""
    before = {name: os.environ.get(name) for name in ("MASTER_PORT", "MASTER_ADDR")}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def run_python(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600, cold: bool = False
) -> subprocess.CompletedProcess:
    """`python <args>` (argv[0] is this interpreter) in `cwd` with `env`, stdout and stderr captured as text: in
    the warm interpreter (the imports already paid), or as a new process (`cold`) where the process itself is what
    a test looks at (what it imports, who its parent is)."""
    if cold:
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    return WARM.run(argv, Path(cwd), env, timeout)


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run `python <repo>/<script> <overrides>` as a user would, from a fresh working directory (`cwd`,
    tmp_path by default): logs/ and data/ land there by the config's own defaults."""

    def run(
        script: str,
        *overrides: str,
        check: bool = True,
        env: dict | None = None,
        cwd: Path | None = None,
        cold: bool = False,
    ) -> subprocess.CompletedProcess:
        cwd = cwd or tmp_path
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(REPO / script), *overrides]
        proc = run_python(cmd, cwd, cli_env(**(env or {})), cold=cold)
        if check and proc.returncode != 0:
            output = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{output}")
        return proc

    return run


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., DictConfig]:
    """Compose conf/<name>.yaml with overrides, paths pointed into tmp_path (no Hydra run needed)."""

    def make(*overrides: str, name: str = "train") -> DictConfig:
        paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'out'}"]
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            cfg = compose(name, overrides=[*paths, *overrides])
        (tmp_path / "out").mkdir(exist_ok=True)
        return cfg

    return make


def write_idx(root: Path, folder: str, n_train: int, n_test: int = 100) -> dict[str, np.ndarray]:
    """Tiny files in the real MNIST IDX format (big-endian magic, dims, uint8 data), as torchvision reads them."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())
        arrays[prefix] = images
        arrays[f"{prefix}_labels"] = labels
    return arrays
