"""Checkpoints are data: a checkpoint from someone else cannot make loading it run code, and bad files fail by
name. Each hostile checkpoint below tries to write a file (or truncate one); none may succeed."""

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_python

from project.errors import UserError
from project.runs.checkpoints import check_readable, load_model

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

    from project.callbacks.run_state import _capture, _restore

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


def test_checkpoints_written_in_the_background_are_snapshots_in_order_and_fail_loudly(tmp_path, monkeypatch):
    """project.runs.atomic_io: a save of the file in_background() names is serialized at once (later changes to
    the weights are not in it) and written by the writer thread; saves and removals land in the order they were
    made; any other save (a signal handler's, meanwhile) is written at once, after the writer; a failed write is
    raised at the next wait, save or teardown, as the one-line error a synchronous one gives."""
    import pickle
    import threading

    from project.runs import atomic_io

    writers = []
    replace = atomic_io.os.replace
    monkeypatch.setattr(
        atomic_io.os, "replace", lambda *a: (writers.append(threading.current_thread().name), replace(*a))
    )
    checkpoints = atomic_io.AtomicCheckpointIO()
    weights = {"w": torch.zeros(3)}
    old, new, last, hpc = (tmp_path / name for name in ("epoch_001.ckpt", "epoch_002.ckpt", "last.ckpt", "hpc.ckpt"))
    checkpoints.save_checkpoint(weights, old)
    weights["w"] += 1
    with checkpoints.in_background(new):
        checkpoints.save_checkpoint(weights, new)
        checkpoints.save_checkpoint(weights, hpc)  # a signal handler's save (SLURM's requeue): not in the background
    with checkpoints.in_background(old):
        checkpoints.remove_checkpoint(old)  # after the new best is on disk, never before
    with checkpoints.in_background(last):
        checkpoints.save_checkpoint(weights, last)
    weights["w"] += 1  # the next optimizer step, while the writer may still be writing
    checkpoints.wait()
    assert writers == ["MainThread", "checkpoint-writer_0", "MainThread", "checkpoint-writer_0"], writers
    assert not old.exists() and [torch.load(p)["w"].tolist() for p in (new, hpc, last)] == [[1.0] * 3] * 3
    checkpoints.save_checkpoint(weights, last)  # a save outside (a signal's) waits for the writer, then writes
    assert checkpoints.load_checkpoint(last)["w"].tolist() == [2.0] * 3
    pickle.loads(pickle.dumps(checkpoints))  # ddp_spawn pickles the plugins

    failing = Path("/proc/no/such/run/epoch_003.ckpt")  # a full or read-only disk
    with checkpoints.in_background(failing):
        checkpoints.save_checkpoint(weights, failing)
    with checkpoints.in_background(new):
        checkpoints.remove_checkpoint(new)  # the best file it was to replace: kept, since the write failed
    with pytest.raises(UserError, match=r"epoch_003.ckpt: the checkpoint could .*; nothing was written there. Make"):
        checkpoints.teardown()
    assert new.is_file()
    checkpoints.teardown()  # raised once; the writer thread is gone
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]


def test_a_failed_background_write_does_not_hide_the_error_that_ends_the_run(tmp_path, caplog):
    """Lightning tears the strategy down while a divergence or Ctrl-C is on its way out: a failed write is logged
    then, and the run ends with its own error (its message, its exit code)."""
    from project.runs.atomic_io import AtomicCheckpointIO

    checkpoints = AtomicCheckpointIO()
    failing = Path("/proc/no/such/run/last.ckpt")
    with checkpoints.in_background(failing):
        checkpoints.save_checkpoint({"w": torch.zeros(1)}, failing)
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            checkpoints.teardown()
            raise
    assert "last.ckpt: the checkpoint could not be written" in caplog.text


