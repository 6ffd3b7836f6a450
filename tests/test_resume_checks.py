"""What a resume checks before Lightning restores anything (engine.runs.resume): where the best file of a moved
run is, settings the restore would ignore, and checkpoint folders that hold another run's checkpoints."""

import re

import pytest

from engine.errors import UserError


def test_a_moved_run_folder_tests_the_best_checkpoint_beside_the_one_it_resumed_from(tmp_path):
    """A finished run moved elsewhere and resumed (nothing left to train) still records its best file at the old
    place: the same file beside ckpt_path is tested; with neither, one line names the way out."""
    from engine.runs.resume import best_to_test

    old, moved = tmp_path / "run" / "checkpoints", tmp_path / "moved" / "checkpoints"
    moved.mkdir(parents=True)
    (moved / "epoch_001.ckpt").write_bytes(b"best")
    recorded, resumed = str(old / "epoch_001.ckpt"), str(moved / "last.ckpt")
    assert best_to_test(recorded, resumed) == str(moved / "epoch_001.ckpt")
    assert best_to_test(str(moved / "epoch_001.ckpt"), resumed) == str(moved / "epoch_001.ckpt")
    assert best_to_test("", resumed) == "" and best_to_test(recorded, None) == recorded  # a fresh run: Lightning's
    (moved / "epoch_001.ckpt").unlink()
    with pytest.raises(UserError, match=r"names .*epoch_001.ckpt as its best checkpoint, which is not there any more"):
        best_to_test(recorded, resumed)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("model.optimizer.lr=0.05", "model.optimizer.lr=0.002, this run asks for model.optimizer.lr=0.05"),
        ("model/optimizer=sgd", "model.optimizer._target_=torch.optim.Adam, this run asks for "),
        ("model/scheduler=none", "model.scheduler={'_target_': 'torch.optim.lr_scheduler.CosineAnnealingLR'"),
    ],
)
def test_resuming_with_other_optimizer_settings_is_refused_not_ignored(make_cfg, tmp_path, override, said):
    """Lightning restores the optimizer and its schedule as saved: a new learning rate would be silently ignored
    (and recorded in the new checkpoints), another optimizer fails deep in the restore with a KeyError."""
    from omegaconf import OmegaConf

    from engine.runs.resume import check_same_model

    saved = OmegaConf.to_container(make_cfg("model=mlp"), resolve=True)
    ckpt = {"hyper_parameters": saved, "epoch": 1, "global_step": 9, "state_dict": {}, "loops": {}}
    ckpt["optimizer_states"] = [{"state": {}, "param_groups": []}]
    check_same_model("last.ckpt", ckpt, make_cfg("model=mlp", "trainer.max_epochs=9").model)  # T_max may follow
    with pytest.raises(UserError, match=re.escape(f"ckpt_path=last.ckpt was trained with {said}")):
        check_same_model("last.ckpt", ckpt, make_cfg("model=mlp", override).model)


def test_a_checkpoint_folder_shared_with_another_run_is_refused_before_it_is_overwritten(tmp_path):
    """`callbacks.*.dirpath` moved out of the run dir, to a folder that holds another run's checkpoints: this run's
    last.ckpt would silently replace that run's. A restarted job (its own files) goes on."""
    from omegaconf import OmegaConf

    from engine.runs.resume import check_output_dirs

    shared = tmp_path / "shared"
    callbacks = OmegaConf.create({"model_checkpoint": {"dirpath": str(shared)}, "last_checkpoint": {"dirpath": None}})
    check_output_dirs(tmp_path / "run", callbacks, restarted=False)  # not there yet: made at start
    shared.mkdir()
    check_output_dirs(tmp_path / "run", callbacks, restarted=False)  # empty
    for name in ("epoch_001.ckpt", "last.ckpt"):
        (shared / name).write_bytes(b"another run's")
    with pytest.raises(UserError, match=re.escape(f"callbacks.model_checkpoint.dirpath={shared} already holds")) as e:
        check_output_dirs(tmp_path / "run", callbacks, restarted=False)
    assert str(e.value).endswith(f"continue that run with ckpt_path={shared / 'last.ckpt'}")
    check_output_dirs(tmp_path / "run", callbacks, restarted=True)


def test_a_shorter_schedule_is_refused_with_what_it_would_do_and_never_stretched_to_nothing(make_cfg):
    """A run of T_max=20 resumed with trainer.max_epochs=2: the message said the schedule "would end at epoch 20
    and go up again" (what more epochs do); fewer epochs stop it before its end. Stretched to an end the checkpoint
    is already past, the run trained nothing and exited 0, testing the old best file."""
    from engine.runs.resume import schedule_length

    def saved(epoch: int, at_its_end: bool) -> dict:
        progress = {"current": {"processed": epoch + at_its_end, "completed": epoch}}
        return {"epoch": epoch, "lr_schedulers": [{"T_max": 20}], "loops": {"fit_loop": {"epoch_progress": progress}}}

    mid, end = saved(2, at_its_end=False), saved(2, at_its_end=True)  # within epoch 2, at its end
    epochs = {n: make_cfg("model=mlp", f"trainer.max_epochs={n}").model for n in (2, 3, 4, 30)}
    with pytest.raises(UserError, match="would end at epoch 20 and go up again after it"):
        schedule_length("last.ckpt", mid, epochs[30], stretch=False)
    with pytest.raises(
        UserError, match="the run would stop at epoch 4, before the restored schedule.s end at epoch 20"
    ):
        schedule_length("last.ckpt", mid, epochs[4], stretch=False)
    assert schedule_length("last.ckpt", mid, epochs[3], stretch=True) == 3  # the rest of epoch 2 still to train
    assert schedule_length("last.ckpt", end, epochs[4], stretch=True) == 4  # epoch 3 still to train
    for ckpt, n in ((mid, 2), (end, 3)):
        with pytest.raises(UserError, match=f"saved after {n} epochs: trainer.max_epochs={n} leaves nothing"):
            schedule_length("last.ckpt", ckpt, epochs[n], stretch=True)
