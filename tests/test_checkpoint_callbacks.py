"""What the checkpoint callbacks (engine.callbacks.checkpoint) save and decide on: last.ckpt made from the best file
when both hold one state, step saves, output folders, and the metrics they compare. Their writes in the background:
tests/test_checkpoint_writer.py."""

import pytest
import torch
from user_models import LIT_AUTOENCODER, LIT_AUTOENCODER_3_EPOCHS

from engine.errors import UserError


def test_the_best_checkpoint_still_saves_every_n_train_steps_when_asked(make_cfg, tmp_path):
    """BestCheckpoint skips Lightning's per-step look at the trainer unless every_n_train_steps (or
    train_time_interval) asks for saves within epochs: then they are made, for a user's module too."""
    from project.tasks import train

    cfg = make_cfg(
        *LIT_AUTOENCODER,
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=4",
        "+callbacks.model_checkpoint.every_n_train_steps=2",
        "callbacks.model_checkpoint.save_top_k=-1",
        "callbacks.model_checkpoint.filename='step_{step}'",
        "test=false",
    )
    train(cfg)
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*.ckpt"))
    assert saved == ["step_2.ckpt", "step_4.ckpt"], saved


@pytest.mark.parametrize("links", [True, False])
def test_an_epochs_best_file_and_last_ckpt_are_collected_and_serialized_once(make_cfg, monkeypatch, tmp_path, links):
    """An epoch whose checkpoint is the best so far saves the same state twice, as its best file and as last.ckpt,
    one callback right after the other. It is collected and serialized once (the MLP's pair holds the training
    thread 1.3 ms instead of 2.4: benchmarks/per_call.py), and last.ckpt is a hard link to the best file, or a copy of
    it where the filesystem has no links. A user's module, 3 epochs."""
    import errno

    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from engine.runs import atomic_io
    from project.tasks import train

    dumps = []
    dump = _CheckpointConnector.dump_checkpoint
    monkeypatch.setattr(_CheckpointConnector, "dump_checkpoint", lambda self, *a: (dumps.append(1), dump(self, *a))[1])
    if not links:
        monkeypatch.setattr(atomic_io.os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    cfg = make_cfg(*LIT_AUTOENCODER_3_EPOCHS)
    train(cfg)
    folder = tmp_path / "out" / "checkpoints"
    (best,) = [p for p in folder.glob("*.ckpt") if p.name != "last.ckpt"]
    last = folder / "last.ckpt"
    assert len(dumps) == 3  # one an epoch: the best file's, and last.ckpt's where the best was not saved
    assert best.name == "epoch_002.ckpt" and last.read_bytes() == best.read_bytes()
    assert last.samefile(best) == links
    state = torch.load(last, weights_only=False)
    assert (state["epoch"], state["global_step"]) == (2, 12)
    assert not list(folder.glob(".*"))  # no temporary file left


def test_a_file_url_for_a_folder_is_one_line_naming_the_path_and_nothing_is_written(make_cfg, tmp_path, monkeypatch):
    """Lightning takes a `file://` dirpath for a path relative to the working directory: the files went to
    ./file:/<path>, where no check looked for another run's checkpoints. A `file:` URL is refused at start."""
    from project.tasks import train

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "elsewhere" / "ckpts"
    for url in (f"file://{folder}", f"file:{folder}", f"file://localhost{folder}"):
        for key in ("callbacks.model_checkpoint.dirpath", "callbacks.last_checkpoint.dirpath"):
            cfg = make_cfg(*LIT_AUTOENCODER_3_EPOCHS, "trainer.max_epochs=1", f"{key}={url}")
            with pytest.raises(UserError) as refused:
                train(cfg)
            assert str(refused.value) == f"{key}={url}: a file URL; pass the folder's path itself ({folder})"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not list((tmp_path / "out").iterdir())


def test_the_metrics_a_checkpoint_callback_decides_on_are_cloned_not_deep_copied(make_cfg, monkeypatch):
    """Both checkpoint callbacks copy the logged metrics before every save decision (twice an epoch), so that a
    metric changed later does not change the score they keep. Lightning deep-copies each tensor, about
    eight times a clone's cost for a classifier's eight metrics (benchmarks/per_call.py); a clone is as independent.
    Same keys, values and dtypes as Lightning's, for a user's module fitted for real."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from engine.callbacks.checkpoint import BestCheckpoint, LastCheckpoint
    from project.tasks import train

    seen = []

    class Keep(BestCheckpoint):
        def on_train_end(self, trainer, pl_module):
            seen.append(trainer)
            super().on_train_end(trainer, pl_module)

    cfg = make_cfg(*LIT_AUTOENCODER_3_EPOCHS)
    cfg.callbacks.model_checkpoint._target_ = f"{__name__}.Keep"
    monkeypatch.setitem(globals(), "Keep", Keep)
    train(cfg)
    (trainer,) = seen
    trainer.callback_metrics["extra"] = torch.tensor([1.5, 2.5], dtype=torch.float64)
    lightnings = ModelCheckpoint._monitor_candidates(ModelCheckpoint(), trainer)
    deep_copies, deepcopy = [], torch.Tensor.__deepcopy__
    monkeypatch.setattr(torch.Tensor, "__deepcopy__", lambda self, memo: deep_copies.append(1) or deepcopy(self, memo))
    for callback in (BestCheckpoint(), LastCheckpoint(dirpath="unused")):
        mine = callback._monitor_candidates(trainer)
        assert list(mine) == list(lightnings)
        for key, value in lightnings.items():
            assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), key
            assert mine[key] is not trainer.callback_metrics.get(key)
        trainer.callback_metrics["extra"].add_(1)  # a metric changed in place later leaves the copy as it was
        assert torch.equal(mine["extra"], lightnings["extra"])
        trainer.callback_metrics["extra"].sub_(1)
    assert not deep_copies
