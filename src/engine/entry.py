"""What every entry point does around its task: errors as one line, and no half-written output."""

import contextlib
import difflib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, InstantiationException
from omegaconf import DictConfig

from engine.console import (
    FULL_ERROR,
    PROFILE,
    STOPPED_BY_A_SIGNAL,
    full_error,
    ignore_known_warnings,
    lost_connection,
    one_console_output,
)
from engine.errors import (
    RunEnded,
    SweepStopped,
    UserError,
    disk_error_in,
    exit_with,
    missing_compile_backend_in,
    run_log,
    say,
    unused_parameters_in,
    user_error_in,
)
from engine.launch import environment, second_signal
from engine.refusals import data_refusal_in, misfit_in, unresumable_loader_in, unshardable_loader_in
from engine.runs.dirs import remove_empty_folders, remove_if_unused
from engine.sweeps import jobs as sweeps
from engine.sweeps.jobs import record_failure

log = logging.getLogger(__name__)


def _one_line(text: str) -> str:
    text = text.split("Config search path")[0]
    return re.sub(r"\s*\n\s*", " ", text).strip()


def _composition_error(e: CompactHydraException) -> str:
    """Hydra's message plus OmegaConf's cause in one line, with a close key when a key was mistyped."""
    if str(e).startswith("Could not override 'model'. No match in the defaults list"):  # eval, predict, export
        return f"model=...: {Path(sys.argv[0]).name} takes the model from the checkpoint (ckpt_path), not model="
    cause = e.__cause__
    parent = getattr(cause, "parent_node", None)
    key = getattr(cause, "key", None)
    if isinstance(parent, DictConfig) and key is not None and "not in " in str(cause):
        full_key = getattr(cause, "full_key", key)
        script, group = Path(sys.argv[0]).name, str(full_key).split(".")[0]
        known = [str(k) for k in parent.keys()]
        conf = Path(sys.argv[0]).resolve().parent / "conf"
        if "." not in str(full_key) and conf.is_dir():  # a top-level name: a config group's too (`modle=mlp`)
            known += [p.name for p in conf.iterdir() if p.is_dir()]
        close = difflib.get_close_matches(str(key), known, n=1)
        elsewhere = _options_with(group, str(full_key)) if "." in str(full_key) else []
        if not len(parent) and script != "train.py":  # eval.py's data: the checkpoint's, unless one is picked
            hint = f"{script} takes {group} from the checkpoint; to give other {group}, pick it first: {group}=<option>"
        elif elsewhere:  # another option of the group has it (data.image_size: data=image_folder's)
            picks = " or ".join(f"{group}={option}" for option in elsewhere[:3])
            hint = f"{picks} has it (pick that option first)"
        elif close:
            hint = f"did you mean {full_key[: -len(str(key))]}{close[0]}?"
        else:
            hint = f"valid keys: {', '.join(map(str, parent.keys()))}"
        what = "no such key" if "." in str(full_key) else "no such group or key"
        return f"{full_key}: {what}; {hint} (to add a new key on purpose: +{full_key}=...)"
    message = _one_line(str(e))
    if cause is not None:
        message += " " + _one_line(str(cause).split("full_key:")[0])
    return message


_ABSENT = object()


def _options_with(group: str, full_key: str) -> list[str]:
    """The options of config group `group` (conf/<group>/*.yaml) that set `full_key` (`data.image_size`)."""
    import yaml

    folder = Path(sys.argv[0]).resolve().parent / "conf" / group
    found = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        try:
            node: Any = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        for part in full_key.split(".")[1:]:
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:
            found.append(path.stem)
    return found


