"""Parallelism is a speed/memory knob, not a change of the experiment: for one seed and one global batch,
single device, ddp (2 processes), fsdp (2 processes) and dp (2 replicas) take the same steps.

The rule they rely on: global batch = data.batch_size x devices x num_nodes for ddp/fsdp (each process
loads its own batch; gradients are averaged), data.batch_size itself for dp (one batch split across
replicas); the learning rate stays the same. Shuffling stays on: one seeded permutation per epoch, cut into
the ranks' shards, gives every setup the same global batches. What breaks the equality, and is left out
here: dropout (each process or replica draws its own masks) and BatchNorm (statistics per process or
replica, unless sync BatchNorm on GPUs), and floating-point reduction order beyond fp32's 1e-5.
"""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS = 64, 6
COMMON = [
    "seed=0",
    "model=mlp",
    "model.net.dropout=0.0",
    "model/optimizer=sgd",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    f"+trainer.limit_train_batches={STEPS}",
    "+trainer.limit_val_batches=0",
    "callbacks=none",
    "+callbacks.probe._target_=probes.EquivalenceProbe",
    "logger=none",
    "test=false",
]
SETUPS = {
    "single": ["trainer.devices=1", f"data.batch_size={GLOBAL_BATCH}"],
    "ddp": ["trainer=ddp", "trainer.devices=2", f"data.batch_size={GLOBAL_BATCH // 2}"],
    "fsdp": ["trainer=fsdp", "trainer.devices=2", f"data.batch_size={GLOBAL_BATCH // 2}"],
    # dp's replica logic on CPU: the same strategy code, replicas simulated (see engine.strategies.dp)
    "dp": [
        "trainer.devices=2",
        f"data.batch_size={GLOBAL_BATCH}",
        "trainer.strategy={_target_:engine.strategies.dp.DataParallelStrategy,"
        "ops:{_target_:engine.strategies.dp.simulated_ops}}",
    ],
}


# A net written the way users write it (tests/user_models.py): a stem, repeated residual blocks (fsdp's units), a
# skip connection, a head; no BatchNorm, whose statistics are per process.
RESIDUAL = ["~model.net", "+model.net._target_=user_models.ResidualNet"]


def train(cli, tmp_path: Path, name: str, *net: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    probe = tmp_path / name
    probe.mkdir()
    cli("train.py", *COMMON, *net, *SETUPS[name], env={"PROBE_DIR": str(probe)}, cwd=tmp_path / name)
    return json.loads((probe / "losses.json").read_text()), torch.load(probe / "weights.pt", weights_only=True)


@pytest.mark.parametrize(
    ("net", "strategies"), [([], ("ddp", "fsdp", "dp")), (RESIDUAL, ("fsdp",))], ids=["mlp", "residual net"]
)
def test_every_strategy_takes_the_same_steps_as_one_device(cli, tmp_path, net, strategies):
    single_losses, single_weights = train(cli, tmp_path, "single", *net)
    assert len(single_losses) == STEPS and single_losses[-1] < single_losses[0]
    for name in strategies:
        losses, weights = train(cli, tmp_path, name, *net)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(single_losses), atol=1e-5, rtol=0, msg=lambda m: f"{name} losses: {m}"
        )
        assert weights.keys() == single_weights.keys()
        for key, value in single_weights.items():
            torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{name} {key}: {m}")
