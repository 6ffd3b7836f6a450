"""Where a run writes: its directory's name, claimed atomically, and removed again if the run never started.

Imports no torch: Hydra resolves these names before any task code runs.
"""

import contextlib
import errno
import fcntl
import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.launch import environment

# Run dirs this process made, so that a failed start removes only what it created itself.
CREATED: set[str] = set()


def unique_dir(path: str) -> str:
    """Claim `path`, or `path_1`, `path_2`, ... if taken: two runs started in the same second get two dirs (mkdir is
    atomic). Hydra caches the result per process."""
    candidate, n = path, 0
    while True:
        try:
            os.makedirs(candidate, exist_ok=False)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{path}_{n}"


def _slurm_batch_name(parent: str, job_id: str) -> str:
    """The k-th `python train.py` of a batch script without srun gets slurm_<job>_run<k>: a requeue starts them in the
    same order, so each finds its own directory (and checkpoints) again."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    with open(os.path.join(parent, f".slurm_{job_id}.starts"), "a+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)  # released when the file closes
        ledger.seek(0)
        k = sum(1 for line in ledger if line.strip() == restart)
        ledger.write(f"{restart}\n")
    return f"slurm_{job_id}_run{k}"


def run_dir(parent: str) -> str:
    """`parent/<start time>` (made unique); for ranks started by torchrun or srun a name they share; for a
    SLURM batch script's own runs a name that survives a requeue."""
    try:
        missing = [p for p in (Path(parent), *Path(parent).parents) if not p.exists()]
        os.makedirs(parent, exist_ok=True)
        CREATED.update(str(p.resolve()) for p in missing)  # logs/, logs/train/, ...: ours to remove if unused
        name = environment.shared_run_name()
        job = environment.slurm_batch_job()
        if name is None and job is not None:
            name = _slurm_batch_name(parent, job)
        if name is None:
            path = unique_dir(os.path.join(parent, datetime.now().strftime("%Y-%m-%d_%H-%M-%S")))
            CREATED.add(os.path.abspath(path))
            return path
        path = os.path.join(parent, name)
        os.makedirs(path, exist_ok=True)
        return path
    except OSError as e:
        raise UserError(
            f"cannot create a run directory under {parent} ({e.strerror}): set paths.log_dir to a writable directory"
        ) from e


def cwd() -> str:
    """The directory the command was started from. Unlike `${hydra:runtime.cwd}`, also known while Hydra
    resolves `hydra.sweep.dir`, before any job exists."""
    return os.getcwd()


def holds_checkpoints(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob("*.ckpt")) or any(run_dir.glob("hpc_ckpt_*.ckpt"))


CLAIM = ".project_run"  # the launch a run dir belongs to, made whole or not at all: of two launches, one gets it

# The run dirs this process claimed, with the owner it wrote: a failed start removes a dir only while its claim is this
# process's (another run that claimed a dir this process made keeps it).
CLAIMED: dict[str, str] = {}


def launch_identity() -> str | None:
    """What every process of one launch shares and another launch does not: torchrun's run id, the SLURM job and
    step, the master address of nodes started by hand; None for a run that is its own single process."""
    name = environment.shared_run_name()
    if name is None and environment.shares_a_named_dir():
        name = f"nodes_{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}"
    return name


def own_identity() -> str:
    """A name no other process (of this machine or another) has: for a run or sweep that is its own launch."""
    return f"{os.uname().nodename}:{os.getpid()}:{datetime.now().isoformat()}"


def continuing(run_dir: Path) -> bool:
    """This process continues its own launch in `run_dir`: a restart, or a launch whose directory holds its checkpoints
    (torchrun restarts healthy nodes with a restart count of 0, and a continued torchrun keeps its --rdzv-id)."""
    if environment.restarted():
        return True
    launch = launch_identity()
    if launch is None or not holds_checkpoints(run_dir):
        return False
    try:
        return (run_dir / CLAIM).read_text(errors="replace").strip() == launch
    except OSError:
        return False


