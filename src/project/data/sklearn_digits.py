"""The "Add your data" example (README, docs/your-data.md): scikit-learn's 1,797 8x8 digits, upscaled to MNIST's
28x28 so every template net takes them (copy this file to start yours). scikit-learn comes with mlxtend; no download."""

import torch
import torch.nn.functional as F

from engine import InputSpec, TensorDataModule, TensorDataset, normalize, split

# Pixel mean and std of the upscaled images in [0, 1]; training, predict.py and export.py all use them.
MEAN, STD = 0.3053, 0.3247
SIZE = 28


def read_sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (1797, 28, 28), 0-255, and int64 labels."""
    from sklearn.datasets import load_digits  # imported here: scikit-learn takes seconds to import

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) * (255 / 16)  # 0-16 -> 0-255
    images = F.interpolate(images, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    return images.round().clamp(0, 255).to(torch.uint8).squeeze(1), torch.as_tensor(digits.target).long()


class SklearnDigitsDataModule(TensorDataModule):
    """Split into train/val/test once by `split_seed`; everything else (order, shards) is TensorDataModule's."""

    num_classes = 10  # digits 0-9

    def __init__(
        self,
        batch_size: int = 64,
        val_size: int = 200,
        test_size: int = 300,
        split_seed: int = 0,
        on_device: bool = True,
        shuffle: bool = True,
    ) -> None:
        super().__init__(batch_size=batch_size, on_device=on_device, shuffle=shuffle)
        if val_size < 1 or test_size < 1 or val_size + test_size >= 1797:
            raise ValueError(f"val_size + test_size must leave training digits out of 1797, got {val_size}+{test_size}")
        self.val_size, self.test_size, self.split_seed = val_size, test_size, split_seed

    @classmethod
    def input_spec(cls, config: dict) -> InputSpec:
        """What a model trained on this data takes: predict.py and export.py read it from a checkpoint."""
        return InputSpec(channels=1, height=SIZE, width=SIZE, mean=(MEAN,), std=(STD,))

    def load_splits(self) -> dict[str, TensorDataset]:
        images, labels = read_sklearn_digits()
        images = normalize(images, MEAN, STD)
        sizes = [len(labels) - self.val_size - self.test_size, self.val_size, self.test_size]
        return {
            name: TensorDataset(images[idx], labels[idx])
            for name, idx in zip(("train", "val", "test"), split(len(labels), sizes, self.split_seed))
        }
