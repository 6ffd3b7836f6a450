"""A disk that fills up or turns read-only mid-run, and errors that lead back into themselves: the run ends in one
line with exit 2, never a hang or a traceback from a writer's thread."""

import time

import pytest


def test_an_error_whose_chain_leads_back_to_itself_ends_the_run(cli, tmp_path):
    """Lightning's "you tried to log ..." ValueError is caused by the logger's OSError, whose context is that same
    ValueError when the logger fails again while it is reported (TensorBoard on a disk made read-only mid-run): the
    search for a UserError in the chain went round it at 100% CPU, and the run never ended. Checked in a thread, so a
    regression fails here rather than hanging the suite."""
    import threading

    from engine.errors import UserError, user_error_in

    logged = ValueError("you tried to log a value")
    disk = OSError(30, "Read-only file system")
    logged.__cause__, disk.__context__ = disk, logged
    found: list[object] = []
    search = threading.Thread(target=lambda: found.append(user_error_in(logged)), daemon=True)
    search.start()
    search.join(timeout=10)
    assert found == [None]
    wrapped = RuntimeError("hydra")
    wrapped.__cause__, mine = logged, UserError("fix it")
    disk.__context__ = mine  # the loop broken by a UserError further down: found
    assert user_error_in(wrapped) is mine


def _the_one_error_line_of_a_run_with(cli, probe: str, **env: str) -> str:
    """A 2-epoch tiny run with `probes.<probe>` added: exit 2 and one line on stderr, which is returned."""
    proc = cli(
        "train.py",
        "trainer.max_epochs=2",
        f"+callbacks.disk._target_=probes.{probe}",
        check=False,
        env={"PROJECT_PROFILE": "tiny", **env},
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.slow
def test_a_disk_that_turns_read_only_mid_run_is_one_line_and_keeps_what_was_written(cli, tmp_path):
    """A logger's or a data set's write that a full or read-only disk stops ends the run like the template's own
    writes do: one line naming the file and the fix, exit 2, the checkpoints written before it left in place."""
    line = _the_one_error_line_of_a_run_with(cli, "DiskGoneReadOnlyAt", READ_ONLY_AT_EPOCH="1")
    assert line.startswith("error: ") and line.endswith(
        "events.out: could not be written (Read-only file system); make room, or write elsewhere: paths.output_dir"
    )
    assert list(tmp_path.glob("logs/train/runs/*/checkpoints/last.ckpt"))


@pytest.mark.slow
def test_a_full_disk_in_a_checkpoint_write_keeps_the_templates_own_words(cli, tmp_path):
    """The checkpoint writer's message (which file, that the previous one is unchanged, where else to write) is the
    one line, not the generic one for a disk error found in its cause."""
    line = _the_one_error_line_of_a_run_with(cli, "DiskFullInCheckpointWritesAt", DISK_FULL_AT_EPOCH="1")
    assert "checkpoints/" in line and ".ckpt: the checkpoint could not be written (No space left" in line, line


def test_a_disk_error_in_the_event_writer_thread_is_left_to_the_runs_one_line(tmp_path, monkeypatch):
    """TensorBoard's writer thread keeps a failed write's error and raises it again at the training thread's next
    write (where the run ends in one line: above); the thread's own traceback is no longer printed first.
    Other errors of that thread still are."""
    import errno
    import threading

    from tensorboard.summary.writer import record_writer

    from engine.loggers.tensorboard import TensorBoardLogger

    printed: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))  # prints, as Python's
    logger = TensorBoardLogger(str(tmp_path))
    logger.experiment.add_scalar("a", 1.0, 0)
    logger.experiment.flush()

    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system", "events.out")

    monkeypatch.setattr(record_writer.RecordWriter, "write", read_only)
    deadline = time.time() + 10
    with pytest.raises(OSError, match="Read-only file system"):
        while time.time() < deadline:  # the thread's error comes back at one of the next writes
            logger.experiment.add_scalar("a", 2.0, 1)
            logger.experiment.flush()
            time.sleep(0.05)
    assert printed == []
    other = threading.Thread(target=lambda: 1 / 0)
    other.start()
    other.join()
    assert [type(e) for e in printed] == [ZeroDivisionError]


def test_the_line_that_ends_a_run_goes_to_its_log_file_only_while_it_runs_and_never_fails_there(tmp_path, capfd):
    """errors.say: the line on stderr, and in the run's log file while the task runs (not the log of a sweep job
    that ran before in the process); a log file on a full disk (what the line may be about) or one whose run dir a
    refused run removed leaves the line on stderr alone, with no logging error printed after it."""
    import contextlib
    import logging
    import shutil

    from engine.errors import run_log, say

    root = logging.getLogger()
    job = tmp_path / "job"
    job.mkdir()
    handlers = [logging.FileHandler(job / "train.log"), logging.FileHandler("/dev/full")]
    gone = tmp_path / "gone"
    gone.mkdir()
    handlers.append(logging.FileHandler(gone / "train.log"))
    shutil.rmtree(gone)
    for handler in handlers:
        handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
    try:
        say("error: before the task")
        with run_log():
            say("stopped by SIGTERM at epoch 0, step 5: saved last.ckpt")
        say("error: 1 of 2 sweep jobs failed")
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            with contextlib.suppress(OSError):  # /dev/full's buffer, flushed when it closes
                handler.close()
    assert (
        job / "train.log"
    ).read_text() == "[project][ERROR] - stopped by SIGTERM at epoch 0, step 5: saved last.ckpt\n"
    assert not gone.exists()
    assert capfd.readouterr().err.splitlines() == [
        "error: before the task",
        "stopped by SIGTERM at epoch 0, step 5: saved last.ckpt",
        "error: 1 of 2 sweep jobs failed",
    ]