def _group_given_a_value(error: BaseException) -> UserError | None:
    """`precision=16`, `model=1`, `trainer=true`: Hydra reads a number or a boolean where a config group takes the
    name of one of its options, and says so in a traceback that names neither the key nor the options."""
    if not (isinstance(error, ValueError) and str(error).startswith("Config group override must be a string")):
        return None
    conf = Path(sys.argv[0]).resolve().parent / "conf"
    for arg in sys.argv[1:]:
        key, given, value = arg.lstrip("+~").partition("=")
        number = r"[-+]?(\d[\d_]*(\.\d*)?|\.\d+)(e[-+]?\d+)?|[-+]?(inf|nan)"
        not_a_name = re.fullmatch(rf"{number}|true|false|null", value, flags=re.IGNORECASE)
        if given and not_a_name and (conf / key).is_dir():
            options = ", ".join(sorted(p.stem for p in (conf / key).glob("*.yaml")))
            return UserError(f"{key}={value}: {key} is a config group, which takes the name of an option: {options}")
    return None


def _sbatch_refused(error: BaseException) -> UserError | None:
    """hydra/launcher=slurm asked for what the cluster cannot give (mem_gb: 64 on a smaller node): submitit raises
    sbatch's refusal in a traceback."""
    text = str(error)
    if type(error).__name__ != "FailedJobError" or "sbatch: error" not in text:
        return None
    said = next(line for line in text.splitlines() if "sbatch: error" in line).split("sbatch: error:", 1)[-1]
    return UserError(
        f"hydra/launcher=slurm: sbatch refused the job ({said.strip()}); ask for what the cluster has: "
        "hydra.launcher.mem_gb, cpus_per_task, gpus_per_node, partition, timeout_min"
    )


# What a command line may hold, checked before Hydra parses it (Hydra turned a key of 260 characters into an
# OSError from a file name, and a number of 5000 digits into Python's ValueError, each a traceback).
MAX_KEY = 200  # characters of an override's key: the config's own keys are far shorter
MAX_VALUE = 4096  # characters of a value: a path at most (PATH_MAX)
MAX_DIGITS = 300  # digits in a row: more than any float holds, and Python refuses integers of thousands


def bounded(args: list[str]) -> UserError | None:
    """The first command-line argument past the bounds, as the one line that says so."""
    for arg in args:
        key, given, value = arg.partition("=")
        if not given or arg.startswith("-"):
            continue
        if len(key.lstrip("+~")) > MAX_KEY:
            return UserError(
                f"an override's key of {len(key)} characters ({key[:40]}...): config keys are at most {MAX_KEY}"
            )
        if len(value) > MAX_VALUE:
            return UserError(f"{key}=...: a value of {len(value)} characters; at most {MAX_VALUE}")
        digits = max((len(run) for run in re.findall(r"\d+", value)), default=0)
        if digits > MAX_DIGITS:
            return UserError(f"{key}=...: a number of {digits} digits; at most {MAX_DIGITS}")
    return None


def _our_help() -> None:
    """`--help` (alone, as Hydra reads it): the groups a user picks, read from conf/<script>.yaml's folder; Hydra's
    own help, with every group and the composed config, is `--hydra-help`'s neighbour `--cfg job`."""
    if not any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        return
    script = Path(sys.argv[0])
    conf = script.resolve().parent / "conf"
    if not (conf / f"{script.stem}.yaml").is_file():  # another layout: Hydra's help
        return
    from engine.help import render

    print(render(conf, script.stem, script.name))
    raise SystemExit(0)


def _with_profile(argv: list[str]) -> list[str]:
    """$PROJECT_PROFILE=<name> adds `profile=<name>` (conf/profile/): the documented way to shrink every command,
    for tests. Ranks and sweep jobs that a run starts inherit both the variable and the override."""
    profile = os.environ.get(PROFILE)
    if not profile or any(arg.startswith("profile=") for arg in argv[1:]):
        return argv
    # beside the other overrides: argparse takes Hydra's overrides as one run of positional arguments
    first = next((i for i, arg in enumerate(argv[1:], 1) if "=" in arg and not arg.startswith("-")), len(argv))
    return [*argv[:first], f"profile={profile}", *argv[first:]]


