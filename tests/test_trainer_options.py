"""Precision, torch.compile and sync BatchNorm: accepted where they work, refused by name where not."""

import json

import pytest
import torch

from project import build
from project.errors import UserError
from project.tasks.training import train


def test_bf16_mixed_computes_in_bfloat16_on_cpu(make_cfg, tmp_path):
    from probes import DtypeProbe

    DtypeProbe.seen.clear()
    cfg = make_cfg(
        "precision=bf16_mixed",
        "model=lenet",
        "debug=fdr",
        "trainer.accelerator=cpu",
        "+callbacks.dtype._target_=probes.DtypeProbe",
    )
    train(cfg)
    assert DtypeProbe.seen == {"torch.bfloat16"}  # autocast ran: the net's outputs are bfloat16
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "out" / "test_metrics.json").read_text())["test/loss"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs where CUDA is")
def test_fp16_mixed_without_cuda_is_refused_not_swapped_for_bf16(make_cfg):
    cfg = make_cfg("precision=fp16_mixed", "trainer.accelerator=cpu")
    with pytest.raises(UserError, match="16-mixed needs a CUDA GPU.*precision=bf16_mixed"):
        build.trainer(cfg.trainer, [], [])


def test_compile_compiles_the_forward_in_place(make_cfg, tmp_path):
    cfg = make_cfg("model=mlp", "model.compile=eager", "debug=fdr", "trainer.accelerator=cpu")
    model = build.model(cfg.model)
    keys = set(model.state_dict())
    model.configure_model()
    assert model.net._compiled_call_impl is not None
    assert set(model.state_dict()) == keys  # checkpoints load with or without compile
    train(cfg)  # the compiled module trains end to end
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "out" / "test_metrics.json").read_text())["test/loss"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_mixed_trains_on_a_gpu(make_cfg, tmp_path):
    cfg = make_cfg("precision=fp16_mixed", "model=lenet", "debug=fdr", "trainer.accelerator=gpu")
    assert build.trainer(cfg.trainer, [], []).precision == "16-mixed"
    train(cfg)


@pytest.mark.slow
def test_ddp_with_sync_batchnorm_runs_on_cpu_and_says_it_is_skipped(cli, tmp_path):
    # trainer=ddp turns sync_batchnorm on; LeNet has BatchNorm. Another template crashes here on CPU.
    proc = cli("train.py", "trainer=ddp", "trainer.accelerator=cpu", "model=lenet", "debug=limit", "test=false")
    assert "sync_batchnorm=True has no effect on cpu" in proc.stderr + proc.stdout
