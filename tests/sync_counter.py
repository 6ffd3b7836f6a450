"""The collectives and host syncs each rank makes per training step, and who made them: a test-only callback for
CLI runs (`+callbacks.sync._target_=sync_counter.SyncCounter`), writing into $PROBE_DIR."""

import json

import lightning.pytorch as L
import torch
from probes import probe_dir


class SyncCounter(L.Callback):
    """Counts, per training step, the collectives (torch.distributed's Python calls: DDP's gradient buckets are not
    among them) and the host syncs (.item(), .tolist(), float(), bool(), int() of a tensor) each rank makes, with
    who made them: `template` (this project's src/), `lightning`, `torchmetrics` or `other`. On a CUDA device it also
    counts what torch's sync debug mode reports: every operation that makes the host wait for the GPU, the implicit
    ones too (a blocking copy to or from the device, nonzero, a tensor's truth value), as `cuda_sync`. Writes
    $PROBE_DIR/syncs_rank<r>.json: one record per event (kind, step, origin, where)."""

    COLLECTIVES = (
        "all_reduce",
        "broadcast",
        "barrier",
        "all_gather",
        "all_gather_object",
        "broadcast_object_list",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
    )
    SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.step = -1
        self.active = False
        self._undo: list = []

    def _origin(self) -> tuple[str, str]:
        """Who called: the innermost frame of this project's src/, Lightning or torchmetrics (torch's own frames
        are looked through: they are how a call gets made, not who makes it)."""
        import traceback

        for frame in reversed(traceback.extract_stack()):  # this file's and torch's frames name no origin
            for origin, marker in (
                ("template", "/src/project/"),
                ("template", "/src/engine/"),
                ("lightning", "/lightning/"),
                ("torchmetrics", "/torchmetrics/"),
            ):
                if marker in frame.filename:
                    return origin, f"{frame.filename.split(marker)[-1]}:{frame.lineno}"
        return "other", "?"

    def _wrap(self, owner, name: str, kind: str) -> None:
        original = getattr(owner, name)
        probe = self

        def counted(*args, **kwargs):
            if probe.active:
                origin, where = probe._origin()
                probe.events.append({"kind": kind, "call": name, "step": probe.step, "origin": origin, "where": where})
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append((owner, name, original))

    def on_train_start(self, trainer, pl_module) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in self.COLLECTIVES:
            for owner in (dist, c10d):
                if hasattr(owner, name):
                    self._wrap(owner, name, "collective")
        for name in self.SYNCS:
            self._wrap(torch.Tensor, name, "sync")
        if pl_module.device.type == "cuda":
            self._watch_cuda()

    def _watch_cuda(self) -> None:
        import warnings

        original, probe = warnings.showwarning, self

        def shown(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" not in str(message):
                return original(message, category, filename, lineno, file, line)
            if probe.active:
                origin, where = probe._origin()
                probe.events.append(
                    {"kind": "cuda_sync", "call": "", "step": probe.step, "origin": origin, "where": where}
                )

        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")  # every one, not the first
        warnings.showwarning = shown
        torch.cuda.set_sync_debug_mode("warn")
        self._undo.append((warnings, "showwarning", original))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step, self.active = trainer.global_step, True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pass  # still active: the callbacks after this one, and Lightning's own end of step, are counted too

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.step = -1  # the epoch's end: checkpoints, validation metrics

    def on_validation_start(self, trainer, pl_module) -> None:
        self.active = False

    def on_validation_end(self, trainer, pl_module) -> None:
        self.active = True
        self.step = -1

    def on_train_end(self, trainer, pl_module) -> None:
        self.active = False
        if pl_module.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        for owner, name, original in self._undo:
            setattr(owner, name, original)
        (probe_dir() / f"syncs_rank{trainer.global_rank}.json").write_text(json.dumps(self.events))
