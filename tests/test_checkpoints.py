"""Checkpoints are data: a checkpoint from someone else cannot make loading it run code, and bad files fail by
name. Each hostile checkpoint below tries to write a file (or truncate one); none may succeed."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_python

from engine.errors import UserError
from engine.runs.checkpoints import check_readable
from engine.runs.full_model import load_model

MLP_MODEL = {
    "_target_": "project.models.classifier.ImageClassifier",
    "net": {"_target_": "project.models.mlp.MLP", "hidden": [8]},
    "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.01},
}


def hostile_models(tmp: Path) -> dict[str, dict]:
    """Model configs that would write tmp/<name>.pwned if built, each by another route."""
    hub = tmp / "hub"
    hub.mkdir()
    (hub / "hubconf.py").write_text(f"open({str(tmp / 'hub.pwned')!r}, 'w')\n")
    (tmp / "evil.py").write_text(f"open({str(tmp / 'import.pwned')!r}, 'w')\nclass Net:\n    pass\n")

    def net(target: str, **kwargs) -> dict:
        return {**MLP_MODEL, "net": {"_target_": target, **kwargs}}

    return {
        "system": net("os.system", command=f"touch {tmp / 'system.pwned'}"),
        "subprocess": net("subprocess.Popen", args=["touch", str(tmp / "subprocess.pwned")]),
        "inductor": net(
            "torch._inductor.codecache.PyCodeCache.load", source_code=f"open({str(tmp / 'inductor.pwned')!r}, 'w')"
        ),
        "hub": net("torch.hub.load", repo_or_dir=str(hub), model="x", source="local"),
        "import": net("evil.Net"),
        "nested": {
            **MLP_MODEL,
            "net": {
                "_target_": "project.models.mlp.MLP",
                "hidden": {"_target_": "os.system", "command": f"touch {tmp / 'nested.pwned'}"},
            },
        },
        "args": net(
            "torch.nn.Sequential", _args_=[{"_target_": "os.system", "command": f"touch {tmp / 'args.pwned'}"}]
        ),
        "scheduler": {
            **MLP_MODEL,
            "scheduler": {"_target_": "os.system", "_partial_": True, "command": f"touch {tmp / 'scheduler.pwned'}"},
        },
        "resolver": net("project.models.mlp.MLP", in_features=f"${{run_dir:{tmp / 'resolver.pwned'}}}"),
        "function": net("torch.nn.init.normal_"),  # allowed package, but a function, not a class
        # an allowed module's attributes lead anywhere: LPIPS downloads VGG weights when built
        "walk": net(
            "project.models.classifier.L._graveyard._torchmetrics.torchmetrics.image.LearnedPerceptualImagePatchSimilarity",
            net_type="vgg",
        ),
        "reexport": net("project.models.classifier.MaxMetric"),  # imported into an allowed module, defined outside
        "huge": net("torch.nn.Linear", in_features=10**6, out_features=10**6),  # 4 TB, unless checked on meta
        "not_a_lightning_module": {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1},
        # importing and hub targets nested inside an allowed net's config
        "nested_hub": net(
            "project.models.mlp.MLP",
            hidden={"_target_": "torch.hub.load", "repo_or_dir": str(hub), "model": "x", "source": "local"},
        ),
        "nested_import": net(
            "torch.nn.Sequential", _args_=[{"_target_": "torch.nn.Sequential"}, {"_target_": "evil.Net"}]
        ),
        "nested_import_module": net(
            "project.models.mlp.MLP", hidden={"_target_": "importlib.import_module", "name": "evil"}
        ),
    }


@pytest.fixture
def hostile_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # `evil` would import if anything tried
    return tmp_path


@pytest.mark.parametrize(
    "name",
    [
        "system",
        "subprocess",
        "inductor",
        "hub",
        "import",
        "nested",
        "args",
        "scheduler",
        "resolver",
        "function",
        "not_a_lightning_module",
        "walk",
        "reexport",
        "huge",
        "nested_hub",
        "nested_import",
        "nested_import_module",
    ],
)
def test_a_hostile_checkpoint_is_refused_and_runs_nothing(hostile_dir, name):
    model = hostile_models(hostile_dir)[name]
    path = hostile_dir / f"{name}.ckpt"
    torch.save({"hyper_parameters": {"model": model}, "state_dict": {"x": torch.zeros(1)}}, path)
    with pytest.raises(UserError, match="refused") as info:
        load_model(str(path))
    assert "\n" not in str(info.value)
    assert list(hostile_dir.rglob("*.pwned")) == []
    assert "evil" not in sys.modules


def test_a_checkpoint_cannot_claim_more_memory_than_it_stores(tmp_path):
    """Expanded (stride 0) tensors of a million-wide layer in a small file: refused before anything is built."""
    model = {**MLP_MODEL, "net": {"_target_": "project.models.mlp.MLP", "hidden": [1_000_000]}}
    state = {
        "net.layers.0.weight": torch.zeros(1).expand(1_000_000, 784),
        "net.layers.0.bias": torch.zeros(1).expand(1_000_000),
    }
    path = tmp_path / "claims.ckpt"
    torch.save({"hyper_parameters": {"model": model}, "state_dict": state}, path)
    assert path.stat().st_size < 10_000
    with pytest.raises(UserError, match=r"claims 3,136,000,000 bytes but stores 4 .*refused"):
        load_model(str(path))


class Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickled_object_is_refused_in_one_line(tmp_path):
    path = tmp_path / "pickle.ckpt"
    torch.save({"hyper_parameters": {"model": MLP_MODEL}, "state_dict": {}, "x": Exploit(tmp_path / "p.pwned")}, path)
    with pytest.raises(UserError, match="refused, it holds more than tensors and plain data") as info:
        load_model(str(path))
    assert "\n" not in str(info.value) and "weights_only` set to `False" not in str(info.value)
    assert not (tmp_path / "p.pwned").exists()


def test_a_checkpoint_of_this_project_loads_with_its_weights(tmp_path):
    import hydra

    model = hydra.utils.instantiate(MLP_MODEL)
    path = tmp_path / "ok.ckpt"
    torch.save({"hyper_parameters": {"model": MLP_MODEL}, "state_dict": model.state_dict()}, path)
    loaded, config = load_model(str(path))
    assert config["model"] == MLP_MODEL
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["model", "data"])
def test_eval_py_refuses_a_hostile_checkpoint_and_touches_nothing(tmp_path, part):
    import hydra

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    model_cfg = dict(MLP_MODEL)
    data_cfg = {"_target_": "project.data.digits.DigitsDataModule"}
    if part == "model":
        model_cfg["net"] = {"_target_": "builtins.open", "file": str(victim), "mode": "w"}
    else:
        data_cfg = {"_target_": "builtins.open", "file": str(victim), "mode": "w"}
    state = hydra.utils.instantiate(MLP_MODEL).state_dict()
    path = tmp_path / "hostile.ckpt"
    torch.save({"hyper_parameters": {"model": model_cfg, "data": data_cfg}, "state_dict": state}, path)
    proc = run_python([sys.executable, str(REPO / "eval.py"), f"ckpt_path={path}"], tmp_path, cli_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "builtins.open" in error and "refused" in error and "Traceback" not in proc.stderr
    assert victim.read_text() == "precious"
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("*.yaml"))


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_ckpt_path_is_named_not_taken_for_the_current_folder(empty):
    """eval.py, export.py and predict.py read the checkpoint through check_readable (train.py checks first)."""
    with pytest.raises(UserError, match=r"^ckpt_path is empty \(an unset shell variable\?\)"):
        check_readable(empty)


def test_a_directory_without_shard_metadata_is_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="not a sharded checkpoint"):
        check_readable(str(tmp_path))


def test_a_checkpoint_from_elsewhere_has_no_run_config(tmp_path):
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(UserError, match="holds no run config"):
        load_model(str(path))


def test_a_checkpoint_asking_for_compile_is_loaded_without_compiling(tmp_path):
    import hydra

    model = hydra.utils.instantiate(MLP_MODEL)
    path = tmp_path / "compiled.ckpt"
    torch.save(
        {"hyper_parameters": {"model": {**MLP_MODEL, "compile": "inductor"}}, "state_dict": model.state_dict()}, path
    )
    loaded, _ = load_model(str(path))
    assert loaded.compile_net is False


def test_python_random_state_restores_from_a_tensor_and_from_the_older_tuple():
    """RunState keeps Python's 625 state words as one tensor (cheaper to save); checkpoints written before kept
    them as a tuple, and resume from either."""
    import io
    import random

    from engine.callbacks.run_state import _capture, _restore

    cpu = torch.device("cpu")
    random.seed(3)
    state = _capture(cpu)
    expected = [random.random() for _ in range(5)]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert isinstance(saved["python"][1], torch.Tensor) and saved["python"][1].numel() == 625
    version, words, gauss = saved["python"]
    for layout in (saved["python"], (version, tuple(words.tolist()), gauss)):
        random.seed(99)
        _restore({**saved, "python": layout}, cpu)
        assert [random.random() for _ in range(5)] == expected
