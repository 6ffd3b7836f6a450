"""Cutting nets into stages and choosing FSDP units: what pipe, pipeline and fsdp share
(engine.strategies.split, engine.strategies.parallelize), on the template's nets and on nets written the way
users write them (tests/user_models.py): a tutorial CNN, a residual net, a torchvision factory."""

import pytest
import torch
import torchvision
from torch import nn
from user_models import GatedNet, ResidualNet, TutorialCNN

from engine.errors import UserError
from engine.strategies import parallelize, split
from engine.strategies.parallelize import _cut, balance, fsdp_units, plan_stages
from project.models.lenet import LeNet
from project.models.mlp import MLP
from project.models.resnet import ResNet18
from project.models.tiny_cnn import TinyCNN

NETS = {
    "lenet": (LeNet, 1),
    "mlp": (MLP, 1),
    "resnet18": (ResNet18, 1),
    "tiny_cnn": (TinyCNN, 1),
    "tutorial_cnn": (TutorialCNN, 1),
    "residual": (lambda: ResidualNet(dropout=0.5), 1),
    "torchvision_resnet18": (lambda: torchvision.models.resnet18(num_classes=10), 3),
}


@pytest.mark.parametrize("name", NETS)
@pytest.mark.parametrize("stages", [2, 3])
def test_the_stages_compute_what_the_net_computes_and_keep_its_layers_and_names(name, stages):
    make, channels = NETS[name]
    torch.manual_seed(0)
    net = make()
    plan = plan_stages(net, stages, None)
    assert len(plan.train) == len(plan.eval) == stages
    x = torch.randn(4, channels, 28, 28)
    for training in (False, True):
        net.train(training)
        torch.manual_seed(1)
        whole = net(x)
        torch.manual_seed(1)  # the same dropout masks: the stages draw them in the net's order
        torch.testing.assert_close(split.run(plan.for_mode(training), x), whole, rtol=0, atol=0)
    # the net's own tensors under the net's own names, each in exactly one stage
    named = {k: v for stage in plan.train for k, v in stage.state_dict(keep_vars=True).items()}
    net_state = net.state_dict(keep_vars=True)
    assert named.keys() <= net_state.keys() and all(named[k] is net_state[k] for k in named)
    assert {k for k, v in net.named_parameters()} <= named.keys()


def test_a_net_whose_forward_reads_self_training_gets_a_trace_per_mode():
    plan = plan_stages(ResidualNet(dropout=0.5), 2, None)
    assert plan.train is not plan.eval and len(plan.eval) == 2  # F.dropout(x, p, training=self.training)
    plan = plan_stages(TutorialCNN(), 2, None)
    assert plan.train is plan.eval  # its layers follow the mode themselves: one trace serves both


def test_torchvision_resnet_is_cut_where_the_model_parallel_tutorial_cuts_it():
    net = torchvision.models.resnet18(num_classes=10)
    plan = plan_stages(net, 2, ["layer3"])
    first = {str(n.target).split(".")[0] for n in plan.train[0].graph.nodes if n.op == "call_module"}
    second = {str(n.target).split(".")[0] for n in plan.train[1].graph.nodes if n.op == "call_module"}
    assert first == {"conv1", "bn1", "relu", "maxpool", "layer1", "layer2"}
    assert second == {"layer3", "layer4", "avgpool", "fc"}
    plan = plan_stages(net, 4, ["layer2", "layer3", "layer4.1"])  # any module, in call order: 4 stages
    assert [len(s.graph.nodes) > 0 for s in plan.train] == [True] * 4
    blocks = [b.name for b in plan.blocks]
    assert blocks[:5] == ["conv1", "bn1", "relu", "maxpool", "layer1.0"] and blocks[-2:] == ["avgpool", "fc"]


def test_a_skip_connection_over_a_cut_passes_through_the_stages_between():
    net = ResidualNet(depth=3).eval()
    plan = plan_stages(net, 3, ["blocks.1", "blocks.2"])
    x = torch.randn(2, 1, 28, 28)
    out0 = plan.eval[0](x)
    assert isinstance(out0, tuple) and len(out0) == 2  # the block's output and the skip
    torch.testing.assert_close(split.run(plan.eval, x), net(x), rtol=0, atol=0)


def test_the_tutorial_cnn_calls_its_pooling_layer_twice_and_either_call_can_start_a_stage():
    names = [b.name for b in plan_stages(TutorialCNN(), 2, None).blocks]
    assert names == ["conv1", "pool", "conv2", "bn", "pool@1", "fc1", "fc2", "fc3"]
    net = TutorialCNN().eval()
    x = torch.randn(2, 1, 28, 28)
    for point in ("pool@1", "conv2", "fc2"):
        torch.testing.assert_close(split.run(plan_stages(net, 2, [point]).eval, x), net(x), rtol=0, atol=0)