def cli(hydra_main: Callable[[], Any]) -> None:
    """Run a @hydra.main function so that mistakes print one line and exit 2 (not 7 lines and 1)."""
    from engine.config import register

    register()  # the typed schemas and resolvers conf/ uses, before Hydra composes anything
    _our_help()
    os.environ.setdefault(FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "0"))
    os.environ["HYDRA_FULL_ERROR"] = "1"  # makes Hydra raise to us instead of printing its own report
    sys.argv = _with_profile(sys.argv)
    too_long = bounded(sys.argv[1:])
    if too_long is not None:
        exit_with(too_long)
    ignore_known_warnings()
    sweeps.remember_entry_script()
    try:
        try:
            hydra_main()
        except Exception as e:
            user_error = user_error_in(e) or _group_given_a_value(e) or _sbatch_refused(e)
            if full_error() or (user_error is None and not isinstance(e, CompactHydraException)):
                raise
            _remove_unused_sweep_dir()
            exit_with(user_error or UserError(_composition_error(e)))  # type: ignore[arg-type]
    except SystemExit as e:
        if e.code in STOPPED_BY_A_SIGNAL:
            _summary_of_a_stopped_sweep()
        _leave(e.code)
    except KeyboardInterrupt:  # outside a run (between a sweep's jobs, before one starts): nothing of a run to save
        say("stopped by SIGINT")
        _summary_of_a_stopped_sweep()
        _leave(130)
    _leave(0)


def _summary_of_a_stopped_sweep() -> None:
    """A sweep that a signal stopped ends without Hydra's end-of-sweep callbacks: its summary (the finished jobs, the
    one stopped, those not started) is written here, as at its end."""
    if not sweeps.is_multirun():
        return
    sweep_dir = Path(HydraConfig.get().sweep.dir)
    if not sweep_dir.is_dir() or not any((p / ".hydra").is_dir() for p in sweep_dir.iterdir()):
        return
    from engine.sweeps.summary import write_summary

    try:
        jobs = write_summary(sweep_dir)
    except Exception as e:  # the summary is a report: the stop's own line and exit code stand
        say(f"error: sweep summary of {sweep_dir} failed: {type(e).__name__}: {e}")
        return
    left = sum(job.status == "not started" for job in jobs)
    say(f"sweep stopped, {left} of {len(jobs)} jobs not started; summary: {sweep_dir / 'summary.md'}")


def _remove_unused_sweep_dir() -> None:
    """A sweep refused before any job ran (a search-space or storage error) leaves no sweep directory."""
    if sweeps.is_multirun():
        remove_if_unused(Path(HydraConfig.get().sweep.dir))


_QUICK_EXIT = {"on": True}  # the run's `speedups`, set by run()


def _leave(code: Any) -> None:
    """Exit as the interpreter would (threads joined, atexit run, streams flushed) minus its module teardown, about
    1.3 s a process (benchmarks/startup.py); with `speedups=false` or under cProfile, the usual exit."""
    import atexit
    import threading

    if sys.getprofile() is not None or not _QUICK_EXIT["on"]:
        raise SystemExit(code)
    status = code if isinstance(code, int) else 0 if code is None else 1
    if not isinstance(code, (int, type(None))):
        print(code, file=sys.stderr)
    try:
        shutdown = getattr(threading, "_shutdown", None)  # CPython's own first step at exit
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _error_line(error: BaseException) -> str:
    if isinstance(error, UserError):
        return str(error)
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _config_error(error: BaseException) -> bool:
    """Lightning says a setting cannot work (MisconfigurationException): a user's mistake, not a bug."""
    return isinstance(error, UserError) or type(error).__name__ == "MisconfigurationException"


