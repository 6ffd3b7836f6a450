"""Lightning's DDP, registered under the same names, with sync_batchnorm that never breaks a CPU run and a
rendezvous that says whom it waits for (engine.strategies.rendezvous)."""

import contextlib
import io
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from engine.console import STOPPED_BY_A_SIGNAL
from engine.errors import say, unused_parameters_in, user_error_in_traceback
from engine.launch.ranks import RankWatchingLauncher
from engine.strategies import rendezvous

log = logging.getLogger(__name__)


def in_floating_point(tensor: Any, reduce_op: Any) -> Any:
    """An integer tensor to average over the ranks, as float64: Lightning's mean divides the integer sum by the world
    size in integer arithmetic, so an epoch's `self.log(..., sync_dist=True)` mean, whose sample count is such a
    tensor, was off whenever the ranks' counts summed to a number the ranks do not divide (51 on 2 ranks: 25)."""
    averaged = str(reduce_op).lower().rsplit(".", 1)[-1] in ("mean", "avg")
    if isinstance(tensor, torch.Tensor) and averaged and not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor.double()
    return tensor


class DDPStrategy(LightningDDPStrategy):
    """`trainer.sync_batchnorm=true` converts BatchNorm to SyncBatchNorm on CUDA only: DDP refuses it on CPU, where
    statistics stay per process, with a warning (checked after accelerator=auto resolves, so under torchrun too)."""

    rendezvous_timeout_s = 300  # set from launch.rendezvous_timeout_s by engine.build

    def setup(self, trainer: Any) -> None:
        if self._layer_sync is not None and self.root_device.type != "cuda":
            modules = self.model.modules() if self.model is not None else []
            batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules)
            if batchnorm and self.global_rank == 0:  # a net without BatchNorm loses nothing: nothing to say
                log.warning(
                    f"sync_batchnorm=True has no effect on {self.root_device.type}: SyncBatchNorm needs CUDA. "
                    "BatchNorm statistics stay per process."
                )
            self._layer_sync = None
        super().setup(trainer)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return super().reduce(in_floating_point(tensor, reduce_op), group, reduce_op)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":  # the script re-run for each rank: watch the ranks it starts
            assert self.cluster_environment is not None
            self._launcher = RankWatchingLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ProcessGroupEndingLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        rendezvous.connect(self, self.rendezvous_timeout_s)


class ProcessGroupEndingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for ddp_spawn and ddp_fork, whose workers end their process group before exiting: at
    Python's exit gloo's running threads aborted a rank (SIGABRT). Rank 0 also sends back best scores and progress."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from engine.launch import worker_logs

        # These travel to the workers with this launcher: where the main process logs, and the run's Hydra config
        # (its overrides make the line that says how to continue a stopped run)
        self._logs = worker_logs.describe()
        self._hydra = HydraConfig.instance().cfg if HydraConfig.initialized() else None
        # When one worker exits, torch ends the others with SIGTERM and says so: after a stop, whichever rank exited
        # first, a warning line after the one that says how to continue. A failed worker's traceback names it.
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)
        try:
            with self._signals_passed_to_workers():
                return super().launch(function, *args, trainer=trainer, **kwargs)
        except torch.multiprocessing.ProcessExitedException as e:
            if e.exit_code in STOPPED_BY_A_SIGNAL:  # engine.callbacks.checks: a worker said where and how to go on
                raise SystemExit(e.exit_code) from None
            signum = -e.exit_code
            if signum in getattr(self, "_passed_on", ()):  # it reached a worker before its handlers (its start)
                name = signal.Signals(signum).name
                say(f"stopped by {name} while the workers started: nothing was trained, nothing saved")
                raise SystemExit(128 + signum) from None
            raise
        except torch.multiprocessing.ProcessRaisedException as e:  # a worker's error, as the text of its traceback
            error = user_error_in_traceback(str(e))
            if error is None:
                raise  # a bug: the worker's traceback is the report
            raise error from None  # a mistake the worker said in one line (a divergence): said once, here
        finally:
            spawn_log.setLevel(level)

    @contextlib.contextmanager
    def _signals_passed_to_workers(self) -> Iterator[None]:
        """A signal to the main process alone (`kill <pid>`) goes on to the workers, which then stop the run as under
        ddp; before the workers start, and after they end, it acts as before."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
            yield
            return
        signals = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
        before: dict[int, Any] = {signum: signal.getsignal(signum) for signum in signals}

        self._passed_on: set[int] = set()

        def pass_on(signum: int, frame: Any) -> None:
            workers = [p for p in getattr(self, "procs", []) if p.is_alive()]  # Lightning sets procs at their start
            for worker in workers:
                os.kill(worker.pid, signum)
            if workers:
                self._passed_on.add(signum)
                return
            previous = before[signum]
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise SystemExit(128 + signum)

        for signum in signals:
            signal.signal(signum, pass_on)
        try:
            yield
        finally:
            for number, handler in before.items():
                if handler is not None:
                    signal.signal(number, handler)

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        from engine.console import ignore_known_warnings, lost_connection
        from engine.errors import run_log
        from engine.launch import worker_logs

        ignore_known_warnings()  # a spawned worker starts without the main process's filters
        hydra = getattr(self, "_hydra", None)
        if hydra is not None:
            from hydra.core.hydra_config import HydraConfig

            HydraConfig.instance().set_config(hydra)
        if self._start_method == "fork" and args:
            _own_event_writers(args[0])
            # Forked after the parent's OpenMP threads ran: libgomp is not fork-safe, and the first parallel op would
            # wait for them for ever. One thread each (the variable too: Lightning would set its own when unset).
            torch.set_num_threads(1)
            os.environ["OMP_NUM_THREADS"] = "1"
        logs = getattr(self, "_logs", None)  # set by launch, in the main process
        if logs is not None and self._start_method != "fork":  # a forked worker has its parent's handlers already
            rank = self._strategy.node_rank * getattr(self._strategy, "num_processes", 1) + process_idx
            worker_logs.recreate(logs, rank)
        try:
            with run_log():  # the line that stops a run goes to the log too, as in the process that started it
                super()._wrapping_function(process_idx, *args, **kwargs)
        except Exception as e:
            flavour = "ddp_spawn" if self._start_method == "spawn" else "ddp_fork"
            unused = unused_parameters_in(e, flavour)
            if unused is not None:
                raise unused from None  # the main process says it in one line (user_error_in_traceback)
            if self._strategy.global_rank == 0 or not lost_connection(e):
                raise
            # Rank 0 ended (on an error the main process reports): this worker's error, sent first, would take its
            # place as the run's last line. Its own log says it; it ends quietly.
            logging.getLogger(__name__).error(f"lost the connection to rank 0 ({' '.join(str(e).split())[:160]})")
            raise SystemExit(0) from None
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    # Lightning sends back only the weights and callback_metrics (no best score for fit_metrics.json or a sweep):
    # rank 0's callback states (the monitor's best, the checkpoints' best scores) and fit progress go too.

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        from lightning.fabric.utilities.apply_func import apply_to_collection
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        from engine.callbacks.monitor import Monitor

        extra = super().get_extra_results(trainer)
        # Only callbacks whose state is rank 0's own: Lightning calls this on rank 0 alone, where a state that
        # gathers from every rank (the random states of engine.callbacks.run_state) would wait for the others.
        kept = [c for c in trainer.callbacks if isinstance(c, (Monitor, ModelCheckpoint, EarlyStopping))]
        callbacks = {c.state_key: c.state_dict() for c in kept}
        progress = {name: part.state_dict() for name, part in _progress(trainer).items()}
        state = {
            "callbacks": callbacks,
            "progress": progress,
            "logged_steps": trainer.fit_loop.epoch_loop._batches_that_stepped,
        }
        buffer = io.BytesIO()
        torch.save(apply_to_collection(state, torch.Tensor, lambda t: t.cpu()), buffer)
        extra["trainer_state_bytes"] = buffer.getvalue()
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        from lightning.pytorch.trainer.call import _call_callbacks_load_state_dict

        super().update_main_process_results(trainer, extra)
        state = torch.load(io.BytesIO(extra["trainer_state_bytes"]), weights_only=False)  # from our own worker
        _call_callbacks_load_state_dict(trainer, state)
        for name, part in _progress(trainer).items():  # not the loop's own load_state_dict: it marks a restart
            part.load_state_dict(state["progress"][name])
        trainer.fit_loop.epoch_loop._batches_that_stepped = state["logged_steps"]  # the step loggers write at


def _own_event_writers(trainer: Any) -> None:
    """A forked worker (ddp_fork, ddp_notebook) has its parent's TensorBoard writer, but not the thread that writes
    its queue: the first flush, at the first checkpoint, waited for ever. The worker opens writers of its own."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in getattr(trainer, "loggers", []):
        if isinstance(logger, TensorBoardLogger):
            logger._experiment = None


def _progress(trainer: Any) -> dict[str, Any]:
    """The counters a trainer reports its epoch and steps from."""
    loop = trainer.fit_loop
    return {
        "epoch": loop.epoch_progress,
        "optimizer_steps": loop.epoch_loop.automatic_optimization.optim_progress,
        "manual_steps": loop.epoch_loop.manual_optimization.optim_step_progress,
    }
