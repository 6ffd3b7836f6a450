"""What train.py, eval.py and predict.py run: build everything from the composed config, then let Lightning work.

Read it top to bottom: the config picks every class (`_target_:` in conf/), `instantiate` builds it, and the Trainer
fits and tests. What makes a run safe to stop, continue and compare (its own directory, the checkpoint to continue
from, the checks that the model fits the data, the one-line errors) is the engine's: `TrainRun` and its peers.
"""

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from engine import EvalRun, PredictRun, TrainRun


def train(cfg: DictConfig) -> float | None:
    """Fit, then test the best checkpoint. Returns the best `monitor.metric` (or `optimized_metric`) to sweepers."""
    run = TrainRun(cfg)  # checks the config, claims the run's directory, seeds, finds a checkpoint to continue
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c]
    loggers = [instantiate(c) for c in cfg.logger.values() if c]
    trainer = run.trainer(cfg.trainer, callbacks, loggers, model=model, datamodule=datamodule)
    if cfg.train:
        trainer.fit(model, datamodule=datamodule, ckpt_path=run.ckpt_path)
        run.fitted(trainer)  # <run>/fit_metrics.json
    if cfg.test:
        trainer.test(model, datamodule=datamodule, ckpt_path=run.checkpoint_to_test(trainer))
        run.tested(trainer)  # <run>/test_metrics.json
    return run.objective()


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test a checkpoint on the data it was trained with, or on `data=...`. Returns the test metrics."""
    run = EvalRun(cfg)  # reads the checkpoint safely and rebuilds its model from the config it stores
    datamodule = instantiate(run.data)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c]
    loggers = [instantiate(c) for c in cfg.logger.values() if c]
    trainer = run.trainer(cfg.trainer, callbacks, loggers, datamodule=datamodule)
    trainer.test(run.model, datamodule=datamodule, ckpt_path=run.ckpt_path)
    return run.tested(trainer)  # <run>/test_metrics.json


def predict(cfg: DictConfig) -> Any:
    """A checkpoint's model on its DataModule's predict_dataloader (or on `input=` images): its predict_step per
    batch, into <run>/predictions.pt and predictions.csv."""
    run = PredictRun(cfg)  # the checkpoint's model, and the data it predicts on
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c]
    trainer = run.trainer(cfg.trainer, callbacks)
    trainer.predict(run.model, datamodule=run.datamodule, return_predictions=False)
    return run.predicted(trainer)
