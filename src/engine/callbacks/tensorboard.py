"""What a person opens TensorBoard for beyond the scalars: a classifier's sample grid and confusion matrix, the graph,
and (behind a switch) histograms. Figures come at most every `min_interval_s` (TensorBoard keeps 10 images a tag, and
drawing each epoch cost the MLP's 0.2 s epochs 18 ms, benchmarks/step_loop.py), the last epoch's always.
"""

import logging
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from engine.strategies.parallelize import net_of

log = logging.getLogger(__name__)


def _writer(trainer: L.Trainer) -> Any:
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def _padded(matrix: Tensor, classes: int) -> Tensor:
    """`matrix` grown with zeros to `classes` x `classes` (labels larger than any seen before)."""
    grow = classes - len(matrix)
    return torch.nn.functional.pad(matrix, (0, grow, 0, grow)) if grow > 0 else matrix


def _graph(net: torch.nn.Module, example: Tensor) -> tuple[Any, Any]:
    """What SummaryWriter.add_graph writes, traced once in eval mode without its check_trace's two extra traces
    (ResNet-18: 352 -> 143 ms, benchmarks/graph.py); each submodule gets its own mode back."""
    from torch.utils.tensorboard import _pytorch_graph as pytorch_graph

    modes = [(module, module.training) for module in net.modules()]
    net.eval()
    try:
        trace = torch.jit.trace(net, example, check_trace=False)
    finally:
        for module, training in modes:
            module.training = training
    torch._C._jit_pass_inline(trace.graph)
    nodes = pytorch_graph.parse(trace.graph, trace, example)
    devices = [pytorch_graph.DeviceStepStats(device="/device:CPU:0")]  # as torch's: the device is not shown
    stats = pytorch_graph.RunMetadata(step_stats=pytorch_graph.StepStats(dev_stats=devices))
    return pytorch_graph.GraphDef(node=nodes, versions=pytorch_graph.VersionDef(producer=22)), stats


