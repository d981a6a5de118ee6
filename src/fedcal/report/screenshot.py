"""Render an HTML report to a PNG in a real headless browser (Chromium), to check it offline.

    python -m fedcal.report.screenshot runs/default/report.html docs/report.png

Chromium comes from the system (Debian: ``apt-get install chromium``); fedcal
does not depend on it. The page is opened from a ``file://`` URL with the
network switched off for the browser's process (``--proxy-server`` pointing
nowhere), so a report that needed the network would render with holes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    """Path of a Chromium-family browser on PATH, or None."""
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def screenshot(html: str | Path, png: str | Path, width: int = 1280, height: int = 4000) -> Path:
    """Render ``html`` headless at ``width``×``height`` CSS pixels and write ``png``."""
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError(f"no Chromium-family browser on PATH (looked for {BROWSERS})")
    html, png = Path(html).resolve(), Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            browser,
            "--headless=new",
            "--no-sandbox",  # containers run as root, where the sandbox refuses to start
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--proxy-server=127.0.0.1:9",  # no network: everything must be in the file
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={png}",
            html.as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"{browser} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return png


if __name__ == "__main__":  # pragma: no cover - a tool for the README screenshot
    if len(sys.argv) not in (3, 5):
        sys.exit("usage: python -m fedcal.report.screenshot REPORT.html OUT.png [WIDTH HEIGHT]")
    size = tuple(int(v) for v in sys.argv[3:5]) or (1280, 4000)
    print(screenshot(sys.argv[1], sys.argv[2], *size))
