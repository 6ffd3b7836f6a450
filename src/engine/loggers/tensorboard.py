"""TensorBoard with a readable HParams tab: Lightning's lists every config key (76 here) and rewrites `hp_metric = -1`
at `trainer.test`. Here the summary is written once: groups chosen, a few key values, the command line's overrides.
Only the run's own session, no declared experiment: TensorBoard takes the first it finds as every run's.
"""

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

GROUPS = ("data", "model", "trainer", "precision", "experiment")


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _scalar(value: Any) -> int | float | str | bool:
    """HParams holds numbers, strings and booleans; anything else is shown as its text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _run_choices() -> tuple[dict[str, str], list[str]]:
    """The config groups Hydra chose for this run, and the keys its command line set."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}, []
    hc = HydraConfig.get()
    choices = {group: str(hc.runtime.choices[group]) for group in GROUPS if hc.runtime.choices.get(group)}
    keys = [o.lstrip("+~").split("=", 1)[0] for o in hc.overrides.task if "=" in o]
    return choices, [k for k in keys if "/" not in k and k not in GROUPS and k != "profile"]


def sweep_job_name() -> str:
    """In a sweep, what this job changes (`model=mlp,seed=1`), so that TensorBoard's run list says which run is
    which: a key the sweep's command line gave one value for every job (multirun.yaml, written by Hydra's sweeper
    before any job) tells nothing apart. A single run keeps its directory's name (its start time) alone."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    hydra, parser = HydraConfig.get(), OverridesParser.create()
    try:
        given = parser.parse_overrides(
            list(OmegaConf.load(os.path.join(hydra.sweep.dir, "multirun.yaml")).hydra.overrides.task)
        )
        alike = {o.key_or_group for o in given if not o.is_sweep_override()}
    except Exception:  # a sweeper that writes none: every override names the job
        alike = set()
    mine = [o for o in hydra.overrides.task if not o.startswith(("profile=", "hydra.", "++hydra."))]
    keys = [o.key_or_group for o in parser.parse_overrides(mine)]
    name = ",".join(o.lstrip("+~").replace("/", "-") for o, key in zip(mine, keys) if key not in alike)
    return name[:120] or f"job{hydra.job.num}"


def masked_crc32c(data: bytes) -> int:
    """TensorBoard's record checksum (masked CRC-32C), computed in C by google-crc32c."""
    import google_crc32c

    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def use_fast_checksums() -> None:
    """google-crc32c's C checksum for event records: TensorBoard without TensorFlow uses pure Python, holding the GIL
    ~11 ms an epoch (benchmarks/figures.py). Without a C build, TensorBoard's own function stays."""
    import google_crc32c
    from tensorboard.summary.writer import record_writer

    if google_crc32c.implementation == "c":
        record_writer.masked_crc32c = masked_crc32c


