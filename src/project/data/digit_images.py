"""Write the default digits as an image folder (PNG files in class subfolders): a real folder to try
`data=image_folder` on, and the layout your own images need. `python -m project.data.digit_images <folder>`."""

import argparse
from pathlib import Path

from PIL import Image

from project.data.digits import read_mnist_5k


def write_digit_images(root: Path, per_class: int = 500) -> int:
    """`root/<digit>/<n>.png` for the first `per_class` digits of each class; returns how many were written."""
    images, labels = read_mnist_5k()
    written = 0
    for digit in range(10):
        folder = root / str(digit)
        folder.mkdir(parents=True, exist_ok=True)
        for n, i in enumerate((labels == digit).nonzero().flatten()[:per_class].tolist()):
            Image.fromarray(images[i].numpy()).save(folder / f"{n:04d}.png")
            written += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the folder to write (made if missing)")
    parser.add_argument("--per-class", type=int, default=500, help="digits per class (at most 500)")
    args = parser.parse_args()
    print(f"wrote {write_digit_images(args.root, args.per_class)} PNG files into {args.root}/<digit>/")


if __name__ == "__main__":
    main()
