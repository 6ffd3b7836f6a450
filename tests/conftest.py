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
    "test_readme_second_half.py",
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first; the order within a file stays as written (the README's commands run in order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