def _lost_rank(error: BaseException, run_dir: Path) -> str | None:
    """A collective that failed because another rank died: say so once, in one line, instead of a traceback; when
    that rank was another node's (torchrun, srun, nodes by hand), with how to continue from the newest checkpoint."""
    if not lost_connection(error):
        return None
    from engine.launch import ranks  # imports Lightning: only once a collective has failed
    from engine.runs.continuing import continue_command
    from engine.runs.resume import newest_checkpoint

    reason = " ".join(str(error).split())[:160]
    dead = None if environment.watched_rank() else ranks.dead_rank()  # rank 0's watcher may know which one died
    line = dead or f"lost the connection to another rank ({reason}); see that rank's log"
    newest = newest_checkpoint(run_dir) if dead is None else None  # another node's process died (torchrun, srun)
    if newest is not None:
        line += f"; continue with: {continue_command(newest)}"
    ranks.report_once(line)
    return line


def _task(name: str) -> Callable[[DictConfig], Any]:
    """`module:function`, imported only now: torch and Lightning load once the config has passed its checks."""
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


@contextlib.contextmanager
def _signal_handlers_put_back() -> Iterator[None]:
    """The signal handlers as before the task: a run's own (engine.callbacks.checks) outlive its trainer, and would
    record a sequential sweep's later Ctrl-C for a run that is over, and ignore it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
    before = {signum: signal.getsignal(signum) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in before.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                signal.signal(signum, handler)


def run(task: str, cfg: DictConfig) -> Any:
    """Call the task (`module:function`) on `cfg`. A mistake leaves no run dir and becomes one `error: ...` line (exit
    code 2); in a sweep a failure fails this job only (engine.sweeps.jobs.SweepReport exits non-zero at the end)."""
    from engine.config.schema import check_config

    ignore_known_warnings()
    _QUICK_EXIT["on"] = bool(cfg.get("speedups", True))
    hc = HydraConfig.get()
    with run_log(), _signal_handlers_put_back(), second_signal.armed():  # the ending line goes to the run's log too
        try:
            check_config(cfg)
            function = _task(task)
            one_console_output()
            result = function(cfg)
            if not environment.watched_rank():
                log.info("Run directory: %s", hc.runtime.output_dir)  # again at the end: where the results are
            return result
        except RunEnded as ended:  # tune without tune.apply, a sweep job run in a process of its own
            remove_empty_folders(Path(hc.runtime.output_dir))  # made at start for checkpoints and logs never written
            if not environment.watched_rank():
                log.info("Run directory: %s", hc.runtime.output_dir)
            return ended.value
        except Exception as e:
            if full_error():
                raise
            if isinstance(e, InstantiationException):  # a target that refused its arguments while the task built it
                from engine.build import one_line

                e = one_line(e)
            e = missing_compile_backend_in(e) or unused_parameters_in(e) or e
            e = data_refusal_in(e) or unshardable_loader_in(e) or unresumable_loader_in(e) or e
            e = misfit_in(e, cfg.get("model")) or e
            if sweeps.is_multirun():
                if isinstance(e, SweepStopped):
                    raise  # the sweeper says it, once
                record_failure(Path(hc.runtime.output_dir), _error_line(e))
                return None
            lost = _lost_rank(e, Path(hc.runtime.output_dir))
            if lost is not None:  # the one line about the dead rank is said
                # in a rank that rank 0 watches, into its own log: rank 0 says how the run ended, and this rank's
                # exit 1 could reach rank 0's watcher as a death before rank 0 had said it
                raise SystemExit(0 if environment.watched_rank() else 1) from None
            disk = disk_error_in(e)
            if disk is not None:
                exit_with(disk)  # what was written before stays
            if not _config_error(e):
                if environment.watched_rank():  # its console is rank 0's: the traceback goes into its own log too,
                    # where rank 0's watcher reads the error's line (engine.launch.ranks)
                    log.error("error: %s", _error_line(e), exc_info=True)
                raise  # a bug: its traceback is the useful report
            remove_if_unused(Path(hc.runtime.output_dir))
            exit_with(e if isinstance(e, UserError) else UserError(_error_line(e)))
