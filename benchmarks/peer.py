"""The peer: ashleve/lightning-hydra-template, the popular Lightning + Hydra template, run as its README says
(`python src/train.py ...`) on our digits. It is not a dependency of this project.

Where it comes from, first found wins: $PEER_SRC (a checkout), $PEER_GIT_DIR (a bare git directory, a
mirror), or `git clone` from GitHub. It runs in a venv of its own ($PEER_VENV, default
~/.cache/bench-peer/venv) that sees our .venv's packages and adds the two it needs that we do not have,
`rootutils` and `hydra-colorlog`; `make bench-peer` makes that venv:

    .venv/bin/python -m venv ~/.cache/bench-peer/venv   # the same Python as ours
    echo "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        > ~/.cache/bench-peer/venv/lib/python3.11/site-packages/main_venv.pth
    ~/.cache/bench-peer/venv/bin/pip install rootutils hydra-colorlog

Without the venv or the source, the peer's figures are skipped with a message saying so.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from digits_idx import write_digits_idx

URL = "https://github.com/ashleve/lightning-hydra-template"
VENV = Path(os.environ.get("PEER_VENV", Path.home() / ".cache" / "bench-peer" / "venv"))
NEEDS = ("rootutils", "hydra-colorlog")


@dataclass
class Peer:
    """A ready peer: its source tree (with our digits in its data/MNIST/raw), its python, its commit."""

    root: Path
    python: Path
    commit: str

    def train_cmd(self, *overrides: str) -> list[str]:
        return [str(self.python), str(self.root / "src" / "train.py"), *overrides]

    def whole_run_overrides(self, log_dir: Path, epochs: int, batch_size: int) -> list[str]:
        """The same work as our `model=mlp 'model.net.hidden=[64,128,64]'` run: its default SimpleDenseNet is
        784-64-128-64 already; 3,500/500/1,000 digits for train/val/test as ours; a TensorBoard logger as our
        default; checkpoints as its default (ours too); seeded like ours."""
        return [
            f"paths.data_dir={self.root / 'data'}",
            f"paths.log_dir={log_dir}",
            "data.train_val_test_split=[3500,500,1000]",
            f"data.batch_size={batch_size}",
            f"trainer.max_epochs={epochs}",
            "logger=tensorboard",
            "seed=12345",
            "test=false",
        ]


def setup_venv_commands(python: str = sys.executable) -> list[list[str]]:
    """The commands that make the peer's venv: ours underneath (a .pth file), rootutils and hydra-colorlog on top."""
    return [
        [python, "-m", "venv", str(VENV)],
        ["sh", "-c", f"echo {sysconfig.get_paths()['purelib']} > {_site_packages() / 'main_venv.pth'}"],
        [str(VENV / "bin" / "pip"), "install", "--quiet", *NEEDS],
    ]


def _site_packages() -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return VENV / "lib" / version / "site-packages"


def _source(into: Path) -> tuple[Path, str] | str:
    """The peer's tree copied into `into`, and its commit; or why there is none."""
    if os.environ.get("PEER_SRC"):
        src = Path(os.environ["PEER_SRC"])
        shutil.copytree(src, into, ignore=shutil.ignore_patterns(".git", "logs", "data"))
        return into, _git(["-C", str(src), "rev-parse", "HEAD"]) or "unknown"
    git_dir = Path(os.environ["PEER_GIT_DIR"]) if os.environ.get("PEER_GIT_DIR") else None
    if git_dir is not None and git_dir.is_dir():
        into.mkdir(parents=True)
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "HEAD"], capture_output=True)
        if archive.returncode == 0:
            subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
            return into, _git(["--git-dir", str(git_dir), "rev-parse", "HEAD"]) or "unknown"
    clone = subprocess.run(["git", "clone", "--quiet", "--depth", "1", URL, str(into)], capture_output=True, text=True)
    if clone.returncode == 0:
        return into, _git(["-C", str(into), "rev-parse", "HEAD"]) or "unknown"
    return f"no source: set PEER_SRC or PEER_GIT_DIR, or allow `git clone {URL}` ({clone.stderr.strip()[:200]})"


def _git(args: list[str]) -> str | None:
    proc = subprocess.run(["git", *args], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def prepare(workdir: Path | None = None) -> Peer | str:
    """The peer ready to run in `workdir` (a fresh temporary folder by default), or a one-line reason to skip it."""
    python = VENV / "bin" / "python"
    if not python.exists():
        return f"no peer venv at {VENV}: `make bench-peer` makes it (pip install {' '.join(NEEDS)} into it)"
    missing = subprocess.run([str(python), "-c", "import rootutils, hydra_plugins.hydra_colorlog"], capture_output=True)
    if missing.returncode != 0:
        return f"the peer venv {VENV} lacks {' or '.join(NEEDS)}: `make bench-peer` installs them"
    workdir = workdir or Path(tempfile.mkdtemp(prefix="bench-peer-"))
    found = _source(workdir / "lightning-hydra-template")
    if isinstance(found, str):
        return found
    root, commit = found
    write_digits_idx(root / "data")
    return Peer(root, python, commit)


def main() -> None:
    """`python benchmarks/peer.py --setup`: make the peer's venv (the only thing here that installs anything)."""
    if "--setup" in sys.argv:
        if (VENV / "bin" / "python").exists() and isinstance(prepare(), Peer):
            print(f"peer ready: venv {VENV}")
            return
        for cmd in setup_venv_commands():
            print("+", " ".join(cmd))
            subprocess.run(cmd, check=True)
    found = prepare()
    print(f"peer ready: {found.root} at {found.commit}" if isinstance(found, Peer) else f"peer skipped: {found}")


if __name__ == "__main__":
    main()
