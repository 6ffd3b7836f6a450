"""The checkpoint callbacks' writes in the background (engine.runs.atomic_io, engine.callbacks.checkpoint):
snapshots written in order, never more than two in memory, and a failed write that ends the run in one line without
leaving last.ckpt naming a file that is not there. What the callbacks save: tests/test_checkpoint_callbacks.py; the
files' own writes: tests/test_atomic_saves.py."""

from pathlib import Path

import pytest
import torch
from user_models import LIT_AUTOENCODER_3_EPOCHS

from engine.errors import UserError


def test_checkpoints_written_in_the_background_are_snapshots_in_order_and_fail_loudly(tmp_path, monkeypatch):
    """engine.runs.atomic_io: a save of the file in_background() names is serialized at once (later changes to
    the weights are not in it) and written by the writer thread; saves and removals land in the order they were
    made; any other save (a signal handler's, meanwhile) is written at once, after the writer; a failed write is
    raised at the next wait, save or teardown, as the one-line error a synchronous one gives."""
    import pickle
    import threading

    from engine.runs import atomic_io

    writers = []
    replace = atomic_io.os.replace
    monkeypatch.setattr(
        atomic_io.os, "replace", lambda *a: (writers.append(threading.current_thread().name), replace(*a))
    )
    checkpoints = atomic_io.AtomicCheckpointIO()
    weights = {"w": torch.zeros(3)}
    old, new, last, hpc = (tmp_path / name for name in ("epoch_001.ckpt", "epoch_002.ckpt", "last.ckpt", "hpc.ckpt"))
    checkpoints.save_checkpoint(weights, old)
    weights["w"] += 1
    with checkpoints.in_background(new):
        checkpoints.save_checkpoint(weights, new)
        checkpoints.save_checkpoint(weights, hpc)  # a signal handler's save (SLURM's requeue): not in the background
    with checkpoints.in_background(old):
        checkpoints.remove_checkpoint(old)  # after the new best is on disk, never before
    with checkpoints.in_background(last):
        checkpoints.save_checkpoint(weights, last)
    weights["w"] += 1  # the next optimizer step, while the writer may still be writing
    checkpoints.wait()
    assert writers == ["MainThread", "checkpoint-writer_0", "MainThread", "checkpoint-writer_0"], writers
    assert not old.exists() and [torch.load(p)["w"].tolist() for p in (new, hpc, last)] == [[1.0] * 3] * 3
    checkpoints.save_checkpoint(weights, last)  # a save outside (a signal's) waits for the writer, then writes
    assert checkpoints.load_checkpoint(last)["w"].tolist() == [2.0] * 3
    pickle.loads(pickle.dumps(checkpoints))  # ddp_spawn pickles the plugins

    failing = Path("/proc/no/such/run/epoch_003.ckpt")  # a full or read-only disk
    with checkpoints.in_background(failing):
        checkpoints.save_checkpoint(weights, failing)
    with checkpoints.in_background(new):
        checkpoints.remove_checkpoint(new)  # the best file it was to replace: kept, since the write failed
    with pytest.raises(UserError, match=r"epoch_003.ckpt: the checkpoint could .*; nothing was written there. Make"):
        checkpoints.teardown()
    assert new.is_file()
    checkpoints.teardown()  # raised once; the writer thread is gone
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]


def test_a_failed_background_write_does_not_hide_the_error_that_ends_the_run(tmp_path, caplog):
    """Lightning tears the strategy down while a divergence or Ctrl-C is on its way out: a failed write is logged
    then, and the run ends with its own error (its message, its exit code)."""
    from engine.runs.atomic_io import AtomicCheckpointIO

    checkpoints = AtomicCheckpointIO()
    failing = Path("/proc/no/such/run/last.ckpt")
    with checkpoints.in_background(failing):
        checkpoints.save_checkpoint({"w": torch.zeros(1)}, failing)
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            checkpoints.teardown()
            raise
    assert "last.ckpt: the checkpoint could not be written" in caplog.text


def test_an_epochs_last_save_does_not_wait_for_its_best_file_but_the_next_save_does(tmp_path, monkeypatch):
    """The best file and last.ckpt are saved back to back at an epoch's end: the second is copied while the first
    is still being written; a third save waits for the first, so no more than two copies are ever in memory."""
    import threading

    from engine.runs import atomic_io

    release, write = threading.Event(), atomic_io.write_atomically

    def held(checkpoint, target):  # the best file's write takes as long as the test says
        if target.name == "best.ckpt":
            assert release.wait(30)
        write(checkpoint, target)

    monkeypatch.setattr(atomic_io, "write_atomically", held)
    checkpoints = atomic_io.AtomicCheckpointIO()
    best, last, later = (tmp_path / name for name in ("best.ckpt", "last.ckpt", "later.ckpt"))
    for path in (best, last):
        with checkpoints.in_background(path):
            checkpoints.save_checkpoint({"w": torch.zeros(2)}, path)
    assert not best.exists()  # last.ckpt's save returned while the best file was still being written
    threading.Timer(0.2, release.set).start()
    with checkpoints.in_background(later):
        checkpoints.save_checkpoint({"w": torch.zeros(2)}, later)
    assert best.is_file()  # the third save waited for the first write
    checkpoints.teardown()
    assert all(torch.load(p)["w"].tolist() == [0.0, 0.0] for p in (best, last, later))


