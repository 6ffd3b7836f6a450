"""Checkpoints written so that a kill during a save never leaves a torn file where a good one was.

Lightning writes a single-file checkpoint to a temporary file in $TMPDIR and moves it into place, without
fsync: when /tmp is another filesystem the move is a copy that a kill can cut, and after a power loss the
renamed file may be empty. Here the temporary file sits in the checkpoint's own directory (hidden, not
`*.ckpt`, so no glob takes it for a checkpoint), is fsynced, renamed over the old one, and the directory is
fsynced. Sharded checkpoints are swapped in whole: project.strategies.fsdp.
"""

import os
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Local paths: temp file beside the target, fsync, rename, fsync the directory. Others: Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path) or storage_options is not None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        import torch

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.parent / f".{target.name}.partial-{os.getpid()}"
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
            fsync_dir(target.parent)
        finally:
            partial.unlink(missing_ok=True)
