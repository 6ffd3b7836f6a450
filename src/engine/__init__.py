"""The engine under the template: checkpoints, resume, errors, run dirs, strategies, launch, sweeps, trackers.

It never imports the user's project (src/project). The names below are its public API (conf/ names the rest by
`_target_`); each loads on first use, so that `train.py --help` imports no torch."""

from typing import Any

# public name -> the module that defines it
_PUBLIC = {
    "cli": "engine.entry",
    "run": "engine.entry",
    "UserError": "engine.errors",
    "TrainRun": "engine.tasks.training",
    "EvalRun": "engine.tasks.evaluation",
    "PredictRun": "engine.tasks.prediction",
    "InputSpec": "engine.data.spec",
    "TensorDataModule": "engine.data.tensors",
    "TensorDataset": "engine.data.tensors",
    "normalize": "engine.data.tensors",
    "split": "engine.data.tensors",
    "load_image": "engine.data.images",
    "model_input": "engine.data.images",
    "ResumableLoader": "engine.data.resumable",
    "ResumableSampler": "engine.data.resumable",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