def _take(run_dir: Path, owner: str) -> str | None:
    """Make `run_dir`'s claim file name `owner`, unless there is one: None when this call made it, else the owner the
    existing one names. The claim file appears whole (a hard link of a written file), never half-made. OSError if the
    directory cannot be written."""
    partial = run_dir / f"{CLAIM}.{os.uname().nodename}.{os.getpid()}"
    try:
        partial.write_text(owner)
        try:
            os.link(partial, run_dir / CLAIM)
            return None
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: made empty-then-written, still exclusive
            try:
                with open(run_dir / CLAIM, "x") as f:
                    f.write(owner)
                return None
            except FileExistsError:
                pass
        return (run_dir / CLAIM).read_text(errors="replace").strip()
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def _claimed(run_dir: Path, owner: str) -> None:
    CLAIMED[str(run_dir.resolve())] = owner


def _disowned(run_dir: Path) -> None:
    """`run_dir` is another run's: this process removes nothing of it, even if it made the folder itself."""
    CREATED.discard(str(run_dir.resolve()))
    CLAIMED.pop(str(run_dir.resolve()), None)


def _release(run_dir: Path, owner: str) -> None:
    """Give back a claim this process made (a check after it refused the directory)."""
    with contextlib.suppress(OSError):
        if (run_dir / CLAIM).read_text(errors="replace").strip() == owner:
            (run_dir / CLAIM).unlink()
    _disowned(run_dir)


def claim(run_dir: Path, key: str, launch: str | None = None, what: str = "run") -> str:
    """This run's directory, atomically: of two launches named into one directory exactly one gets it, and its
    processes join. Returns the owner it was claimed as."""
    owner = launch or own_identity()
    try:
        other = _take(run_dir, owner)
    except OSError as e:
        fix = "make room there, or choose another directory" if e.errno == errno.ENOSPC else "choose a writable one"
        raise UserError(f"{key}={run_dir}: cannot be claimed ({e.strerror}); {fix}") from e
    if other is None or (launch is not None and other == launch):  # or another process of this launch came first
        _claimed(run_dir, owner)
        return owner
    _disowned(run_dir)
    started = "started at the same time" if launch is None else f"launched as {other or 'another job'}"
    raise UserError(
        f"{key}={run_dir} is being used by another {what} {started}; name a new directory, or leave {key} out for a "
        "fresh one"
    )


_JOB = " job "  # a sweep job's claim: "<the sweep's owner> job <number>"


def _hydras_own(path: Path, job_dir: Path) -> bool:
    """What Hydra wrote for the job before any callback runs (.hydra/, the job's log), and our claim."""
    parts = path.relative_to(job_dir).parts
    return parts[0] == ".hydra" or parts[0].startswith(CLAIM) or (len(parts) == 1 and path.suffix == ".log")


def claim_job_dir(job_dir: Path, sweep_dir: Path, sweep: str, num: Any, subdir: str) -> None:
    """Sweep job `num`'s directory, for it alone: another job of this sweep, another sweep or run that has it (or
    gets it at the same moment) refuses this job in one line naming the fix. `sweep` is the owner the sweep claimed
    its directory as; the processes of one job (a launch's ranks, each resolving the job's config) join its claim."""
    owner = f"{sweep}{_JOB}{num}"
    named = f"hydra.sweep.subdir={subdir}"
    apart = "name one that tells the jobs apart, e.g. hydra.sweep.subdir=${hydra.job.num} (the default)"
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        other = _take(job_dir, owner)
    except OSError as e:
        raise UserError(f"{named}: job {num}'s directory {job_dir} cannot be claimed ({e.strerror})") from e
    if other == owner:
        return  # this job's, claimed already (by another of its processes, or earlier in this one)
    if other is not None:
        if other == sweep:
            raise UserError(f"{named} puts job {num} into the sweep's own directory {job_dir}; {apart}")
        if other.startswith(sweep + _JOB):
            first = other[len(sweep + _JOB) :]
            raise UserError(f"{named} gives jobs {first} and {num} of this sweep one directory, {job_dir}; {apart}")
        _disowned(job_dir)
        raise UserError(
            f"{named}: job {num}'s directory {job_dir} is being used by another run or sweep; name a new "
            "hydra.sweep.dir, or leave it out for a fresh one"
        )
    _claimed(job_dir, owner)
    found = sorted(p for p in job_dir.rglob("*") if p.is_file() and not _hydras_own(p, job_dir))
    if found or holds_checkpoints(job_dir):  # a directory outside the sweep's (an absolute or ../ subdir)
        _release(job_dir, owner)
        shown = found[0].relative_to(job_dir) if found else "checkpoints"
        raise UserError(
            f"{named}: job {num}'s directory {job_dir} already holds an earlier run's files ({shown}, ...); "
            f"keep the jobs inside hydra.sweep.dir={sweep_dir}, or name a new directory"
        )


