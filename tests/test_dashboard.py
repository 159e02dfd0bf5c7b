"""examples/dashboard.py: headless as a script (marimo's script mode), and served by
`marimo run` in a real headless Chromium driven by Playwright (the Debian `chromium` package;
never `playwright install`, which downloads a browser)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "dashboard.py"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def test_dashboard_runs_headless_as_a_script(monkeypatch, tmp_path, capsys):
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(DASHBOARD)])
    app = runpy.run_path(str(DASHBOARD), run_name="dashboard")["app"]
    _, defs = app.run()
    (row,) = defs["results"]
    assert row["variant"] == "lora" and len(row["losses"]) == 15 and all(math.isfinite(x) for x in row["losses"])
    assert row["losses"][-1] < row["losses"][0] and row["reload_identical"]
    assert "lora: held-out accuracy" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_dashboard(tmp_path):
    """``marimo run`` on a free localhost port, 6 training steps of lora by default."""
    port = _free_port()
    marimo = Path(sys.executable).with_name("marimo")
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    # The log is closed on every path (a leaked file would surface later as an "unraisable
    # exception" warning, an error attributed to whichever test runs the garbage collector).
    with (tmp_path / "marimo.log").open("w") as log:
        server = subprocess.Popen(
            [str(marimo), "run", str(DASHBOARD), "--headless", "--no-token", "--host", "127.0.0.1", "--port", str(port),
             "--", "--steps", "6", "--variants", "lora"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}/"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"marimo run did not serve {url}: {(tmp_path / 'marimo.log').read_text()[-2000:]}")
                time.sleep(0.3)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_dashboard_in_a_headless_browser_trains_shows_a_full_width_plot_and_keeps_results_when_settings_change(served_dashboard):
    if not CHROMIUM.is_file():
        message = f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does this)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the browser test, never skip it
        pytest.skip(message)
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(90_000)
            expect.set_options(timeout=90_000)  # the kernel imports torch and loads the model first
            page.goto(served_dashboard)
            expect(page.get_by_text("what is", exact=False).first).to_be_visible()  # the dataset preview
            expect(page.get_by_role("columnheader", name="#").first).to_be_visible()  # with a row index
            expect(page.get_by_text("Press Train", exact=False)).to_be_visible()
            page.get_by_text("What do these mean?").click()
            expect(page.get_by_text("lora 0.003", exact=False)).to_be_visible()  # readable, not a dict
            assert "{'lora'" not in page.locator("body").inner_text()

            page.get_by_role("button", name="Train").click()
            expect(page.get_by_text("Training complete", exact=False)).to_be_visible()
            expect(page.get_by_role("heading", name="Generated answers, before and after")).to_be_visible()
            expect(page.get_by_text("identical").first).to_be_visible()
            plot = page.locator("img[src^='data:image/png'][alt='training loss']")
            expect(plot).to_be_visible()
            assert plot.evaluate("img => img.naturalWidth") > 300  # a rendered figure, not an icon
            # Full width: as wide as the results heading above it (the column), not ~65 % of it.
            column = page.get_by_role("heading", name="Results").evaluate("h => h.getBoundingClientRect().width")
            width = plot.evaluate("img => img.getBoundingClientRect().width")
            assert width >= 0.97 * column, (width, column)

            # Touch a control after the run: nothing re-runs, the results stay until the next Train.
            slider = page.get_by_role("slider").first
            slider.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_timeout(3000)
            expect(page.get_by_text("Training complete", exact=False)).to_be_visible()
            expect(plot).to_be_visible()
            expect(page.get_by_text("acc. after").first).to_be_visible()
            expect(page.get_by_text("Press Train", exact=False)).to_have_count(0)
        finally:
            browser.close()


def test_dashboard_declares_pep_723_dependencies_for_marimo_sandbox():
    """`marimo run --sandbox` reads the PEP 723 block; its lora-func source must be this checkout."""
    import re
    import tomllib

    block = re.search(r"^# /// script\n((?:^#(?: .*)?\n)+)^# ///$", DASHBOARD.read_text(), re.M)
    assert block, "no PEP 723 `# /// script` block"
    meta = tomllib.loads("".join(line[2:] + "\n" for line in block[1].splitlines()))
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in meta["dependencies"]}
    assert {"marimo", "lora-func", "torch", "matplotlib"} <= names, names
    source = meta["tool"]["uv"]["sources"]["lora-func"]
    root = (DASHBOARD.parent / source["path"]).resolve()
    assert root == ROOT and 'name = "lora_func"' in (root / "pyproject.toml").read_text()