def leave_writer_disk_errors_to_the_run() -> None:
    """A disk-full or read-only error in TensorBoard's writer thread is raised again at the next write, ending the run
    in one line (engine.errors.disk_error_in): the thread's own traceback is left out; other errors print as before."""
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from engine.errors import disk_error_in

    previous = threading.excepthook
    if getattr(previous, "leaves_writer_disk_errors", False):
        return

    def hook(args: Any) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and args.exc_value and disk_error_in(args.exc_value)):
            previous(args)

    hook.leaves_writer_disk_errors = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoardLogger(LightningTensorBoardLogger):
    """`hparams`: dotted keys of the run config shown in the HParams tab beside the groups chosen and the keys the
    command line set; the metrics beside them are the run's own scalars."""

    def __init__(
        self,
        save_dir: str,
        name: str = "",
        version: str | None = None,
        hparams: Sequence[str] = (),
        log_graph: bool = False,
        **kwargs: Any,
    ) -> None:
        flush_secs = kwargs.get("flush_secs", 120)  # SummaryWriter's default
        if isinstance(flush_secs, bool) or not (isinstance(flush_secs, (int, float)) and 0.1 <= flush_secs <= 1e7):
            raise ValueError(
                "flush_secs must be a number of seconds from 0.1 to 1e7 (below, TensorBoard's event writer thread "
                f"spins; above, its wait overflows), got {flush_secs!r}"
            )
        version = sweep_job_name() if version is None else version
        use_fast_checksums()
        leave_writer_disk_errors_to_the_run()
        super().__init__(save_dir, name=name, version=version, log_graph=log_graph, default_hp_metric=False, **kwargs)
        self.hparam_keys = list(hparams)
        self._summary_written = False
        self._hparams_file_written = False
        self._flush_secs = float(flush_secs)
        self._held: list[tuple[Any, int | None, float]] = []  # log_metrics' events not yet handed over
        self._held_since: float | None = None
        self._saved_at: int | None = None  # the step of the newest checkpoint: events up to it are not held

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_held"], state["_held_since"] = [], None  # they stay with this process's logger, which writes them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A ddp_spawn worker rebuilds the logger from a pickle, not __init__. Lightning does not finalize the loggers
        # when a fit fails there: nothing is held back in it (each call is written as it comes, the slower way).
        self.__dict__.update(state)
        self._flush_secs = 0.0
        use_fast_checksums()
        leave_writer_disk_errors_to_the_run()

    @rank_zero_only
    def log_hyperparams(self, params: Any, metrics: Any = None, step: int | None = None) -> None:
        super().log_hyperparams(params, metrics, step)  # hparams.yaml keeps the whole config
        if self._summary_written or not isinstance(params, Mapping):
            return
        from torch.utils.tensorboard.summary import hparams

        choices, overridden = _run_choices()
        shown: dict[str, Any] = dict(choices)
        for key in [*self.hparam_keys, *overridden]:
            value = _lookup(params, key)
            if value is not None and key not in shown:
                shown[key] = _scalar(value)
        _, session_start, _ = hparams(shown, {})
        self.experiment._get_file_writer().add_summary(session_start)
        self._summary_written = True

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Lightning's, with a call's scalars in one held event (`_hold`) instead of one each: half the time
        (benchmarks/per_call.py). A dict is still a run per key; a non-number scalar makes the call write nothing."""
        from lightning.fabric.utilities.logger import _add_prefix
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch import Tensor
        from torch.utils.tensorboard.summary import scalar

        summary = Summary()
        groups: dict[str, Any] = {}  # the dicts, each a run of its own per key
        for key, value in _add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, Tensor):
                value = value.item()
            if isinstance(value, dict):
                groups[key] = value
                continue
            try:
                summary.value.extend(scalar(key, value).value)
            except Exception as e:
                raise ValueError(
                    f"\n you tried to log {value} which is currently not supported. Try a dict or a scalar/tensor."
                ) from e
        if summary.value:
            self._hold(summary, step)
        for key, values in groups.items():
            self.experiment.add_scalars(key, values, step)

    def _hold(self, summary: Any, step: int | None) -> None:
        """Kept until a call `flush_secs` after the oldest kept (or a checkpoint, or the end): each event handed over
        wakes the writer thread, which then holds the GIL (19 vs 54 µs a call, benchmarks/per_call.py)."""
        now = time.monotonic()
        self._held.append((summary, step, time.time()))
        if self._held_since is None:
            self._held_since = now
        # An epoch's own metrics logged after its checkpoint (Lightning logs train/ epoch metrics after the epoch's
        # saves) go at once: a resume from that checkpoint would not log them again.
        saved = self._saved_at is not None and step is not None and step <= self._saved_at
        if saved or now - self._held_since >= self._flush_secs:
            self._write_held()

    def _write_held(self) -> None:
        held, self._held, self._held_since = self._held, [], None
        if held:
            writer = self.experiment._get_file_writer()
            for summary, step, wall_time in held:
                writer.add_summary(summary, step, wall_time)

    @rank_zero_only
    def save(self) -> None:
        """Called after every `log_metrics`, Lightning's drained the writer and looked for hparams.yaml each time
        (5-8 ms an epoch, benchmarks/step_loop.py): here hparams.yaml is written once; scalars go in batches."""
        if not self._hparams_file_written:
            super().save()
            self._hparams_file_written = self._fs.isfile(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE))

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        self._saved_at = getattr(checkpoint_callback, "_last_global_step_saved", None)
        self._write_held()
        if self._experiment is not None:
            self._experiment.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        try:
            self._write_held()  # before Lightning's flush and close, also when the run failed
            super().finalize(status)
        except OSError:  # the writer thread's disk error, raised again at every write and flush
            if status != "failed":
                raise
            self._close_unflushed()  # a failed run's own error is the one to report

    def _close_unflushed(self) -> None:
        """The event files closed without the flush that raises the writer thread's error again (that thread has
        ended on it), so that the next stage (test after fit) opens new ones."""
        experiment: Any = self._experiment
        if experiment is None:
            return
        writers: dict[str, Any] = experiment.all_writers or {}
        for writer in writers.values():
            try:
                writer.close()
            except OSError:
                pass
        experiment.file_writer = experiment.all_writers = None
