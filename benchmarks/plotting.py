"""The one chart most figures here are: a bar per configuration at its median, with a min-max whisker."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display on a benchmark machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars(
    rows: Mapping[str, Mapping[str, float]],
    path: Path,
    title: str,
    ylabel: str,
    target: tuple[str, float] | None = None,
    ax: Any = None,
) -> None:
    """`rows`: label -> {"median", "min", "max"}. Drawn on `ax`, or as a figure of its own saved at `path`."""
    plt = pyplot()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows)), 4.5))
    labels = list(rows)
    med = [rows[label]["median"] for label in labels]
    err = [
        [m - rows[label]["min"] for m, label in zip(med, labels)],
        [rows[label]["max"] - m for m, label in zip(med, labels)],
    ]
    ax.bar(range(len(labels)), med, yerr=err, capsize=6, color="#4c72b0")
    for i, m in enumerate(med):
        ax.annotate(f"{m:.3g}", (i, m), textcoords="offset points", xytext=(8, 3), fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if target is not None:
        ax.axhline(target[1], color="#c44e52", ls="--", label=target[0])
        ax.legend(fontsize=8)
    if own:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