def test_an_epochs_last_save_does_not_wait_for_its_best_file_but_the_next_save_does(tmp_path, monkeypatch):
    """The best file and last.ckpt are saved back to back at an epoch's end: the second is copied while the first
    is still being written; a third save waits for the first, so no more than two copies are ever in memory."""
    import threading

    from project.runs import atomic_io

    release, write = threading.Event(), atomic_io.write_atomically

    def held(checkpoint, target):  # the best file's write takes as long as the test says
        if target.name == "best.ckpt":
            assert release.wait(30)
        write(checkpoint, target)

    monkeypatch.setattr(atomic_io, "write_atomically", held)
    checkpoints = atomic_io.AtomicCheckpointIO()
    best, last, later = (tmp_path / name for name in ("best.ckpt", "last.ckpt", "later.ckpt"))
    for path in (best, last):
        with checkpoints.in_background(path):
            checkpoints.save_checkpoint({"w": torch.zeros(2)}, path)
    assert not best.exists()  # last.ckpt's save returned while the best file was still being written
    threading.Timer(0.2, release.set).start()
    with checkpoints.in_background(later):
        checkpoints.save_checkpoint({"w": torch.zeros(2)}, later)
    assert best.is_file()  # the third save waited for the first write
    checkpoints.teardown()
    assert all(torch.load(p)["w"].tolist() == [0.0, 0.0] for p in (best, last, later))


def test_after_a_failed_best_write_last_ckpt_is_left_as_it_was_and_the_run_ends(tmp_path, monkeypatch):
    """An epoch's best file fails to write (a full disk) while its last.ckpt is being copied: last.ckpt must not be
    replaced by one naming a best file that is not on disk. The old best and the old last.ckpt stay; the error ends
    the run at last.ckpt's save when the failure is already known, else at the next save, never an epoch later."""
    import concurrent.futures
    import threading

    from project.runs import atomic_io

    write = atomic_io.write_atomically

    def disk_full_for(name: str):
        def written(checkpoint, target):
            if target.name == name:
                raise UserError(f"{target}: the checkpoint could not be written (No space left on device)")
            write(checkpoint, target)

        return written

    for known_at_last_save in (True, False):
        run = tmp_path / str(known_at_last_save)
        run.mkdir()
        checkpoints = atomic_io.AtomicCheckpointIO()
        old_best, new_best, last, later = (run / n for n in ("epoch_0.ckpt", "epoch_1.ckpt", "last.ckpt", "e2.ckpt"))
        checkpoints.save_checkpoint({"best": old_best.name}, old_best)
        checkpoints.save_checkpoint({"best": old_best.name}, last)
        release = threading.Event()
        if known_at_last_save:
            monkeypatch.setattr(atomic_io, "write_atomically", disk_full_for(new_best.name))
        else:  # the best write fails only after last.ckpt's save has handed its copy over
            fails = disk_full_for(new_best.name)
            monkeypatch.setattr(atomic_io, "write_atomically", lambda c, t: (release.wait(30), fails(c, t)))
        with checkpoints.in_background(new_best):
            checkpoints.save_checkpoint({"best": new_best.name}, new_best)
        with checkpoints.in_background(old_best):
            checkpoints.remove_checkpoint(old_best)
        if known_at_last_save:
            assert not concurrent.futures.wait(checkpoints._pending, timeout=30).not_done
            with pytest.raises(UserError, match="epoch_1.ckpt: the checkpoint could not be written"):
                with checkpoints.in_background(last):
                    checkpoints.save_checkpoint({"best": new_best.name}, last)
        else:
            with checkpoints.in_background(last):
                checkpoints.save_checkpoint({"best": new_best.name}, last)
            release.set()
            with pytest.raises(UserError, match="epoch_1.ckpt: the checkpoint could not be written"):
                with checkpoints.in_background(later):  # the next epoch's save
                    checkpoints.save_checkpoint({"best": later.name}, later)
        checkpoints.teardown()
        assert torch.load(last)["best"] == old_best.name and old_best.is_file(), known_at_last_save
        assert sorted(p.name for p in run.iterdir()) == ["epoch_0.ckpt", "last.ckpt"]


