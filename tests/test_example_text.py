"""The text example (experiment=gpt_text: project.models.gpt on project.data.text) through the template, at the
test profile's sizes: one device, a resume mid-epoch bit for bit, predict (it writes text), export for any prompt
length, fsdp (a unit per transformer block, recomputed or not), the pipeline cut at a block, a sweep."""

import csv
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python

pytestmark = pytest.mark.slow

TINY = {"PROJECT_PROFILE": "tiny"}
GPT = ["experiment=gpt_text", "model.max_new_tokens=12", "model.net.n_layer=3", "print_config=false"]


def train(cwd: Path, *args: str, env: dict | None = None, check: bool = True):
    cwd.mkdir(parents=True, exist_ok=True)
    proc = run_python([sys.executable, str(REPO / "train.py"), *GPT, *args], cwd, cli_env(**TINY, **(env or {})))
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def weights(cwd: Path, name: str = "last.ckpt") -> dict[str, torch.Tensor]:
    (run,) = run_dirs(cwd / "logs")
    return torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("gpt")
    train(work)
    (run,) = run_dirs(work / "logs")
    return run


def test_it_continues_prompts_in_predict(cli, tmp_path, trained):
    (best,) = (trained / "checkpoints").glob("epoch_*.ckpt")
    cli("predict.py", f"ckpt_path={best}", 'data.prompts=["def ","class ","The "]', "print_config=false", env=TINY)
    (predicted,) = run_dirs(tmp_path / "logs", task="predict")
    with open(predicted / "predictions.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["def ", "class ", "The "]
    assert all(0 < len(r["output"].encode("utf-8", "surrogateescape")) for r in rows)
    saved = torch.load(predicted / "predictions.pt", weights_only=True)
    assert saved["names"] == ["def ", "class ", "The "] and len(saved["outputs"]) == 3
    # an empty prompt was an IndexError traceback from the model's generate, its run dir left
    empty = cli(
        "predict.py", f"ckpt_path={best}", 'data.prompts=["def ",""]', env=TINY, cwd=tmp_path / "e", check=False
    )
    assert empty.returncode == 2 and empty.stderr.strip() == (
        "error: data: ValueError: data.prompts: an empty prompt; give each at least one character to continue"
    )
    assert not (tmp_path / "e" / "logs" / "predict").exists()


def test_it_exports_for_any_prompt_length_up_to_its_context(cli, tmp_path, trained):
    import onnxruntime

    from engine.runs.full_model import load_model

    (best,) = (trained / "checkpoints").glob("epoch_*.ckpt")
    out = tmp_path / "gpt.onnx"
    cli("export.py", f"ckpt_path={best}", f"output={out}", "print_config=false", env=TINY)
    (exported,) = run_dirs(tmp_path / "logs", task="export")
    assert json.loads((exported / "export.json").read_text())["input"]["shape"] == ["N", "T <= 64"]
    model, _ = load_model(str(best))
    tokens = torch.randint(0, 256, (3, 17))
    got = onnxruntime.InferenceSession(str(out)).run(None, {"input": tokens.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model.eval()(tokens), atol=1e-4, rtol=0)


def test_a_run_killed_mid_epoch_resumes_bit_for_bit(tmp_path):
    run = [
        "callbacks.last_checkpoint.every_n_steps=1",
        "+callbacks.kill._target_=probes.KillAt",
        "model.net.dropout=0.1",
    ]
    train(tmp_path / "unbroken", *run)
    killed = train(tmp_path / "killed", *run, env={"KILL_AT_STEP": "4"}, check=False)  # epoch 1, its second step
    assert killed.returncode == -signal.SIGKILL
    (stopped,) = run_dirs(tmp_path / "killed" / "logs")
    train(tmp_path / "resumed", *run, f"ckpt_path={stopped / 'checkpoints' / 'last.ckpt'}")
    want, got = weights(tmp_path / "unbroken"), weights(tmp_path / "resumed")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fsdp_shards_a_unit_per_block_and_recomputing_them_changes_nothing(tmp_path):
    fsdp = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.strategy.save_distributed_checkpoint=false"]
    plain = train(tmp_path / "kept", *fsdp)
    assert "fsdp: 3 unit(s) (Block x3)" in plain.stdout + plain.stderr
    recomputed = train(tmp_path / "recomputed", *fsdp, "trainer.strategy.activation_checkpointing=true")
    assert "each unit recomputed in the backward" in recomputed.stdout + recomputed.stderr
    want, got = weights(tmp_path / "kept"), weights(tmp_path / "recomputed")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0)


def test_the_pipeline_cut_at_a_block_takes_one_devices_steps(tmp_path):
    train(tmp_path / "one")
    train(tmp_path / "cut", "trainer=pipeline", "trainer.accelerator=cpu", "trainer.strategy.split_points=[blocks.2]")
    want, got = weights(tmp_path / "one"), weights(tmp_path / "cut")
    for key, value in want.items():  # AdamW: the micro-batches' summation order shows at 1e-5
        torch.testing.assert_close(got[key], value, atol=1e-4, rtol=0, msg=key)


def test_a_sweep_over_its_depth(cli, tmp_path):
    cli("train.py", "-m", *GPT, "model.net.n_layer=1,2", "test=false", env=TINY)
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    with open(sweep / "summary.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "ok"]


def test_an_empty_text_file_is_one_line_and_leaves_no_run(cli, tmp_path):
    """It was torch.frombuffer's "both buffer length (0) and count (-1) must not be 0"."""
    (tmp_path / "empty.txt").write_bytes(b"")
    proc = cli("train.py", "experiment=gpt_text", f"data.path={tmp_path / 'empty.txt'}", env=TINY, check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: data: ValueError: data.path={tmp_path / 'empty.txt'}: an empty file; give it text to learn from"
    )
    assert not (tmp_path / "logs").exists()


def test_sequences_longer_than_the_nets_context_are_one_line_and_leave_no_run(cli, tmp_path):
    """The net's assert on the sequence length was a traceback from Lightning's sanity check, and the run dir stayed."""
    proc = train(tmp_path, "data.block_size=128", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "AssertionError: a sequence of 128 bytes, longer than block_size=64" in proc.stderr
    assert "model.net.block_size=64" in proc.stderr and not (tmp_path / "logs").exists()
