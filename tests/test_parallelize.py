"""Cutting nets into blocks and stages: what pipe, pipeline and fsdp share (project.strategies.parallelize)."""

import pytest
import torch
from torch import nn

from project.errors import UserError
from project.models.lenet import LeNet
from project.models.mlp import MLP
from project.models.resnet import ResNet18
from project.strategies.parallelize import _cut, balance, blocks, stages

NETS = {"lenet": LeNet, "mlp": MLP, "resnet18": ResNet18}


@pytest.mark.parametrize("name", NETS)
def test_the_blocks_of_each_net_are_its_forward_and_hold_every_parameter_once(name):
    torch.manual_seed(0)
    net = NETS[name]().eval()
    found = blocks(net)
    x = torch.randn(3, 1, 28, 28)
    y = x
    for _, block in found:
        y = block(y)
    torch.testing.assert_close(y, net(x), rtol=0, atol=0)
    names = {f"{prefix}.{key}" for prefix, block in found for key in block.state_dict()}
    assert names == set(net.state_dict())  # the block names are the state_dict prefixes


def test_resnet18_is_cut_where_the_tutorials_cut_resnets():
    names = [name for name, _ in blocks(ResNet18())]
    assert names[:3] == ["stem.0", "stem.1", "stem.2"] and names[-3:] == ["head.0", "head.1", "head.2"]
    assert [n for n in names if n.startswith("layer")] == [f"layer{i}.{j}" for i in range(1, 5) for j in (0, 1)]


def test_a_net_that_is_not_a_sequence_of_blocks_is_refused_by_name():
    class Branchy(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(UserError, match="Branchy cannot be cut into stages: .* nn.Sequential"):
        blocks(Branchy())


def test_the_cut_minimises_the_costliest_stage():
    assert _cut([1, 1, 1, 1], 2) == [2, 2]
    assert _cut([10, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert _cut([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17: no cut does better than 17
    assert _cut([5], 1) == [1]


def test_balance_by_parameters_and_by_hand():
    found = blocks(MLP(hidden=(256, 128)))  # Flatten, Linear(784,256), ReLU, Linear(256,128), ReLU, Linear(128,10)
    assert balance(found, 2) == [2, 4]  # the 200k-parameter first layer alone against the rest
    assert balance(found, 2, [3, 3]) == [3, 3]
    assert [len(s) for s in stages(found, [3, 3])] == [3, 3]
    with pytest.raises(UserError, match=r"balance=\[2, 2\]: give 2 numbers .* add up to the net's 6 blocks"):
        balance(found, 2, [2, 2])
    with pytest.raises(UserError, match="7 stages for a net of 6 blocks"):
        balance(found, 7)


def test_balance_by_time_gives_the_slow_block_a_stage_of_its_own():
    slow = nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1), nn.Flatten(), nn.ReLU())
    assert balance(blocks(slow), 2, "time", sample=torch.randn(8, 1, 28, 28))[0] <= 2
    with pytest.raises(UserError, match="balance=time needs an example input"):
        balance(blocks(slow), 2, "time")