def test_after_a_failed_best_write_last_ckpt_is_left_as_it_was_and_the_run_ends(tmp_path, monkeypatch):
    """An epoch's best file fails to write (a full disk) while its last.ckpt is being copied: last.ckpt must not be
    replaced by one naming a best file that is not on disk. The old best and the old last.ckpt stay; the error ends
    the run at last.ckpt's save when the failure is already known, else at the next save, never an epoch later."""
    import concurrent.futures
    import threading

    from engine.runs import atomic_io

    write = atomic_io.write_atomically

    def disk_full_for(name: str):
        def written(checkpoint, target):
            if target.name == name:
                raise UserError(f"{target}: the checkpoint could not be written (No space left on device)")
            write(checkpoint, target)

        return written

    for known_at_last_save in (True, False):
        run = tmp_path / str(known_at_last_save)
        run.mkdir()
        checkpoints = atomic_io.AtomicCheckpointIO()
        old_best, new_best, last, later = (run / n for n in ("epoch_0.ckpt", "epoch_1.ckpt", "last.ckpt", "e2.ckpt"))
        checkpoints.save_checkpoint({"best": old_best.name}, old_best)
        checkpoints.save_checkpoint({"best": old_best.name}, last)
        release = threading.Event()
        if known_at_last_save:
            monkeypatch.setattr(atomic_io, "write_atomically", disk_full_for(new_best.name))
        else:  # the best write fails only after last.ckpt's save has handed its copy over
            fails = disk_full_for(new_best.name)
            monkeypatch.setattr(atomic_io, "write_atomically", lambda c, t: (release.wait(30), fails(c, t)))
        with checkpoints.in_background(new_best):
            checkpoints.save_checkpoint({"best": new_best.name}, new_best)
        with checkpoints.in_background(old_best):
            checkpoints.remove_checkpoint(old_best)
        if known_at_last_save:
            assert not concurrent.futures.wait(checkpoints._pending, timeout=30).not_done
            with pytest.raises(UserError, match="epoch_1.ckpt: the checkpoint could not be written"):
                with checkpoints.in_background(last):
                    checkpoints.save_checkpoint({"best": new_best.name}, last)
        else:
            with checkpoints.in_background(last):
                checkpoints.save_checkpoint({"best": new_best.name}, last)
            release.set()
            with pytest.raises(UserError, match="epoch_1.ckpt: the checkpoint could not be written"):
                with checkpoints.in_background(later):  # the next epoch's save
                    checkpoints.save_checkpoint({"best": later.name}, later)
        checkpoints.teardown()
        assert torch.load(last)["best"] == old_best.name and old_best.is_file(), known_at_last_save
        assert sorted(p.name for p in run.iterdir()) == ["epoch_0.ckpt", "last.ckpt"]


def test_ctrl_c_while_a_save_waits_for_the_writer_still_reports_a_later_failed_write(tmp_path, monkeypatch, caplog):
    """Ctrl-C lands while a save waits for the best file's write, and the last.ckpt write after it fails on its own:
    the run ends with the KeyboardInterrupt, and teardown still logs the failed write (nothing is dropped)."""
    import signal
    import threading

    from engine.runs import atomic_io

    hold, write = threading.Event(), atomic_io.write_atomically

    def written(checkpoint, target):
        if target.name == "best.ckpt":
            assert hold.wait(30)
        if target.name == "last.ckpt":
            raise UserError(f"{target}: the checkpoint could not be written (No space left on device)")
        write(checkpoint, target)

    monkeypatch.setattr(atomic_io, "write_atomically", written)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    checkpoints = atomic_io.AtomicCheckpointIO()
    try:
        for name in ("best.ckpt", "last.ckpt", "next.ckpt"):
            if name == "next.ckpt":  # its save waits for best.ckpt's write: Ctrl-C then
                main = threading.main_thread().ident
                threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
            with checkpoints.in_background(tmp_path / name):
                try:
                    checkpoints.save_checkpoint({"w": torch.zeros(1)}, tmp_path / name)
                except KeyboardInterrupt:
                    hold.set()
                    checkpoints.teardown()  # what Lightning does while the interrupt is on its way out
    finally:
        signal.signal(signal.SIGINT, previous)
    assert hold.is_set() and "last.ckpt: the checkpoint could not be written" in caplog.text
    assert (tmp_path / "best.ckpt").is_file() and not (tmp_path / "next.ckpt").exists()


