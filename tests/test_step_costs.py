"""What the template adds to a training step: no collective and no host sync of its own, except the one agreement
every checks.every_n_steps steps (engine.callbacks.checks). Counted on both ranks of a real ddp run by
tests/sync_counter.py's SyncCounter, which wraps torch.distributed's calls and the tensor methods that read a value back
to the host, and names who made each call (this project's src/, Lightning, torchmetrics)."""

import collections
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_dirs
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from user_models import LIT_AUTOENCODER

pytestmark = pytest.mark.slow

EVERY = 5


class Ops(TorchDispatchMode):
    """The tensor ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_ddp_step_makes_no_collective_and_no_host_sync_of_the_templates_between_agreements(cli, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    cli(
        "train.py",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "model=mlp",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=23",
        "test=false",
        f"callbacks.run_checks.every_n_steps={EVERY}",
        "+callbacks.sync._target_=sync_counter.SyncCounter",
        env={"PROBE_DIR": str(probe)},
    )
    (run,) = run_dirs(tmp_path / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "ok"
    for rank in (0, 1):
        events = json.loads((probe / f"syncs_rank{rank}.json").read_text())
        in_steps = [e for e in events if e["step"] >= 0]
        assert {e["step"] for e in in_steps} >= set(range(20))  # the probe saw the steps
        ours = [e for e in in_steps if e["origin"] == "template"]
        # the only ones: the agreement at the end of every EVERY-th step (the probe names a step by its start)
        assert {e["step"] for e in ours} == {s for s in range(23) if (s + 1) % EVERY == 0}, ours
        per_step = collections.Counter((e["step"], e["kind"]) for e in ours)
        assert set(per_step.values()) == {1}  # one collective and one host sync each time
        # Lightning's own per-step broadcast of rank 0's SIGTERM flag is off: signals are agreed as above
        assert not [e for e in in_steps if e["kind"] == "collective" and e["origin"] == "lightning"]


def test_a_save_right_after_an_agreement_does_not_agree_again(make_cfg, monkeypatch):
    """Before a checkpoint the ranks agree the run is sound (engine.callbacks.checks), unless they just did on the
    same weights and losses: at an epoch's end they agree once (signals too), and the best and last saves right
    after do not agree again (they did, 3 agreements in all). A save after more steps agrees again."""
    from engine.callbacks.checks import RunChecks
    from project.tasks import train

    agreed = collections.Counter()
    original = RunChecks._agree

    def counted(self, trainer, pl_module, signals, **kwargs):
        agreed[trainer.global_step] += 1
        return original(self, trainer, pl_module, signals, **kwargs)

    monkeypatch.setattr(RunChecks, "_agree", counted)
    steps = 4
    cfg = make_cfg(
        "model=mlp",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=2",
        f"+trainer.limit_train_batches={steps}",
        "callbacks.run_checks.every_n_steps=1000",
        "callbacks.last_checkpoint.every_n_steps=3",
        "test=false",
    )
    train(cfg)
    # steps 3 and 6: last.ckpt's step saves; 4 and 8: the epoch ends (the best and last saves after them are free);
    # 8 again: the end of fit
    assert dict(agreed) == {3: 1, 4: 1, 6: 1, 8: 2}


def test_weights_changed_in_place_since_the_agreement_are_agreed_on_again():
    """A hook that rescales the weights between the epoch end's agreement and last.ckpt's save (a module's own
    on_train_epoch_end runs between the two when there is no validation) gets them checked again."""
    from types import SimpleNamespace

    import torch

    from engine.callbacks.checks import RunChecks

    checks, module = RunChecks(every_n_steps=1000), torch.nn.Linear(2, 1)
    trainer = SimpleNamespace(global_step=5, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert not checks._agreed_on_this(trainer, module)  # no agreement yet
    checks._agree(trainer, module, signals=False)
    assert checks._agreed_on_this(trainer, module)
    with torch.no_grad():
        module.weight.mul_(2)
    assert not checks._agreed_on_this(trainer, module)


def test_a_steps_checks_cost_two_tensor_ops():
    """Each tensor op a step adds costs it about 5 µs inside a fit (3-6 times a bare loop's figure: the step's own
    work has the caches), on steps of 2-3 ms (benchmarks/step_loop.py's MLP). Between agreements the checks detach
    the step's float32 loss and add it to their sum (they were 4 ops). An fp16 loss is still summed as float32 (its
    own sum would overflow)."""
    from types import SimpleNamespace

    import torch

    from engine.callbacks.checks import RunChecks

    checks = RunChecks(every_n_steps=20)
    trainer = SimpleNamespace(global_step=3)
    weight = torch.ones((), requires_grad=True)
    checks.on_train_batch_end(trainer, None, weight * 2, None, 0)
    with Ops() as step:
        checks.on_train_batch_end(trainer, None, weight * 3, None, 1)  # the ops of the multiplication are not ours
    assert [op for op in step.ops if op != "mul"] == ["detach", "add"]
    assert float(checks._losses) == 5.0
    checks.on_train_batch_end(trainer, None, torch.tensor(60000.0, dtype=torch.float16), None, 2)
    assert checks._losses.dtype == torch.float32 and float(checks._losses) == 60005.0


def one_process_trainer(step: int, root: Path) -> Any:
    """What RunChecks reads of a one-process trainer, at optimizer step `step`, mid-epoch; it writes in `root`."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        global_step=step,
        current_epoch=0,
        default_root_dir=str(root),
        is_global_zero=True,
        callback_metrics={},
        checkpoint_callbacks=[],
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(is_last_batch=False))),
    )


