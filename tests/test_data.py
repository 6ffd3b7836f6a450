"""Data modules: real splits, batching by indexing, DDP shards, and the real MNIST file format."""

import pytest
import torch
import torchvision
from conftest import write_idx
from torch.utils.data import DataLoader, DistributedSampler

from engine.data.tensors import TensorDataset, _batch_as_is
from engine.errors import UserError
from project.data.digits import DigitsDataModule, read_mnist_5k
from project.data.mnist import MNISTDataModule


def hashes(images: torch.Tensor) -> list[bytes]:
    return [x.numpy().tobytes() for x in images]


@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    dm = DigitsDataModule(val_size=500, test_size=1000)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_mnist_5k_is_5000_real_distinct_digits():
    images, labels = read_mnist_5k()
    assert images.shape == (5000, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels).tolist() == [500] * 10
    assert len(set(hashes(images))) == 5000


def test_the_digits_file_is_parsed_once_a_process_and_each_read_gets_tensors_of_its_own(tmp_path, monkeypatch):
    """A sweep's jobs run one after the other in one process (Hydra's basic launcher): the file is parsed once, and
    again only when it changes. Every read returns tensors of its own: a job that changes them in place changes no
    other job's data. A file the test writes in the real format (784 pixels, then the label, per row)."""
    import gzip
    import os

    import numpy as np

    from project.data import digits as module

    path = tmp_path / "mnist_5k.csv.gz"

    def write(label: int) -> None:
        rows = np.arange(3 * 785).reshape(3, 785) % 256
        rows[:, -1] = label
        with gzip.open(path, "wt") as f:
            np.savetxt(f, rows, fmt="%d", delimiter=",")

    write(7)
    monkeypatch.setattr(module, "mnist_5k_path", lambda: path)
    parses, loadtxt = [], np.loadtxt
    monkeypatch.setattr(np, "loadtxt", lambda *a, **k: parses.append(1) or loadtxt(*a, **k))
    images, labels = module.read_mnist_5k()
    images.fill_(0)
    labels.fill_(0)
    images, labels = module.read_mnist_5k()
    assert len(parses) == 1
    assert images.shape == (3, 28, 28) and images[0, 0, :3].tolist() == [0, 1, 2] and labels.tolist() == [7, 7, 7]
    modified = path.stat().st_mtime_ns
    write(3)
    os.utime(path, ns=(modified + 10**9, modified + 10**9))  # a changed file, even within the clock's resolution
    assert module.read_mnist_5k()[1].tolist() == [3, 3, 3] and len(parses) == 2


def test_digits_splits_are_disjoint_shuffled_and_normalized(digits):
    sizes = {name: len(ds) for name, ds in digits.splits.items()}
    assert sizes == {"train": 3500, "val": 500, "test": 1000}
    seen = [set(hashes(ds.images)) for ds in digits.splits.values()]
    assert sum(len(s) for s in seen) == len(set().union(*seen)) == 5000
    # the file is sorted by class: every split must still hold every class
    for ds in digits.splits.values():
        assert set(ds.labels.tolist()) == set(range(10))
    train = digits.splits["train"].images
    assert train.shape[1:] == (1, 28, 28) and train.dtype == torch.float32
    assert abs(train.mean().item()) < 0.1 and abs(train.std().item() - 1) < 0.1


def test_test_split_does_not_depend_on_the_run_seed():
    tests = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        dm = DigitsDataModule()
        dm.setup("test")
        tests.append(dm.splits["test"].labels)
    assert torch.equal(*tests)


def test_a_batch_is_one_indexing_op_with_the_same_content_as_per_sample_access(digits):
    ds = digits.splits["val"]
    x, y = next(iter(DataLoader(ds, batch_size=16, shuffle=False, collate_fn=_batch_as_is)))
    assert torch.equal(x, torch.stack([ds[i][0] for i in range(16)]))
    assert torch.equal(y, torch.stack([ds[i][1] for i in range(16)]))


def test_distributed_sampler_gives_each_rank_its_own_shard_reshuffled_per_epoch():
    ds = TensorDataset(torch.arange(100).float().view(100, 1), torch.arange(100))
    per_epoch = []
    for epoch in (0, 1):
        shards = []
        for rank in (0, 1):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            loader = DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=_batch_as_is)
            shards.append(torch.cat([y for _, y in loader]).tolist())
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(100))
        per_epoch.append(shards[0])
    assert per_epoch[0] != per_epoch[1]


@pytest.mark.parametrize("dataset", ["MNIST", "FashionMNIST"])
def test_mnist_format_files_load_through_torchvision(tmp_path, dataset):
    arrays = write_idx(tmp_path, dataset, n_train=20, n_test=10)
    dm = MNISTDataModule(dataset=dataset, data_dir=str(tmp_path), download=False, val_size=5, batch_size=4)
    dm.prepare_data()
    dm.setup("fit")
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 15, "val": 5, "test": 10}
    assert torch.equal(dm.splits["test"].labels, torch.from_numpy(arrays["t10k_labels"]).long())
    mean, std = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530)}[dataset]
    expected = (torch.from_numpy(arrays["t10k"]).float() / 255 - mean) / std
    torch.testing.assert_close(dm.splits["test"].images[:, 0], expected)
    assert isinstance(dm._fetch(True, download=False), getattr(torchvision.datasets, dataset))


def test_missing_files_offline_name_the_fix(tmp_path):
    dm = MNISTDataModule(data_dir=str(tmp_path), download=False)
    with pytest.raises(UserError, match=r"MNIST is not in .*data.download=false.*data=digits"):
        dm.prepare_data()


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    def offline(self):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\n<urlopen error no network>\n")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", offline)
    dm = MNISTDataModule(data_dir=str(tmp_path), download=True)
    with pytest.raises(UserError, match=r"download failed: RuntimeError.*data=digits") as info:
        dm.prepare_data()
    assert "\n" not in str(info.value)  # printed as one line


def test_unknown_dataset_name_lists_the_choices():
    with pytest.raises(UserError, match="FashionMNIST"):
        MNISTDataModule(dataset="CIFAR10")
