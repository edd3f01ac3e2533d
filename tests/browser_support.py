"""A page as a person sees it: rendered by Debian's headless chromium (installed by
``make setup`` from ``.ci/apt-packages.txt``) into a PNG, kept where
``QUEUE_REF_SCREENSHOT`` says (the ``make *-screenshot`` targets)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def screenshot(page: Path, workdir: Path) -> bytes:
    """Render ``page`` at 1200x1600 and return the PNG's bytes (asserting it is one)."""
    shot = workdir / f"{page.stem}.png"
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
         "--window-size=1200,1600", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "HOME": str(workdir)})
    assert done.returncode == 0, done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("QUEUE_REF_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    return png
