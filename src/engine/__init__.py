"""The engine under the template: safe checkpoints, exact resume, one-line errors, run directories, strategies,
launch, sweeps and trackers. It never imports the user's project (src/project).

The names below are its public API, what the project's code and the entry scripts import; conf/ names its
callbacks, strategies, loggers and plugins by `_target_`. Each loads on first use: `train.py --help` imports no
torch.
"""

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
