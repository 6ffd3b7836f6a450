"""`make tensorboard-shots`: headless-Chromium screenshots of TensorBoard's scalars, HParams and images pages, for a
quick look at a run without a browser (a cluster's login node). Uses Debian's `chromium`; installs nothing.
"""

import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine.errors import UserError
from engine.launch.ports import free_port

# The classic pages: they draw without WebGL, and take a tag filter in the address.
PAGES = {"scalars": "#scalars&tagFilter=%5E(train%7Cval%7Ctest)%2F", "hparams": "#hparams", "images": "#images"}


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise UserError("no Chromium found: install Debian's chromium package (apt install chromium), or another Chrome")


def _run_of(events: Path) -> Path:
    """The run directory an event file belongs to: the nearest folder with Hydra's .hydra in it."""
    return next((p for p in events.parents if (p / ".hydra").is_dir()), events.parent)


def _newest_run(logs: Path) -> Path:
    runs = sorted((_run_of(p) for p in logs.glob("**/events.out.tfevents.*")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError(f"{logs}: no TensorBoard event files under it; train a run first (python train.py)")
    return runs[-1]


def shoot(logs: Path, run_dir: Path) -> list[Path]:
    chromium = _chromium()
    port = free_port("127.0.0.1")  # not an ephemeral one: those go to outgoing connections too
    tensorboard = Path(sys.executable).with_name("tensorboard")
    server = subprocess.Popen(
        [str(tensorboard), "--logdir", str(logs), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{url}data/runs", timeout=5)
                break
            except OSError:
                time.sleep(1)
        shots = []
        for page, fragment in PAGES.items():
            out = run_dir / f"tensorboard_{page}.png"
            subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--use-gl=angle",  # software rendering: charts draw without a GPU or a screen
                    "--use-angle=swiftshader",
                    "--enable-unsafe-swiftshader",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--hide-scrollbars",
                    "--window-size=1600,1000",
                    "--virtual-time-budget=15000",  # TensorBoard draws its charts after the page loads
                    f"--screenshot={out}",
                    url + fragment,
                ],
                check=True,
                capture_output=True,
                timeout=180,
            )
            shots.append(out)
        return shots
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    logs = Path(sys.argv[1] if len(sys.argv) > 1 else "logs")
    try:
        run_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else _newest_run(logs)
        for shot in shoot(logs, run_dir):
            print(shot)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