def test_ctrl_c_while_a_save_waits_for_the_writer_still_reports_a_later_failed_write(tmp_path, monkeypatch, caplog):
    """Ctrl-C lands while a save waits for the best file's write, and the last.ckpt write after it fails on its own:
    the run ends with the KeyboardInterrupt, and teardown still logs the failed write (nothing is dropped)."""
    import signal
    import threading

    from project.runs import atomic_io

    hold, write = threading.Event(), atomic_io.write_atomically

    def written(checkpoint, target):
        if target.name == "best.ckpt":
            assert hold.wait(30)
        if target.name == "last.ckpt":
            raise UserError(f"{target}: the checkpoint could not be written (No space left on device)")
        write(checkpoint, target)

    monkeypatch.setattr(atomic_io, "write_atomically", written)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    checkpoints = atomic_io.AtomicCheckpointIO()
    try:
        for name in ("best.ckpt", "last.ckpt", "next.ckpt"):
            if name == "next.ckpt":  # its save waits for best.ckpt's write: Ctrl-C then
                main = threading.main_thread().ident
                threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
            with checkpoints.in_background(tmp_path / name):
                try:
                    checkpoints.save_checkpoint({"w": torch.zeros(1)}, tmp_path / name)
                except KeyboardInterrupt:
                    hold.set()
                    checkpoints.teardown()  # what Lightning does while the interrupt is on its way out
    finally:
        signal.signal(signal.SIGINT, previous)
    assert hold.is_set() and "last.ckpt: the checkpoint could not be written" in caplog.text
    assert (tmp_path / "best.ckpt").is_file() and not (tmp_path / "next.ckpt").exists()


def test_failed_writes_do_not_keep_their_snapshots_in_memory(tmp_path, monkeypatch):
    """After a run ends on a failed background write, no serialized copy of the checkpoint stays referenced (an
    in-process sweep or a notebook would keep it otherwise)."""
    import gc
    import io
    import threading
    import weakref
    from types import SimpleNamespace

    from project.runs import atomic_io

    snapshots = []

    class Tracked(io.BytesIO):
        def __init__(self) -> None:
            super().__init__()
            snapshots.append(weakref.ref(self))

    hold, write = threading.Event(), atomic_io.write_atomically
    monkeypatch.setattr(atomic_io, "io", SimpleNamespace(BytesIO=Tracked))
    monkeypatch.setattr(atomic_io, "write_atomically", lambda c, t: (hold.wait(30), write(c, t)))
    checkpoints = atomic_io.AtomicCheckpointIO()
    failing = Path("/proc/no/such/run")  # a full or read-only disk
    for name in ("best.ckpt", "last.ckpt"):  # the best file fails only once last.ckpt is handed over too
        with checkpoints.in_background(failing / name):
            checkpoints.save_checkpoint({"w": torch.zeros(1000)}, failing / name)
    hold.set()
    with pytest.raises(UserError, match="best.ckpt: the checkpoint could not be written"):
        with checkpoints.in_background(failing / "next.ckpt"):
            checkpoints.save_checkpoint({"w": torch.zeros(1000)}, failing / "next.ckpt")
    checkpoints.teardown()
    gc.collect()
    assert len(snapshots) == 2 and not [ref for ref in snapshots if ref() is not None]