def test_failed_writes_do_not_keep_their_snapshots_in_memory(tmp_path, monkeypatch):
    """After a run ends on a failed background write, no serialized copy of the checkpoint stays referenced (an
    in-process sweep or a notebook would keep it otherwise)."""
    import gc
    import io
    import threading
    import weakref
    from types import SimpleNamespace

    from engine.runs import atomic_io

    snapshots = []

    class Tracked(io.BytesIO):
        def __init__(self) -> None:
            super().__init__()
            snapshots.append(weakref.ref(self))

    hold, write = threading.Event(), atomic_io.write_atomically
    monkeypatch.setattr(atomic_io, "io", SimpleNamespace(BytesIO=Tracked))
    monkeypatch.setattr(atomic_io, "write_atomically", lambda c, t: (hold.wait(30), write(c, t)))
    checkpoints = atomic_io.AtomicCheckpointIO()
    failing = Path("/proc/no/such/run")  # a full or read-only disk
    for name in ("best.ckpt", "last.ckpt"):  # the best file fails only once last.ckpt is handed over too
        with checkpoints.in_background(failing / name):
            checkpoints.save_checkpoint({"w": torch.zeros(1000)}, failing / name)
    hold.set()
    with pytest.raises(UserError, match="best.ckpt: the checkpoint could not be written"):
        with checkpoints.in_background(failing / "next.ckpt"):
            checkpoints.save_checkpoint({"w": torch.zeros(1000)}, failing / "next.ckpt")
    checkpoints.teardown()
    gc.collect()
    assert len(snapshots) == 2 and not [ref for ref in snapshots if ref() is not None]


def test_a_replaced_best_file_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    from engine.runs import atomic_io

    def refused(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(atomic_io.TorchCheckpointIO, "remove_checkpoint", refused)
    checkpoints = atomic_io.AtomicCheckpointIO()
    old, new = tmp_path / "epoch_000.ckpt", tmp_path / "epoch_001.ckpt"
    checkpoints.save_checkpoint({"w": torch.zeros(1)}, old)
    with checkpoints.in_background(new):
        checkpoints.save_checkpoint({"w": torch.ones(1)}, new)
    with checkpoints.in_background(old):
        checkpoints.remove_checkpoint(old)
    with pytest.raises(UserError, match=r"epoch_000.ckpt: the checkpoint a better one replaced could not be removed"):
        checkpoints.teardown()
    assert old.is_file() and torch.load(new)["w"].tolist() == [1.0]


def test_a_logger_that_uploads_checkpoints_as_saved_gets_them_written_first(tmp_path):
    """Lightning's MLflow/W&B loggers with log_model read the file when told of it: no background write then."""
    from types import SimpleNamespace

    from engine.callbacks.checkpoint import BestCheckpoint
    from engine.runs.atomic_io import AtomicCheckpointIO

    checkpoints = AtomicCheckpointIO()
    callback = BestCheckpoint(dirpath=str(tmp_path), monitor="val/acc")
    waited = []
    io = SimpleNamespace(wait=lambda: waited.append("wait"))
    decide = SimpleNamespace(checkpoint_io=io, reduce_boolean_decision=lambda x, all: waited.append(x) or x)
    trainer = SimpleNamespace(is_global_zero=True, strategy=decide)
    # the version counter asks whether a name is taken: a file still being written is
    assert callback.file_exists(tmp_path / "nothing.ckpt", trainer) is False and waited == ["wait", False]
    assert callback.state_key.startswith("ModelCheckpoint{")  # checkpoints of Lightning's class resume its state
    path = tmp_path / "epoch_001.ckpt"
    for logger, background in (
        (None, True),
        (SimpleNamespace(_log_model=False), True),
        (SimpleNamespace(_log_model="all"), False),
    ):
        trainer = SimpleNamespace(
            loggers=[logger] if logger else [], strategy=SimpleNamespace(checkpoint_io=checkpoints)
        )
        with callback._in_background(trainer, str(path)):
            assert checkpoints._in_background(path) is background


def test_a_fit_of_a_users_module_writes_its_checkpoints_in_the_background(make_cfg, monkeypatch, tmp_path):
    """Through train() with a user's LightningModule (Lightning's README autoencoder, monitored on its train_loss):
    the best and last files are written by the writer thread, replaced best files are removed, and every file is
    on disk, whole, when fit returns (the callbacks' teardown waits)."""
    import threading

    from engine.runs import atomic_io
    from project.tasks import train

    written = []
    replace = atomic_io.os.replace
    monkeypatch.setattr(
        atomic_io.os,
        "replace",
        lambda *a, **k: (written.append((threading.current_thread().name, Path(a[1]).name)), replace(*a, **k)),
    )
    cfg = make_cfg(*LIT_AUTOENCODER_3_EPOCHS)
    train(cfg)
    checkpoints = [(thread, name) for thread, name in written if name.endswith(".ckpt")]
    assert {thread for thread, _ in checkpoints} == {"checkpoint-writer_0"} and len(checkpoints) >= 4, written
    on_disk = sorted((tmp_path / "out" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in on_disk if p.name != "last.ckpt"] and len(on_disk) == 2  # the top-1 best and last.ckpt
    assert all(torch.load(p, weights_only=True)["global_step"] > 0 for p in on_disk)
