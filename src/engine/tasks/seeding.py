"""Seeding a run, or explicitly not: `seed=null` means unseeded everywhere, also after a seeded sweep job."""

import os
import random

# What Lightning's seed_everything leaves in the environment; its ddp strategies re-seed ranks from it.
_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def seed_run(seed: int | None, matmul_precision: str | None = None) -> None:
    """Also `float32_matmul_precision` on CUDA (TF32 for `high`); CPU results stay bit-exact for the equivalence
    tests."""
    import lightning.pytorch as L
    import torch

    if matmul_precision is not None and torch.cuda.is_available():
        torch.set_float32_matmul_precision(matmul_precision)

    if seed is not None:
        L.seed_everything(seed, workers=True, verbose=False)  # the config tree at start shows it
        return
    # An earlier job of this sweep process may have seeded everything: draw fresh state from the OS instead,
    # and make sure no rank or later process inherits that job's seed.
    import numpy as np

    for variable in _SEED_VARIABLES:
        os.environ.pop(variable, None)
    random.seed()
    np.random.seed()
    torch.seed()
