"""The table example (experiment=diabetes: project.models.regressor on project.data.tables) through the template, at
the test profile's sizes: one device, eval, predict on a CSV of rows, export, ddp, pipe, a sweep."""

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import run_dirs

pytestmark = pytest.mark.slow

TINY = {"PROJECT_PROFILE": "tiny"}
TABLE = ["experiment=diabetes", "print_config=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from conftest import REPO, cli_env, run_python

    work = tmp_path_factory.mktemp("table")
    proc = run_python([__import__("sys").executable, str(REPO / "train.py"), *TABLE], work, cli_env(**TINY))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = run_dirs(work / "logs")
    return run


def best(run: Path) -> Path:
    (path,) = (run / "checkpoints").glob("epoch_*.ckpt")
    return path


def test_it_trains_and_evaluates_on_its_own_metric(cli, tmp_path, trained):
    fit = json.loads((trained / "fit_metrics.json").read_text())
    assert fit["status"] == "ok" and fit["best/val/mse"] == pytest.approx(min(fit["val/mse"], fit["best/val/mse"]))
    cli("eval.py", f"ckpt_path={best(trained)}", "print_config=false", env=TINY)
    (evaluated,) = run_dirs(tmp_path / "logs", task="eval")
    ours = json.loads((evaluated / "test_metrics.json").read_text())
    assert ours["test/mse"] == pytest.approx(json.loads((trained / "test_metrics.json").read_text())["test/mse"])


def test_it_scores_the_rows_of_a_csv(cli, tmp_path, trained):
    """The features standardized with the training rows' statistics, which the checkpoint holds."""
    from project.data.tables import read_diabetes

    columns, x, _ = read_diabetes()
    rows = tmp_path / "rows.csv"
    with open(rows, "w", newline="") as f:
        csv.writer(f).writerows([columns, *x[:3].tolist()])
    cli("predict.py", f"ckpt_path={best(trained)}", f"data.predict_path={rows}", "print_config=false", env=TINY)
    (predicted,) = run_dirs(tmp_path / "logs", task="predict")
    saved = torch.load(predicted / "predictions.pt", weights_only=True)
    assert saved["names"] == ["row 1", "row 2", "row 3"] and saved["outputs"].shape == (3,)
    ckpt = torch.load(best(trained), weights_only=True)
    stats = ckpt["TableDataModule"]
    from engine.runs.full_model import load_model

    model, _ = load_model(str(best(trained)))
    with torch.no_grad():
        want = model.eval()((x[:3] - stats["mean"]) / stats["std"])
    torch.testing.assert_close(saved["outputs"], want)
    with open(predicted / "predictions.csv") as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["row 1", "row 2", "row 3"]
    assert (predicted / "predictions.parquet").is_file()

    # the same rows with their columns in another order score the same: columns are matched by name (they were
    # matched by position: exit 0 and other numbers)
    order = list(reversed(range(len(columns))))
    with open(tmp_path / "reordered.csv", "w", newline="") as f:
        csv.writer(f).writerows([[columns[i] for i in order], *x[:3, order].tolist()])
    again = cli("predict.py", f"ckpt_path={best(trained)}", f"data.predict_path={tmp_path / 'reordered.csv'}",
                "print_config=false", env=TINY, cwd=tmp_path / "again")  # fmt: skip
    assert again.returncode == 0
    (reordered,) = run_dirs(tmp_path / "again" / "logs", task="predict")
    torch.testing.assert_close(torch.load(reordered / "predictions.pt", weights_only=True)["outputs"], want)
    with open(tmp_path / "fewer.csv", "w", newline="") as f:
        csv.writer(f).writerows([columns[1:], *x[:3, 1:].tolist()])
    proc = cli("predict.py", f"ckpt_path={best(trained)}", f"data.predict_path={tmp_path / 'fewer.csv'}",
               "print_config=false", env=TINY, cwd=tmp_path / "fewer", check=False)  # fmt: skip
    assert proc.returncode == 2 and f"no column {columns[0]!r} of the training data" in proc.stderr


def test_a_csv_its_datamodule_refuses_is_one_line_and_leaves_no_run(cli, tmp_path):
    """The DataModule reads the CSV in its setup, inside Lightning's fit: its ValueError was a traceback, exit 1, and
    the run dir stayed. Any DataModule's refusal in its hooks is now the one line (engine.entry)."""
    for cell in ("x", ""):
        (tmp_path / "rows.csv").write_text("a,b,price\n1,2,3\n4," + cell + ",6\n")
        proc = cli("train.py", *TABLE, f"data.path={tmp_path / 'rows.csv'}", "data.target=price", env=TINY, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert proc.stderr.startswith("error: data: ValueError: ") and "every cell must be a number" in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_what_its_datamodule_refuses_to_predict_on_is_one_line_and_leaves_no_run(cli, tmp_path, trained):
    """It was a ValueError traceback from inside Lightning's predict loop, and a predict run dir left behind."""
    for given, said in [
        ([], "error: data: ValueError: nothing to predict on: pass data.predict_path=<a CSV of feature rows>"),
        (["data.predict_path=nope.csv"], "error: data: FileNotFoundError: [Errno 2] No such file or directory"),
    ]:
        proc = cli("predict.py", f"ckpt_path={best(trained)}", *given, "print_config=false", env=TINY, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().startswith(said), proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "logs" / "predict").exists()


@pytest.mark.parametrize("fmt", ["onnx", "torch_export"])
def test_it_exports_for_any_number_of_rows(cli, tmp_path, trained, fmt):
    out = tmp_path / ("model.onnx" if fmt == "onnx" else "model.pt2")
    cli("export.py", f"ckpt_path={best(trained)}", f"format={fmt}", f"output={out}", "print_config=false", env=TINY)
    (exported,) = run_dirs(tmp_path / "logs", task="export")
    summary = json.loads((exported / "export.json").read_text())
    assert summary["input"]["shape"] == ["N", 10] and summary["max_abs_difference"] <= 1e-4


@pytest.mark.parametrize(
    "strategy",
    [
        ["trainer=ddp", "trainer.accelerator=cpu"],
        ["trainer=pipe", "trainer.accelerator=cpu", "trainer.strategy.split_points=[layers.3]"],
    ],
    ids=["ddp", "pipe"],
)
def test_it_trains_under_ddp_and_pipe(cli, tmp_path, strategy):
    cli("train.py", *TABLE, *strategy, env=TINY)
    (run,) = run_dirs(tmp_path / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "ok"


def test_a_sweep_over_its_learning_rate(cli, tmp_path):
    cli("train.py", "-m", *TABLE, "model.optimizer.lr=0.01,0.001", "test=false", env=TINY)
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["best/val/mse"] for r in rows)


def test_a_csv_wider_or_narrower_than_the_model_is_one_line_and_leaves_no_run(cli, tmp_path):
    """It was torch's traceback from the first step inside the net (mat1 and mat2 shapes), and the run dir stayed."""
    for width in (8, 12):
        rows = [[f"f{i}" for i in range(width)] + ["y"]] + [
            [str(r * i % 7) for i in range(width + 1)] for r in range(300)
        ]
        (tmp_path / "rows.csv").write_text("\n".join(",".join(row) for row in rows) + "\n")
        proc = cli("train.py", *TABLE, f"data.path={tmp_path / 'rows.csv'}", "data.target=y", env=TINY, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert proc.stderr.startswith("error: model: Regressor does not take the data (its batch: float32 (")
        assert f", {width}), float32 (" in proc.stderr
        assert "model.features=10" in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_ddp_scores_each_test_row_once_as_one_device_does(cli, tmp_path, trained):
    """51 test rows on 2 ranks: Lightning's DistributedSampler repeated one row (each rank must run as many batches),
    and ddp's test/mse was silently off from one device's on the same checkpoint (engine.callbacks.eval_shards)."""
    scores = {}
    for name, trainer in (("one", []), ("ddp", ["trainer=ddp", "trainer.accelerator=cpu"])):
        evaluate = ["eval.py", f"ckpt_path={best(trained)}", "data=diabetes", "data.test_size=51", *trainer]
        cli(*evaluate, "trainer.limit_test_batches=1.0", "print_config=false", cwd=tmp_path / name, env=TINY)
        (run,) = run_dirs(tmp_path / name / "logs", task="eval")
        scores[name] = json.loads((run / "test_metrics.json").read_text())
    for key in ("test/mse", "test/mae"):
        assert scores["ddp"][key] == pytest.approx(scores["one"][key], rel=1e-6, abs=0), key


def test_fsdp_predicts_three_rows_one_per_batch_as_one_device_does(cli, tmp_path, trained):
    """3 rows in batches of 1 on 2 ranks: unpadded shards of 2 and 1 rows ran 2 and 1 batches, and fsdp's collective
    forward broke (gloo: rank 1 killed by SIGABRT; NCCL: a hang). No smaller batch size evens them out: the shards
    are padded to as many rows, and the written predictions drop the repeated one."""
    from project.data.tables import read_diabetes

    columns, x, _ = read_diabetes()
    rows = tmp_path / "rows.csv"
    with open(rows, "w", newline="") as f:
        csv.writer(f).writerows([columns, *x[:3].tolist()])
    saved = {}
    for name, trainer in (("one", []), ("fsdp", ["trainer=fsdp", "trainer.accelerator=cpu"])):
        predict = ["predict.py", f"ckpt_path={best(trained)}", f"data.predict_path={rows}", "+data.batch_size=1"]
        cli(*predict, *trainer, "print_config=false", cwd=tmp_path / name, env=TINY)
        (run,) = run_dirs(tmp_path / name / "logs", task="predict")
        saved[name] = torch.load(run / "predictions.pt", weights_only=True)
    assert saved["fsdp"]["names"] == saved["one"]["names"] == ["row 1", "row 2", "row 3"]
    torch.testing.assert_close(saved["fsdp"]["outputs"], saved["one"]["outputs"], rtol=1e-5, atol=1e-5)
