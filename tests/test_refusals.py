"""What a task raised, read from its traceback (engine.refusals): a model that does not take its data's batches
before any training step is one line naming the sizes; after a step, or outside a run's step, it is a bug and keeps
its traceback. Models and data here are a user's own (tests/user_tables.py), not the template's."""

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from user_tables import Regressor

from engine.refusals import misfit_in


class FailsAtStep(Regressor):
    """A user's regressor with a bug that shows at one training step only."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            torch.zeros(10).view(4, 3)  # shape '[4, 3]' is invalid for input of size 10
        return super().training_step(batch, batch_idx)


class RaisesItsOwn(Regressor):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("broke on purpose")


def fit(model: L.LightningModule, features: int) -> BaseException:
    rows = TensorDataset(torch.randn(16, features), torch.randn(16))
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    with pytest.raises(Exception) as caught:
        trainer.fit(model, DataLoader(rows, batch_size=4))
    return caught.value


def test_a_batch_the_model_does_not_take_is_one_line_with_its_shapes_and_the_settings_quoted():
    error = fit(Regressor(hidden=32), features=7)
    said = misfit_in(error, {"hidden": 32, "features": 10, "lr": 0.01})
    assert said is not None and "\n" not in str(said)
    assert str(said).startswith("model: Regressor does not take the data (its batch: float32 (4, 7), float32 (4,)):")
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x7 and 10x32)" in str(said)
    assert "model.hidden=32, model.features=10 appear in the message" in str(said)


def test_a_failure_after_a_training_step_keeps_its_traceback():
    assert misfit_in(fit(FailsAtStep(at=0), features=10), {}) is not None
    assert misfit_in(fit(FailsAtStep(at=2), features=10), {}) is None


class RefusesItsOptimizer(Regressor):
    def configure_optimizers(self):
        raise ValueError("Invalid learning rate: -1.0")


def test_an_error_outside_a_modules_step_or_of_another_kind_is_not_a_misfit():
    # raised by the module's own code, not torch's refusal of a size: it said the model did not take the data
    assert misfit_in(fit(RaisesItsOwn(), features=10), {}) is None
    assert misfit_in(fit(RefusesItsOptimizer(), features=10), {}) is None  # not on a batch: not the data's doing
    try:
        torch.zeros(2, 3) @ torch.zeros(4, 5)
    except RuntimeError as e:
        assert misfit_in(e, {}) is None
    assert misfit_in(KeyError("x"), {}) is None