def test_an_agreement_in_one_process_costs_the_same_few_tensor_ops_whatever_the_nets_size(tmp_path):
    """An agreement (every checks.every_n_steps steps and at each epoch's end) was 16 tensor ops, plus a detach per
    weight (62 for a ResNet-18), each op several µs inside a fit. In one process it now reads the numbers back as
    they are and checks them on the host: the norms, their sum, and one stack to read. What it finds is unchanged:
    a loss or a weight that is not finite, and a signal."""

    import torch
    from user_models import ResidualNet

    from engine.callbacks.checks import DivergedError, RunChecks

    def agreement(net: torch.nn.Module, loss: float = 1.0, signum: int = 0, weight: float | None = None) -> RunChecks:
        """A first agreement at step 20 on a sound run, then at step 40 the one counted: after a step whose loss was
        `loss`, with a signal `signum` recorded, and a weight set to `weight`."""
        checks = RunChecks(every_n_steps=20)
        trainer = one_process_trainer(step=20, root=tmp_path)
        checks.on_train_batch_end(trainer, net, torch.tensor(0.5), None, 0)  # an agreement: step 20
        assert checks._agreed_at == 20 and checks._last_finite == 0.5
        trainer.global_step = 39
        checks.on_train_batch_end(trainer, net, torch.tensor(loss), None, 1)  # no agreement at step 39
        checks.signum, trainer.global_step = signum, 40
        if weight is not None:
            with torch.no_grad():
                next(net.parameters()).view(-1)[0] = weight
        stopped = []
        checks._stop = lambda trainer, signum: stopped.append(signum)
        with Ops() as agreed:
            checks._agree(trainer, net, signals=True)
        assert stopped == ([signum] if signum else [])
        checks.ops = agreed.ops
        return checks

    small, large = torch.nn.Linear(3, 2), ResidualNet()
    assert len(list(large.parameters())) > 10
    ops = ["_foreach_norm", "stack", "sum", "stack"]
    assert agreement(small).ops == agreement(large).ops == agreement(large, signum=15).ops == ops
    sound = agreement(large, loss=0.25)
    assert (sound._agreed_at, sound._last_finite) == (40, 0.25)  # where the run was last known sound, and its loss
    for loss in (float("nan"), float("inf")):
        with pytest.raises(DivergedError, match="between steps 20 and 40: the loss stopped being finite"):
            agreement(large, loss=loss)
    for weight in (float("nan"), float("-inf")):  # the step's own loss was finite: the latest one known
        with pytest.raises(DivergedError, match=r"between steps 20 and 40: the weights .* \(last finite loss: 1\)"):
            agreement(ResidualNet(), weight=weight)


def test_a_divergence_before_any_check_passed_names_no_last_finite_loss(tmp_path):
    """The losses between agreements stay on the device: before the first agreement no finite loss is known, and the
    message said "last finite loss: none yet", as if no step had had one."""

    import torch

    from engine.callbacks.checks import DivergedError, RunChecks

    checks = RunChecks(every_n_steps=20)
    trainer = one_process_trainer(step=20, root=tmp_path)
    net = torch.nn.Linear(3, 2)
    trainer.global_step = 0
    checks._agree(trainer, net, signals=True)  # the one at the start of training (every rank's, under ddp)
    trainer.global_step = 20
    with pytest.raises(DivergedError) as stopped:
        checks.on_train_batch_end(trainer, net, torch.tensor(float("nan")), None, 19)
    assert str(stopped.value).startswith(
        "diverged in epoch 0, between steps 0 and 20: the loss stopped being finite; lower the learning rate"
    )
    assert json.loads((tmp_path / "fit_metrics.json").read_text()) == {"status": "diverged"}  # where it is found


def test_finite_fp16_weights_whose_norm_fp16_cannot_hold_are_not_a_divergence():
    """The weights' check sums their norms: an fp16 norm above 65504 was inf, and a run with sound fp16 weights
    (`trainer.precision=16-true`) stopped as diverged. The norms are taken in float32."""
    from types import SimpleNamespace

    import torch

    from engine.callbacks.checks import RunChecks

    checks, module = RunChecks(every_n_steps=1000), torch.nn.Linear(1000, 100).half()
    with torch.no_grad():
        module.weight.fill_(1000.0)  # each finite; the norm is 1000 * sqrt(100,000), about 316,000
    trainer = SimpleNamespace(global_step=5, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    checks._agree(trainer, module, signals=False)
    assert checks._agreed_at == 5


class NvmlCount(Callback):
    """Counts NVML lookups during training (NVML_LOOKS)."""

    def on_train_start(self, trainer, pl_module):
        import torch

        self.original = torch.cuda._raw_device_count_nvml
        torch.cuda._raw_device_count_nvml = lambda: NVML_LOOKS.append(1) or self.original()

    def on_train_end(self, trainer, pl_module):
        import torch

        torch.cuda._raw_device_count_nvml = self.original


NVML_LOOKS: list[int] = []


def test_on_a_machine_without_a_gpu_an_optimizer_step_does_not_look_for_nvml(make_cfg):
    """Lightning makes every torch.cuda.is_available() ask NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1, set when it is
    imported), and torch's optimizers ask on every step: without a GPU nothing caches the answer, and each step tried
    to load the NVML library again (40-200 µs a step here). A user's own LightningModule, fitted through train()."""
    import torch

    from project.tasks import train

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible: the NVML check answers once CUDA is initialized")
    NVML_LOOKS.clear()
    cfg = make_cfg(
        *LIT_AUTOENCODER,
        "+callbacks.nvml_count._target_=test_step_costs.NvmlCount",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=6",
        "test=false",
    )
    train(cfg)
    assert NVML_LOOKS == []
