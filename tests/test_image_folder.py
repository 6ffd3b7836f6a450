"""data=image_folder: a folder of class subfolders (here PNG files of the default digits), split once by a fixed
seed or as given in train/ val/ test/, augmented for training only; trained on end to end, then predicted."""

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import run_dirs
from PIL import Image
from torch.utils.data import DistributedSampler

from engine.data.tensors import normalize
from project.data.digit_images import write_digit_images
from project.data.digits import MNIST_MEAN, MNIST_STD
from project.data.image_folder import ImageFolderDataModule


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits") / "images"
    write_digit_images(root, per_class=20)
    for digit in range(10):  # class names that are not their indices, to see them in predictions.csv
        (root / str(digit)).rename(root / f"digit_{digit}")
    return root


def _setup(root, **kwargs) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(str(root), num_workers=0, **kwargs)
    dm.setup("fit")
    return dm


def _files(dm: ImageFolderDataModule, name: str) -> set[str]:
    subset = dm.datasets[name].subset
    return {subset.dataset.samples[i][0] for i in subset.indices}


def test_one_folder_is_split_once_by_the_split_seed(folder):
    torch.manual_seed(1)
    dm = _setup(folder)
    assert dm.classes == [f"digit_{d}" for d in range(10)] and dm.state_dict() == {"classes": dm.classes}
    splits = {name: _files(dm, name) for name in ("train", "val", "test")}
    assert [len(s) for s in splits.values()] == [160, 20, 20]
    assert len(set().union(*splits.values())) == 200
    torch.manual_seed(2)
    assert {name: _files(_setup(folder), name) for name in splits} == splits  # not moved by the run's seed
    assert _files(_setup(folder, split_seed=1), "test") != splits["test"]


def test_val_and_test_are_not_augmented_and_normalized_as_training_data_is(folder):
    dm = _setup(folder, mean=[MNIST_MEAN], std=[MNIST_STD])
    x, label = dm.datasets["val"][0]
    path = dm.datasets["val"].subset.dataset.samples[dm.datasets["val"].subset.indices[0]][0]
    pixels = torch.from_numpy(np.array(Image.open(path)))
    assert torch.allclose(x, normalize(pixels[None], MNIST_MEAN, MNIST_STD)[0], atol=1e-6)
    torch.manual_seed(0)
    train_x = torch.stack([dm.datasets["train"][0][0] for _ in range(3)])
    assert train_x.shape == (3, 1, 28, 28) and not torch.equal(train_x[0], train_x[1])  # random every time
    plain = _setup(folder, augment=False)
    assert torch.equal(plain.datasets["train"][0][0], plain.datasets["train"][0][0])


def test_train_val_test_subfolders_are_taken_as_given(folder, tmp_path):
    for split, digits in (("train", range(10)), ("val", range(10)), ("test", range(10))):
        for d in digits:
            target = tmp_path / split / f"digit_{d}"
            target.mkdir(parents=True)
            for png in sorted((folder / f"digit_{d}").glob("*.png"))[{"train": 0, "val": 1, "test": 2}[split] :: 3]:
                shutil.copy(png, target / png.name)
    dm = _setup(tmp_path)
    assert all(p.startswith(str(tmp_path / name)) for name in ("train", "val", "test") for p in _files(dm, name))
    shutil.rmtree(tmp_path / "test" / "digit_9")
    with pytest.raises(ValueError, match="differ from train/'s"):
        _setup(tmp_path)


def test_the_sampler_splits_one_seeded_order_over_the_ranks(folder):
    dm = _setup(folder, batch_size=8)
    dm._shard = lambda: {"num_replicas": 2, "rank": 1}  # as under ddp
    dm._order_seed = lambda: 7
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.rank == 1
    assert len(loader.sampler) == 80 and loader.sampler.seed == 7


def test_a_model_of_another_class_count_is_refused_at_start(folder):
    with pytest.raises(ValueError, match="has 10 classes .* but the model has 3: set model.num_classes=10"):
        ImageFolderDataModule(str(folder), num_classes=3)


@pytest.mark.slow
def test_train_on_a_folder_of_pngs_then_predict_with_its_class_names(cli, tmp_path, folder):
    cli("train.py", "data=image_folder", f"data.root={folder}", "model=lenet", env={"PROJECT_PROFILE": "tiny"})
    (run,) = run_dirs(tmp_path / "logs")
    assert 0 <= json.loads((run / "test_metrics.json").read_text())["test/acc"] <= 1
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    assert torch.load(best, weights_only=True)["ImageFolderDataModule"]["classes"][3] == "digit_3"

    cli("predict.py", f"ckpt_path={best}", f"input={folder / 'digit_3'}")
    (predicted,) = run_dirs(tmp_path / "logs", task="predict")
    with open(predicted / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20 and rows[0]["name"] == "0000.png"
    assert list(rows[0])[2:] == [f"prob_digit_{d}" for d in range(10)]
    assert {r["predicted"] for r in rows} <= {f"digit_{d}" for d in range(10)}