def test_bad_split_points_are_refused_in_one_line_naming_the_choices():
    net = TutorialCNN()
    with pytest.raises(
        UserError, match=r"calls no module named 'layer3' in its forward; its blocks in call order: conv1, pool"
    ):
        plan_stages(net, 2, ["layer3"])
    with pytest.raises(UserError, match=r"split_points=\['fc1', 'conv2'\]: give modules in the order the forward"):
        plan_stages(net, 3, ["fc1", "conv2"])
    with pytest.raises(UserError, match="1 cut\\(s\\) make 2 stages, and this run has 3"):
        plan_stages(net, 3, ["conv2"])
    with pytest.raises(UserError, match="each after the start"):
        plan_stages(net, 2, ["conv1"])


def test_an_untraceable_forward_is_named_with_its_line_and_the_way_out():
    with pytest.raises(UserError) as error:
        plan_stages(GatedNet(), 2, None)
    message = str(error.value)
    assert "torch.fx cannot trace gated (Gated)" in message and "`if x.mean() > 0:`" in message
    assert "trainer.strategy.leaves=[Gated]" in message and "\n" not in message
    x = torch.randn(2, 1, 8, 8)
    net = GatedNet().eval()  # kept whole, the untraceable part: now the net cuts
    plan = plan_stages(net, 2, None, leaves=["Gated"])
    torch.testing.assert_close(split.run(plan.eval, x), net(x), rtol=0, atol=0)


def test_tied_weights_across_a_cut_are_refused():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(UserError, match="used by stages 0 and 1 \\(shared weights\\)"):
        plan_stages(Tied(), 2, ["b"])


def test_the_cut_minimises_the_costliest_stage():
    assert _cut([1, 1, 1, 1], 2) == [2, 2]
    assert _cut([10, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert _cut([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17: no cut does better than 17
    assert _cut([5], 1) == [1]


def test_balance_by_parameters_by_hand_and_by_time():
    found = plan_stages(MLP(hidden=(256, 128)), 2, None).blocks  # Flatten, Linear(784,256), ReLU, ..., Linear
    assert len(found) == 6
    assert balance(found, 2) == [2, 4]  # the 200k-parameter first layer alone against the rest
    assert balance(found, 2, [3, 3]) == [3, 3]
    with pytest.raises(UserError, match=r"balance=\[2, 2\]: give 2 numbers .* add up to the net's 6 blocks"):
        balance(found, 2, [2, 2])
    with pytest.raises(UserError, match="7 stages for a net of 6 blocks"):
        balance(found, 7)
    slow = nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1), nn.Flatten(), nn.ReLU())
    timed = plan_stages(slow, 2, None, "time", sample=torch.randn(8, 1, 28, 28))
    assert timed.names in (["1"], ["2"])  # the slow convolution gets a stage of its own (with what is cheap)
    with pytest.raises(UserError, match="balance=time needs an example input"):
        plan_stages(slow, 2, None, "time")


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: torchvision.models.resnet50(), ["Bottleneck"] * 16),  # the repeated block, not ~160 layers
        (ResNet18, ["BasicBlock"] * 8),
        (lambda: ResidualNet(depth=4), ["ResidualBlock"] * 4),
        (TutorialCNN, ["Conv2d", "Conv2d", "BatchNorm2d", "Linear", "Linear", "Linear"]),  # no repeated class
        (LeNet, ["Conv2d", "BatchNorm2d", "Conv2d", "BatchNorm2d", "Linear", "Linear"]),
    ],
    ids=["torchvision_resnet50", "resnet18", "residual", "tutorial_cnn", "lenet"],
)
def test_fsdp_units_are_the_nets_repeated_block(make, expected):
    assert [type(m).__name__ for _, m in fsdp_units(make())] == expected


def test_fsdp_units_from_config_by_class_or_module_name():
    net = torchvision.models.resnet18()
    assert [p for p, _ in fsdp_units(net, ["layer1", "layer4"])] == ["layer1", "layer4"]
    assert len(fsdp_units(net, ["torchvision.models.resnet.BasicBlock"])) == 8
    with pytest.raises(UserError, match="no module of ResNet is named or of class Bottleneck; its classes"):
        fsdp_units(net, ["Bottleneck"])


def test_every_fsdp_unit_chosen_is_sharded_and_the_rest_with_the_net(tmp_path):
    """The units chosen are the ones wrapped: each Block of a GPT is an FSDP module of its own (a choice tested
    without its effect let a policy that chose units but wrapped none pass)."""
    import torch.distributed as dist
    from test_cluster import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from project.models.gpt import GPT, Block

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        holder = nn.Module()
        holder.net = GPT(block_size=8, n_layer=3, n_head=2, n_embd=8)
        parallelize.shard(holder, holder.net, init_device_mesh("cpu", (1,)), recompute=True)
        blocks = [m for m in holder.net.modules() if isinstance(m, Block)]
        assert len(blocks) == 3 and all(isinstance(b, FSDPModule) for b in blocks)
        assert isinstance(holder.net, FSDPModule)  # the embeddings, the final norm and the head
        assert not isinstance(holder.net.blocks[0].attn, FSDPModule)  # outermost repeated blocks only
        logits = holder.net(torch.randint(0, 256, (2, 8)))  # recomputed units still compute
        logits.sum().backward()
        assert all(p.grad is not None for p in holder.net.parameters())
    finally:
        dist.destroy_process_group()