def _one_process(trainer: L.Trainer) -> bool:
    """Graph tracing and full-parameter histograms need the whole model in this process, on its own."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return isinstance(trainer.strategy, SingleDeviceStrategy)


class TensorBoardInsights(L.Callback):
    """Sample grid, confusion matrix, graph (once, one-process strategies) and histograms (off: they grow the event
    files), each every `every_n_epochs`; figures at most every `min_interval_s` seconds, always for the last epoch."""

    def __init__(
        self,
        images: bool = True,
        confusion_matrix: bool = True,
        graph: bool = True,
        histograms: bool = False,
        every_n_epochs: int = 1,
        samples: int = 32,
        min_interval_s: float = 10.0,
    ) -> None:
        if every_n_epochs < 1 or samples < 1:
            raise ValueError(f"every_n_epochs and samples must be >= 1, got {every_n_epochs} and {samples}")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0 seconds, got {min_interval_s}")
        self.images, self.confusion_matrix, self.graph = images, confusion_matrix, graph
        self.histograms, self.every_n_epochs, self.samples = histograms, every_n_epochs, samples
        self.min_interval_s = min_interval_s
        self._drawn_at: float | None = None  # when the fit started or the last figures went to the drawing thread
        self._undrawn: Any = None  # the newest epoch's figures, when they were not drawn: drawn at the end of fit
        self._matrix: Tensor | None = None
        self._grid: tuple[Tensor, Tensor, Tensor] | None = None
        self._graph_done = False
        self._painter: ThreadPoolExecutor | None = None  # made on first use: a callback must pickle (ddp_spawn)
        self._drawing: list[Future] = []
        self._said = False  # that a module of another task gets no classifier figures: said once

    def _finish_drawing(self) -> None:
        drawing, self._drawing = self._drawing, []
        for future in drawing:
            future.result()  # a drawing error is raised here, not lost

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        undrawn, self._undrawn = self._undrawn, None
        if undrawn is not None:  # the last epoch came sooner than min_interval_s after the figures before
            self._draw(*undrawn)
        self._finish_drawing()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A fit that an error or a signal's stop ends gets no on_train_end or teardown from Lightning: the figures
        # held back are drawn now, before the loggers close. A drawing error is logged: the run's error is the news.
        try:
            self.on_train_end(trainer, pl_module)
        except Exception as e:
            log.warning(f"TensorBoard figures not drawn: {type(e).__name__}: {e}")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._drawn_at, self._undrawn = time.monotonic(), None  # each fit counts its interval from its start

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._finish_drawing()

    def _due(self, trainer: L.Trainer) -> bool:
        return not trainer.sanity_checking and trainer.current_epoch % self.every_n_epochs == 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._matrix, self._grid = None, None

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        if self._due(trainer):
            self._collect(trainer, pl_module, outputs, args[0], "validation_step")  # args: the batch, its index, ...

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self._collect(trainer, pl_module, outputs, args[0], "test_step")  # args: the batch, its index, ...

    def _collect(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, step: str) -> None:
        """A batch's counts for the confusion matrix, and the first batch's digits for the grid."""
        if not isinstance(outputs, dict) or "preds" not in outputs or "target" not in outputs:
            if not self._said and trainer.is_global_zero and (self.images or self.confusion_matrix):
                log.info(
                    "TensorBoard: no sample grid or confusion matrix for %s: its %s returns no "
                    "{'preds': ..., 'target': ...} (a classifier's); it may log figures of its own "
                    "(docs/tensorboard-and-trackers.md)",
                    type(pl_module).__name__,
                    step,
                )
            self._said = True
            return
        preds, target = outputs["preds"].detach(), outputs["target"].detach()
        if self.confusion_matrix and target.numel():
            classes = int(getattr(pl_module, "num_classes", 0)) or int(max(preds.max(), target.max())) + 1
            classes = max(classes, len(self._matrix) if self._matrix is not None else 0)  # labels seen before
            counts = torch.bincount(target * classes + preds, minlength=classes * classes).view(classes, classes)
            self._matrix = counts + _padded(self._matrix, classes) if self._matrix is not None else counts
        if self.images and self._grid is None and trainer.is_global_zero:
            images = batch[0][: self.samples].detach()
            self._grid = (images, preds[: self.samples], target[: self.samples])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._due(trainer):
            return
        writer = self._figures(trainer, pl_module, "val")
        if writer is not None and self.histograms and _one_process(trainer):
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for name, param in pl_module.named_parameters():
                writer.add_histogram(f"weights/{name}", param.detach().float().cpu(), step)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._figures(trainer, pl_module, "test")
        self._finish_drawing()  # before the loggers close: a test ends the run

    def _figures(self, trainer: L.Trainer, pl_module: L.LightningModule, prefix: str) -> Any:
        """The epoch's grid and matrix (every rank's counts) to rank 0's writer, under `prefix`/; that writer."""
        matrix = self._matrix
        if self.confusion_matrix and trainer.world_size > 1:  # every rank takes part, with or without counts
            classes = int(getattr(pl_module, "num_classes", 0))
            if not classes:  # sized by the labels each rank saw: the largest size of any rank
                seen = torch.tensor(float(len(matrix) if matrix is not None else 0), device=pl_module.device)
                classes = int(trainer.strategy.reduce(seen, reduce_op="max").item())
            if classes:
                mine = _padded(matrix, classes) if matrix is not None else None
                if mine is None:
                    mine = torch.zeros(classes, classes, dtype=torch.long, device=pl_module.device)
                matrix = trainer.strategy.reduce(mine.float(), reduce_op="sum").long()  # all ranks' shards
        writer = _writer(trainer)
        if writer is None or not trainer.is_global_zero:
            return None
        if matrix is not None and not bool(matrix.any()):
            matrix = None  # no rank counted anything (a test_step that returns no predictions): no empty figure
        # The drawing thread gets numpy and lists only: a torch op there starts a second OpenMP team, which made later
        # training steps up to 3x slower on 2 cores (benchmarks/step_loop.py).
        step, grid = trainer.fit_loop.epoch_loop._batches_that_stepped, None  # that of the epoch's scalars
        counts = matrix.cpu().numpy() if matrix is not None else None
        if self._grid is not None:
            images, preds, targets = self._grid
            grid = (images.float().mean(1).cpu().numpy(), preds.cpu().tolist(), targets.cpu().tolist())
        self._undrawn = None
        if grid is not None or counts is not None:
            now = time.monotonic()
            fitting = trainer.state.fn == TrainerFn.FITTING
            if self._drawn_at is None or now - self._drawn_at >= self.min_interval_s or not fitting:
                self._drawn_at = now
                self._draw(writer, prefix, step, grid, counts)
            else:
                self._undrawn = (writer, prefix, step, grid, counts)
        return writer

    def _draw(self, writer: Any, prefix: str, step: int, grid: tuple | None, counts: Any) -> None:
        """Draws and writes the figures in a thread of its own: training goes on meanwhile."""
        from engine.loggers import figures

        def draw() -> None:
            if grid is not None:
                summary = figures.image_summary(f"{prefix}/samples", figures.sample_grid(*grid))
                writer._get_file_writer().add_summary(summary, step)
            if counts is not None:
                summary = figures.image_summary(f"{prefix}/confusion_matrix", figures.confusion_image(counts))
                writer._get_file_writer().add_summary(summary, step)

        if self._painter is None:
            self._painter = ThreadPoolExecutor(1, thread_name_prefix="tensorboard-figures")
        self._drawing.append(self._painter.submit(draw))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.graph or self._graph_done or not trainer.is_global_zero:
            return
        self._graph_done = True
        writer = _writer(trainer)
        net = net_of(pl_module)
        if writer is None:
            return
        if not _one_process(trainer):
            log.info("TensorBoard graph: drawn for one-device runs only (tracing needs the whole net in one process)")
            return
        try:
            with warnings.catch_warnings():  # torch.jit.trace is deprecated in favour of export, but TensorBoard's
                warnings.simplefilter("ignore", FutureWarning)  # graph is drawn from it; nothing a user can change
                writer._get_file_writer().add_graph(
                    _graph(net, batch[0][:2] if isinstance(batch, (tuple, list)) else batch[:2])
                )
        except Exception as e:  # a net that cannot be traced still trains; say why it has no graph
            log.warning(f"TensorBoard graph: {type(e).__name__}: {e}")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.histograms or not trainer.is_global_zero or not _one_process(trainer):
            return
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or not self._due(trainer):
            return
        writer = _writer(trainer)
        if writer is None:
            return
        for name, param in pl_module.named_parameters():
            if param.grad is not None:
                writer.add_histogram(f"gradients/{name}", param.grad.detach().float().cpu(), trainer.global_step)