def test_a_replaced_best_file_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    from project.runs import atomic_io

    def refused(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(atomic_io.TorchCheckpointIO, "remove_checkpoint", refused)
    checkpoints = atomic_io.AtomicCheckpointIO()
    old, new = tmp_path / "epoch_000.ckpt", tmp_path / "epoch_001.ckpt"
    checkpoints.save_checkpoint({"w": torch.zeros(1)}, old)
    with checkpoints.in_background(new):
        checkpoints.save_checkpoint({"w": torch.ones(1)}, new)
    with checkpoints.in_background(old):
        checkpoints.remove_checkpoint(old)
    with pytest.raises(UserError, match=r"epoch_000.ckpt: the checkpoint a better one replaced could not be removed"):
        checkpoints.teardown()
    assert old.is_file() and torch.load(new)["w"].tolist() == [1.0]


def test_a_logger_that_uploads_checkpoints_as_saved_gets_them_written_first(tmp_path):
    """Lightning's MLflow/W&B loggers with log_model read the file when told of it: no background write then."""
    from types import SimpleNamespace

    from project.callbacks.checkpoint import BestCheckpoint
    from project.runs.atomic_io import AtomicCheckpointIO

    checkpoints = AtomicCheckpointIO()
    callback = BestCheckpoint(dirpath=str(tmp_path), monitor="val/acc")
    waited = []
    io = SimpleNamespace(wait=lambda: waited.append("wait"))
    decide = SimpleNamespace(checkpoint_io=io, reduce_boolean_decision=lambda x, all: waited.append(x) or x)
    trainer = SimpleNamespace(is_global_zero=True, strategy=decide)
    # the version counter asks whether a name is taken: a file still being written is
    assert callback.file_exists(tmp_path / "nothing.ckpt", trainer) is False and waited == ["wait", False]
    assert callback.state_key.startswith("ModelCheckpoint{")  # checkpoints of Lightning's class resume its state
    path = tmp_path / "epoch_001.ckpt"
    for logger, background in (
        (None, True),
        (SimpleNamespace(_log_model=False), True),
        (SimpleNamespace(_log_model="all"), False),
    ):
        trainer = SimpleNamespace(
            loggers=[logger] if logger else [], strategy=SimpleNamespace(checkpoint_io=checkpoints)
        )
        with callback._in_background(trainer, str(path)):
            assert checkpoints._in_background(path) is background


def test_a_fit_of_a_users_module_writes_its_checkpoints_in_the_background(make_cfg, monkeypatch, tmp_path):
    """Through train() with a user's LightningModule (Lightning's README autoencoder, monitored on its train_loss):
    the best and last files are written by the writer thread, replaced best files are removed, and every file is
    on disk, whole, when fit returns (the callbacks' teardown waits)."""
    import threading

    from project.runs import atomic_io
    from project.tasks.training import train

    written = []
    replace = atomic_io.os.replace
    monkeypatch.setattr(
        atomic_io.os,
        "replace",
        lambda *a, **k: (written.append((threading.current_thread().name, Path(a[1]).name)), replace(*a, **k)),
    )
    cfg = make_cfg(
        "model=autoencoder",
        *(f"~model.{key}" for key in ("in_channels", "image_size", "latent", "lr")),
        "model._target_=user_models.LitAutoEncoder",
        "monitor.metric=train_loss",
        "monitor.mode=min",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=3",
        "+trainer.limit_train_batches=4",
        "test=false",
    )
    train(cfg)
    checkpoints = [(thread, name) for thread, name in written if name.endswith(".ckpt")]
    assert {thread for thread, _ in checkpoints} == {"checkpoint-writer_0"} and len(checkpoints) >= 4, written
    on_disk = sorted((tmp_path / "out" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in on_disk if p.name != "last.ckpt"] and len(on_disk) == 2  # the top-1 best and last.ckpt
    assert all(torch.load(p, weights_only=True)["global_step"] > 0 for p in on_disk)


def test_the_best_checkpoint_still_saves_every_n_train_steps_when_asked(make_cfg, tmp_path):
    """BestCheckpoint skips Lightning's per-step look at the trainer unless every_n_train_steps (or
    train_time_interval) asks for saves within epochs: then they are made, for a user's module too."""
    from project.tasks.training import train

    cfg = make_cfg(
        "model=autoencoder",
        *(f"~model.{key}" for key in ("in_channels", "image_size", "latent", "lr")),
        "model._target_=user_models.LitAutoEncoder",
        "monitor.metric=train_loss",
        "monitor.mode=min",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=4",
        "+callbacks.model_checkpoint.every_n_train_steps=2",
        "callbacks.model_checkpoint.save_top_k=-1",
        "callbacks.model_checkpoint.filename='step_{step}'",
        "test=false",
    )
    train(cfg)
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*.ckpt"))
    assert saved == ["step_2.ckpt", "step_4.ckpt"], saved


def test_a_moved_run_folder_tests_the_best_checkpoint_beside_the_one_it_resumed_from(tmp_path):
    """A finished run moved elsewhere and resumed (nothing left to train) still records its best file at the old
    place: the same file beside ckpt_path is tested; with neither, one line names the way out."""
    from project.runs.resume import best_to_test

    old, moved = tmp_path / "run" / "checkpoints", tmp_path / "moved" / "checkpoints"
    moved.mkdir(parents=True)
    (moved / "epoch_001.ckpt").write_bytes(b"best")
    recorded, resumed = str(old / "epoch_001.ckpt"), str(moved / "last.ckpt")
    assert best_to_test(recorded, resumed) == str(moved / "epoch_001.ckpt")
    assert best_to_test(str(moved / "epoch_001.ckpt"), resumed) == str(moved / "epoch_001.ckpt")
    assert best_to_test("", resumed) == "" and best_to_test(recorded, None) == recorded  # a fresh run: Lightning's
    (moved / "epoch_001.ckpt").unlink()
    with pytest.raises(UserError, match=r"names .*epoch_001.ckpt as its best checkpoint, which is not there any more"):
        best_to_test(recorded, resumed)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("model.optimizer.lr=0.05", "model.optimizer.lr=0.002, this run asks for model.optimizer.lr=0.05"),
        ("model/optimizer=sgd", "model.optimizer._target_=torch.optim.Adam, this run asks for "),
        ("model/scheduler=none", "model.scheduler={'_target_': 'torch.optim.lr_scheduler.CosineAnnealingLR'"),
    ],
)
def test_resuming_with_other_optimizer_settings_is_refused_not_ignored(make_cfg, tmp_path, override, said):
    """Lightning restores the optimizer and its schedule as saved: a new learning rate would be silently ignored
    (and recorded in the new checkpoints), another optimizer fails deep in the restore with a KeyError."""
    from omegaconf import OmegaConf

    from project.runs.resume import check_same_model

    saved = OmegaConf.to_container(make_cfg("model=mlp"), resolve=True)
    ckpt = {"hyper_parameters": saved, "epoch": 1, "global_step": 9, "state_dict": {}, "loops": {}}
    ckpt["optimizer_states"] = [{"state": {}, "param_groups": []}]
    check_same_model("last.ckpt", ckpt, make_cfg("model=mlp", "trainer.max_epochs=9").model)  # T_max may follow
    with pytest.raises(UserError, match=re.escape(f"ckpt_path=last.ckpt was trained with {said}")):
        check_same_model("last.ckpt", ckpt, make_cfg("model=mlp", override).model)


def test_a_checkpoint_folder_shared_with_another_run_is_refused_before_it_is_overwritten(tmp_path):
    """`callbacks.*.dirpath` moved out of the run dir, to a folder that holds another run's checkpoints: this run's
    last.ckpt would silently replace that run's. A restarted job (its own files) goes on."""
    from omegaconf import OmegaConf

    from project.runs.resume import check_checkpoint_dirs

    shared = tmp_path / "shared"
    callbacks = OmegaConf.create({"model_checkpoint": {"dirpath": str(shared)}, "last_checkpoint": {"dirpath": None}})
    check_checkpoint_dirs(callbacks, restarted=False)  # not there yet: made at start
    shared.mkdir()
    check_checkpoint_dirs(callbacks, restarted=False)  # empty
    for name in ("epoch_001.ckpt", "last.ckpt"):
        (shared / name).write_bytes(b"another run's")
    with pytest.raises(UserError, match=re.escape(f"callbacks.model_checkpoint.dirpath={shared} already holds")) as e:
        check_checkpoint_dirs(callbacks, restarted=False)
    assert str(e.value).endswith(f"continue that run with ckpt_path={shared / 'last.ckpt'}")
    check_checkpoint_dirs(callbacks, restarted=True)
