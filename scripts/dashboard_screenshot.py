"""Regenerate docs/guide/dashboard.png: the dashboard after a finished run, as a user sees it.

    python scripts/dashboard_screenshot.py                       # all nine variants, 120 steps: about 1 min
    python scripts/dashboard_screenshot.py --variants lora,ia3 --steps 30 --out /tmp/dashboard.png

It serves examples/dashboard.py with ``marimo run`` on a free localhost port, opens it in a
headless Chromium (the Debian ``chromium`` package, driven by Playwright; never
``playwright install``, which downloads a browser) at 1440x900, presses **Train**, waits for
the results and saves the whole page. Nothing is downloaded: it runs offline.

tests/test_dashboard.py starts its server with :func:`serve_dashboard` from here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "dashboard.py"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1440, "height": 900}
TALLEST = "Math.max(...[...document.querySelectorAll('*')].map(e => e.scrollHeight))"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_dashboard(args: Sequence[str], workdir: Path, *, timeout: float = 60) -> Iterator[str]:
    """``marimo run examples/dashboard.py -- *args`` on a free localhost port, with this
    checkout's lora_func first on the path; yields the URL once it answers. Its log is
    ``workdir/marimo.log``; the server is stopped on every path out."""
    port = _free_port()
    marimo = Path(sys.executable).with_name("marimo")
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path}
    log_path = workdir / "marimo.log"
    # The log is closed on every path (a leaked file would surface later as an "unraisable
    # exception" warning, attributed to whatever runs the garbage collector next).
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [str(marimo), "run", str(DASHBOARD), "--headless", "--no-token", "--host", "127.0.0.1", "--port", str(port),
             "--", *args],
            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}/"
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"marimo run did not serve {url}: {log_path.read_text()[-2000:]}")
                time.sleep(0.3)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def small_png(png: bytes) -> bytes:
    """``png`` as a 256-colour palette PNG, about a third of the size: flat UI colours lose
    nothing visible. (Median cut merges the plot's line colours into greys; the octree keeps
    them.)"""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def screenshot(out: Path, variants: str, steps: int, *, timeout_s: float = 600) -> Path:
    """Serve, train ``variants`` for ``steps`` steps, wait for the results, save the full page."""
    from playwright.sync_api import expect, sync_playwright

    if not CHROMIUM.is_file():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_dashboard(["--variants", variants, "--steps", str(steps)], Path(tmp)) as url,
        sync_playwright() as p,
    ):
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            expect.set_options(timeout=timeout_s * 1000)
            page.goto(url)
            expect(page.get_by_text("Press Train to fine-tune", exact=False)).to_be_visible()
            page.get_by_role("button", name="Train").click()
            expect(page.get_by_text("Training complete", exact=False)).to_be_visible()
            expect(page.locator("img[alt='training loss']")).to_be_visible()
            page.wait_for_timeout(1500)  # tables and images settle
            # marimo scrolls an inner element, not the document: grow the viewport to
            # the tallest scrolling element so that the whole page is in one screenshot.
            height = 0
            for _ in range(10):  # until the layout settles (it does in two or three rounds)
                if (tallest := page.evaluate(TALLEST)) == height:
                    break
                height = tallest
                page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
                page.wait_for_timeout(1000)
            png = small_png(page.screenshot(full_page=True))
        finally:
            browser.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="all", help="comma-separated, or 'all' (default)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "guide" / "dashboard.png")
    args = parser.parse_args(argv)
    if args.variants == "all":
        sys.path.insert(0, str(ROOT))  # this checkout's variants, as the served app (PYTHONPATH) sees them
        import lora_func as lf

        args.variants = ",".join(lf.list_variants())
    path = screenshot(args.out, args.variants, args.steps)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
