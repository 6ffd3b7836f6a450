"""trainer=pipeline's parts in one process, no ranks started: the cut, micro-batches, config, refusals, saved states."""

from functools import partial

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torchmetrics import MeanMetric
from user_models import Gated

from engine import build
from engine.errors import UserError
from engine.strategies import pipeline_checkpoints as ckpt
from engine.strategies import pipeline_stages as st
from engine.strategies.pipeline import PipelineStrategy
from project.models.classifier import ImageClassifier
from project.models.mlp import MLP


def strategy_at(rank: int, world: int, **options: object) -> PipelineStrategy:
    """A strategy as rank `rank` of `world` processes sees itself, without starting any."""
    strategy = PipelineStrategy(**options)  # type: ignore[arg-type]
    environment = LightningEnvironment()
    environment.set_world_size(world)
    environment.set_global_rank(rank)
    strategy.cluster_environment = environment
    return strategy


def classifier(**net: object) -> ImageClassifier:
    return ImageClassifier(MLP(**net), optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))  # type: ignore[arg-type]


def test_each_rank_keeps_its_stage_under_the_full_models_names() -> None:
    full = set(classifier().state_dict())
    kept = []
    for rank in (0, 1):
        module, strategy = classifier(), strategy_at(rank, 2)
        strategy.connect(module)
        strategy.parallelize(module.net)
        strategy.parallelize(module.net)  # fit, then test: the second call changes nothing
        kept.append({k for k in module.state_dict() if k.startswith("net.")})
        assert set(module.state_dict()) | strategy._foreign == full
    assert kept[0] == {"net.layers.1.weight", "net.layers.1.bias"} and not kept[0] & kept[1]
    assert kept[0] | kept[1] == {k for k in full if k.startswith("net.")}


@pytest.mark.parametrize(
    ("batch", "wanted", "schedule", "expected"),
    [
        (64, 4, "gpipe", (4, "gpipe")),
        (18, 4, "1f1b", (3, "1f1b")),  # 4 does not divide 18: 3 equal micro-batches
        (17, 4, "1f1b", (1, "gpipe")),  # a prime: one micro-batch, fewer than the 2 stages 1F1B needs
        (64, 1, "1f1b", (1, "gpipe")),
        (10, 5, "interleaved_1f1b", (2, "interleaved_1f1b")),  # 5 micro-batches are not whole rounds of 2
        (3, 8, "gpipe", (3, "gpipe")),
    ],
)
def test_a_batch_runs_as_equal_micro_batches(batch: int, wanted: int, schedule: str, expected: tuple) -> None:
    assert st.micro_batches(batch, wanted, schedule, pp_size=2) == expected


def test_the_config_builds_the_strategy_and_names_mistyped_options(make_cfg) -> None:
    trainer = build.trainer(make_cfg("trainer=pipeline", "trainer.accelerator=cpu").trainer, [], [])
    assert isinstance(trainer.strategy, PipelineStrategy) and trainer.strategy.schedule == "1f1b"
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)  # launched like ddp: sweeps, torchrun
    with pytest.raises(UserError, match="did you mean 'micro_batches'"):
        build.check(make_cfg("trainer=pipeline", "+trainer.strategy.micro_batch=2"))
    with pytest.raises(UserError, match="schedule='zero_bubble'"):
        build.trainer(make_cfg("trainer=pipeline", "trainer.strategy.schedule=zero_bubble").trainer, [], [])


def test_refusals_name_the_fix() -> None:
    with pytest.raises(UserError, match="stages_per_rank=1: interleaved_1f1b"):
        PipelineStrategy(schedule="interleaved_1f1b", stages_per_rank=1)
    strategy = PipelineStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")  # what a CUDA run with fp16_mixed would get
    with pytest.raises(UserError, match="precision 16-mixed.*bf16_mixed"):
        strategy._configure_launcher()

    def cut(net: nn.Module, world: int = 2, **options: object) -> None:
        module, strategy = classifier(), strategy_at(0, world, **options)
        module.net = net
        strategy.connect(module)
        strategy.parallelize(net)

    with pytest.raises(UserError, match="cannot cut Gated into stages: torch.fx cannot trace Gated.forward"):
        cut(Gated())
    with pytest.raises(UserError, match="8 stages .* for a net of 6 blocks"):
        cut(MLP(), world=8)
    with pytest.raises(UserError, match="lower trainer.strategy.stages_per_rank"):
        cut(MLP(), schedule="interleaved_1f1b", stages_per_rank=4)
    with pytest.raises(UserError, match="pipeline rank 0 would hold no parameters"):
        cut(MLP(), schedule="interleaved_1f1b")  # by parameters: rank 0 would get Flatten and a ReLU

    module = classifier()
    module.net.compile()  # compiles lazily: nothing runs here
    with pytest.raises(UserError, match="model.compile=false"):
        st.refuse(module)
    module, module.automatic_optimization = classifier(), False
    with pytest.raises(UserError, match="automatic optimization"):
        st.refuse(module)


def test_optimizer_states_split_by_stage_and_merge_back_to_one_devices() -> None:
    net = MLP(in_features=12, hidden=(8, 6), num_classes=3)
    order = [n for n, _ in net.named_parameters()]
    names = {id(p): n for n, p in net.named_parameters()}
    whole = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    nn.functional.cross_entropy(net(torch.randn(5, 12)), torch.tensor([0, 1, 2, 0, 1])).backward()
    whole.step()
    saved = whole.state_dict()
    stages = [list(net.parameters())[:2], list(net.parameters())[2:]]
    optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.9) for params in stages]
    layouts = [ckpt.layout(opt, names) for opt in optimizers]
    full = ckpt.global_layout(layouts, order)
    assert full == ckpt.layout(whole, names)
    for opt, mine, params in zip(optimizers, layouts, stages):
        opt.load_state_dict(ckpt.split_optimizer_state(saved, full, mine))
        for p in params:
            assert torch.equal(opt.state[p]["momentum_buffer"], whole.state[p]["momentum_buffer"])
    merged = ckpt.merge_optimizer_states([(lay, opt.state_dict()) for lay, opt in zip(layouts, optimizers)], order)
    assert merged["param_groups"] == saved["param_groups"]
    assert merged["state"].keys() == saved["state"].keys()
    for i, state in saved["state"].items():
        assert torch.equal(merged["state"][i]["momentum_buffer"], state["momentum_buffer"])


def test_metric_states_are_restored_after_the_micro_batch_runs_and_copied_to_other_stages() -> None:
    metric, copy = MeanMetric(), MeanMetric()
    metric.update(torch.tensor(1.0))
    saved = st.snapshot({"m": metric})
    metric.update(torch.tensor(5.0))  # what a per-micro-batch run of training_step would add
    st.restore({"m": metric}, saved)
    assert float(metric.compute()) == 1.0
    metric.update(torch.tensor(3.0))
    st.import_states({"m": copy}, st.export_states({"m": metric}, ["m"]), torch.device("cpu"))
    assert float(copy.compute()) == float(metric.compute()) == 2.0