def claimed_job(job_dir: Path) -> str | None:
    """The number of the sweep job whose claim `job_dir` holds; None if no sweep job claimed it. Whoever writes into a
    job's directory for it (a sweeper recording a job it lost) writes there only for that job."""
    try:
        owner = (job_dir / CLAIM).read_text(errors="replace").strip()
    except OSError:
        return None
    return owner.rpartition(_JOB)[2] if _JOB in owner else None


def claim_sweep_job(hydra: Any) -> None:
    """In a sweep job (`hydra`: its config's hydra node), claim the job's directory (claim_job_dir) under the owner
    its sweep claimed the sweep dir as (engine.runs.guard). Nothing to do for a single run, a job's own ranks
    (hydra.output_subdir=null: they join the job's directory), a restarted job (its own directory), or a sweep the
    guard did not claim a directory for."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if environment.restarted() or hydra.mode != RunMode.MULTIRUN or hydra.output_subdir is None:
        return
    if OmegaConf.is_missing(hydra.job, "num") or OmegaConf.is_missing(hydra.runtime, "output_dir"):
        return  # the sweep's own process, before any job
    sweep_dir = Path(str(hydra.sweep.dir))
    try:
        sweep = (sweep_dir / CLAIM).read_text(errors="replace").strip()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f"hydra.sweep.dir={sweep_dir}: its claim cannot be read ({e.strerror})") from e
    written = OmegaConf.to_container(hydra.sweep, resolve=False)  # the subdir as the user wrote it
    subdir = written.get("subdir") if isinstance(written, dict) else None
    claim_job_dir(Path(str(hydra.runtime.output_dir)), sweep_dir, sweep, hydra.job.num, str(subdir))


def remove_if_unused(run_dir: Path) -> None:
    """Remove the run dir of a run that failed before doing anything, if this process made it (not a dir the
    user named, not a shared torchrun/srun dir, not a sweep job's dir) and it holds only Hydra's bookkeeping."""
    if str(run_dir.resolve()) not in CREATED or not run_dir.is_dir() or not _own_claim(run_dir):
        return
    for path in run_dir.rglob("*"):
        bookkeeping = ".hydra" in path.relative_to(run_dir).parts or path.suffix == ".log" or path.name == CLAIM
        parts = path.relative_to(run_dir).parts
        bookkeeping = bookkeeping or parts == ("multirun.yaml",) or parts[0] == ".submitit"  # a sweep's launchers
        if path.is_file() and not bookkeeping and not _settings_only(path):
            return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.resolve().parents:  # the folders this process made for it, if nothing else is there
        if str(parent) not in CREATED:
            break
        try:
            parent.rmdir()
        except OSError:
            break


def _own_claim(run_dir: Path) -> bool:
    """`run_dir` holds no claim, or this process's own: a directory another run claimed is never removed here."""
    try:
        found = (run_dir / CLAIM).read_text(errors="replace").strip()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return CLAIMED.get(str(run_dir.resolve())) == found


def _settings_only(path: Path) -> bool:
    """A logger's file holding the run's settings and nothing measured (hparams.yaml, an event file with only the
    HParams summary), written before the run found its mistake."""
    if path.name == "hparams.yaml":
        return True
    if not path.name.startswith("events.out.tfevents."):
        return False
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    try:
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary"):
                if any(value.metadata.plugin_data.plugin_name != "hparams" for value in event.summary.value):
                    return False
            elif not event.HasField("file_version"):  # a graph, a session log: something the run did
                return False
    except Exception:  # not one we can read: not ours to remove
        return False
    return True


def earlier_files(directory: Path) -> list[Path]:
    """Files in `directory` this process did not make (Hydra's bookkeeping, a lock or ledger of ours aside)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".slurm_"))


def check_own_output_dir(cfg: Any) -> None:
    """`paths.output_dir` is this run's own: Hydra's run dir, or one holding no earlier run's files (it would replace
    their results). Ranks and restarted jobs join a directory already checked."""
    from hydra.core.hydra_config import HydraConfig

    output_dir = Path(str(cfg.paths.output_dir)).expanduser().resolve()
    if not HydraConfig.initialized() or HydraConfig.get().output_subdir is None:
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    if output_dir == run_dir or continuing(run_dir):
        return
    found = earlier_files(output_dir)
    if found:
        raise UserError(
            f"paths.output_dir={output_dir} already holds an earlier run's files "
            f"({found[0].relative_to(output_dir)}, ...); leave paths.output_dir to Hydra for a new run directory, "
            "or name a new one"
        )


def make_output_dirs(cfg: Any) -> None:
    """Every directory the run will write to, made now: an unwritable one fails at start with its key named, not
    after an epoch of training. paths.output_dir must be this run's own (check_own_output_dir)."""
    check_own_output_dir(cfg)
    wanted = {"paths.output_dir": cfg.paths.output_dir}
    if cfg.get("trainer") is not None and cfg.trainer.get("default_root_dir"):
        wanted["trainer.default_root_dir"] = cfg.trainer.default_root_dir
    for group in ("logger", "callbacks"):
        for name, node in (cfg.get(group) or {}).items():
            for key in ("save_dir", "dirpath"):
                if node is not None and node.get(key):
                    wanted[f"{group}.{name}.{key}"] = node[key]
    for key, path in wanted.items():
        _refuse_file_url(key, str(path))
    made: list[Path] = []  # removed again, deepest first, if a later folder is refused: nothing is left behind
    try:
        for key, path in wanted.items():
            if "://" not in str(path):  # fsspec storage (s3://, gs://): not a local folder; Lightning writes there
                make_writable(key, Path(str(path)).expanduser(), made)  # `~/x`: Lightning writes under $HOME too
    except UserError:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _refuse_file_url(key: str, value: str) -> None:
    """Lightning, its loggers and Hydra take a `file:` URL for a relative path: `file:///x` wrote into ./file:/x."""
    from urllib.parse import unquote, urlparse

    url = urlparse(value)
    if url.scheme == "file":
        named = f" ({unquote(url.path)})" if url.path and not (url.query or url.fragment) else ""
        raise UserError(f"{key}={value}: a file URL; pass the folder's path itself{named}")


def make_writable(key: str, path: Path, made: list[Path]) -> None:
    """`path` and missing folders above it, made (and added to `made`, so a failed start removes only its own), then
    checked for writing; else one line naming `key`."""
    try:
        for folder in reversed([p for p in (path, *path.parents) if not p.exists()]):
            try:
                folder.mkdir()
                made.append(folder)
            except FileExistsError:  # made meanwhile by another process: not ours to remove
                pass
    except OSError as e:
        raise UserError(f"{key}={path}: cannot be created ({e.strerror}); choose a writable directory") from e
    if not os.access(path, os.W_OK | os.X_OK):  # also a read-only mount, which stops root too
        raise UserError(f"{key}={path}: not writable by this process; choose a writable directory")


def remove_empty_folders(run_dir: Path) -> None:
    """The run dir's folders that stayed empty (a checkpoint folder of a run that saved none), deepest first."""
    for folder in sorted((p for p in run_dir.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only an empty one goes
