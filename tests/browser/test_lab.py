"""Notebooks 01 and 07 in JupyterLab in a real (headless) Chromium, as a user runs them.

JupyterLab starts as `make lab` starts it, with CI=1 and on a copy of the notebooks (its autosave
never touches the repository). Each test runs every cell from the Run menu. Notebook 01: the
training panel renders as ipywidgets (not a text repr); the test picks other coefficients in its
dropdown, clicks "train", and checks the click reached the kernel: the status label, the drawn image
and the panel's kept runs (one curve each in the figure) all change. While Run All is still going,
the panel's button says the kernel is busy and takes no click. Notebook 07: the comparison
panel; the test ticks other configurations, clicks "run" and reads the new table. Both skip where
no Chromium is installed, and the run's summary says so (tests/conftest.py), which the last test checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests._proc import alive, descendants

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NOTEBOOK = "01_quickstart.ipynb"
ERROR_OUTPUT = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on PATH: install Debian's `chromium` (apt-get install -y chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a copy of notebooks/; yields (url, token). Nothing survives it."""
    root = tmp_path / "notebooks"
    shutil.copytree(REPO / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "runs"))
    port, token = _free_port(), os.urandom(16).hex()
    jupyter_home = tmp_path / "jupyter"  # settings, workspaces and runtime files of this server only
    env = dict(os.environ, CI="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               JUPYTER_CONFIG_DIR=str(jupyter_home / "config"), JUPYTER_RUNTIME_DIR=str(jupyter_home / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(jupyter_home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(jupyter_home / "workspaces"))
    # Every cell in the DOM (JupyterLab 4 renders only the visible ones by default), the notebook's
    # kernel started without the "Select Kernel" dialog, no news prompt over the page.
    settings = {"notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
                "apputils-extension/notification": {"fetchNews": "false"}}
    for name, values in settings.items():
        file = jupyter_home / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(values))
    log = (tmp_path / "lab.log").open("w")
    jupyter = Path(sys.executable).with_name("jupyter")  # `make lab` runs .venv/bin/jupyter lab notebooks
    server = subprocess.Popen(
        [str(jupyter), "lab", str(root), "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI runs as root
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, f"JupyterLab exited:\n{(tmp_path / 'lab.log').read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
        yield url, token
    finally:
        below = descendants(server.pid)
        try:  # the server's own shutdown stops its kernels first
            request = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                             headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(request, timeout=5)
            server.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        _kill([*descendants(server.pid), *below])
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        log.close()
        leftover = [pid for pid in below if alive(pid)]
        assert not leftover, f"processes left behind by JupyterLab: {leftover}"


def _run_all_cells(page, timeout_ms: int, during=None) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    if during is not None:  # what a user does while the cells run
        during(page)
    # The run is over when every code cell shows a number and the numbers follow one another, as
    # one Run All gives (the stored counts have gaps where ignored cells store none), or at an error.
    page.wait_for_function(
        """() => {
            if ([...document.querySelectorAll(ERROR)].some(e => e.textContent.includes('Traceback'))) return true;
            const counts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
                .map(p => (/\\[(\\d+)\\]/.exec(p.textContent) || [])[1]).map(Number);
            return counts.length > 0 && counts.every((c, i) => c > 0 && (i === 0 || c === counts[i - 1] + 1));
        }""".replace("ERROR", json.dumps(ERROR_OUTPUT)), timeout=timeout_ms)


def _cell_output(page, first_line: str):
    """The output area of the code cell whose source starts with ``first_line``."""
    cell = page.locator(".jp-CodeCell").filter(has=page.locator(".cm-line").first.filter(has_text=first_line))
    return cell.locator(".jp-OutputArea")


def _open_and_run_all(page, url: str, token: str, notebook: str, timeout_ms: int, during=None) -> None:
    page.goto(f"{url}/lab/tree/{notebook}?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=60_000)
    page.wait_for_function(  # the kernel is up and connected (a Run All sent earlier can be lost)
        "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]"
        "      .some(e => e.textContent.includes('| Idle'))", timeout=60_000)
    _run_all_cells(page, timeout_ms=timeout_ms, during=during)


def _click_the_busy_panel(page) -> None:
    """While Run All is still going (the last cell trains through the panel), the panel's train
    button says the kernel is busy and is disabled, and a click on it is taken by nothing. Found,
    read and clicked in one evaluation in the page: the cell may end at any moment."""
    state = page.wait_for_function(
        """() => {
            const b = [...document.querySelectorAll('.jupyter-widgets.widget-button')]
                .find(b => b.textContent.includes('(kernel busy)'));
            if (!b) return null;
            b.click();  // a user's click: a disabled button takes none
            return {disabled: b.disabled, title: b.title};
        }""", timeout=240_000).json_value()
    assert state["disabled"] and state["title"].startswith("The kernel is running cells"), state


@contextlib.contextmanager
def _lab_page(tmp_path: Path):
    """A page of headless Chromium (1400 x 1000); a failure inside keeps its screenshot and HTML in
    ``tmp_path`` (printed), and the browser is closed either way."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                yield page
            except Exception:
                page.screenshot(path=tmp_path / "lab.png", full_page=True)
                (tmp_path / "lab.html").write_text(page.content())
                print(f"page at the failure: {tmp_path / 'lab.png'}, {tmp_path / 'lab.html'}")
                raise
        finally:
            browser.close()


@needs_chromium
@pytest.mark.timeout(480)  # a stuck page still ends in the fixture's shutdown
def test_notebook_01_panel_renders_and_trains_on_click(lab, tmp_path):
    url, token = lab
    with _lab_page(tmp_path) as page:
        # Run All's budget: it ran past 120 s on the 2 cores at a load of 9
        _open_and_run_all(page, url, token, NOTEBOOK, timeout_ms=240_000, during=_click_the_busy_panel)

        errors = page.locator(ERROR_OUTPUT, has_text="Traceback")
        assert errors.count() == 0, errors.first.inner_text()

        panel = page.locator(".jp-OutputArea-output .jupyter-widgets.widget-vbox").first
        panel.wait_for(timeout=30_000)
        assert panel.locator(".widget-button").count() == 2  # train, clear runs
        # the cells are done: the buttons are as they were
        assert panel.locator(".widget-button", has_text="kernel busy").count() == 0
        assert panel.locator(".widget-button", has_text="train").is_enabled()
        assert panel.locator(".widget-slider, .widget-hslider").count() >= 3
        notebook_text = page.locator(".jp-Notebook").inner_text()
        assert "VBox(children" not in notebook_text and "TrainingPanel(" not in notebook_text

        # `panel.update()` (the last cell) drew one run into the panel, not under its own cell.
        image = panel.locator(".widget-output img")
        image.wait_for(timeout=30_000)
        first_src = image.get_attribute("src")
        assert page.locator(".jp-CodeCell").last.locator("img").count() == 0, "a figure escaped the panel"
        status = panel.locator(".widget-label", has_text="done:")
        assert "keller" in status.inner_text()

        panel.locator(".widget-dropdown select").select_option("xtuner")
        panel.locator(".widget-button", has_text="train").click()
        page.wait_for_function(
            """() => [...document.querySelectorAll('.widget-label')]
                     .some(l => l.textContent.startsWith('done:') && l.textContent.includes('xtuner'))""",
            timeout=60_000)
        page.wait_for_function(
            "src => { const i = document.querySelector('.widget-output img'); return i && i.src !== src; }",
            arg=first_src, timeout=30_000)
        assert panel.locator(".widget-output img").count() == 1

        # The runs the figure draws, read back from the kernel through a new cell.
        cells = page.locator(".jp-CodeCell")
        n = cells.count()
        cells.nth(n - 1).locator(".jp-InputPrompt").click()  # select the last cell
        page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:insert-cell-below']").click()
        new_cell = cells.nth(n)
        new_cell.locator(".cm-content").click()
        page.keyboard.type("import json; print(json.dumps(list(panel.runs)))")
        page.keyboard.press("Shift+Enter")
        last_output = new_cell.locator(".jp-OutputArea-output")
        last_output.wait_for(timeout=30_000)
        runs = json.loads(last_output.inner_text())
        assert len(runs) == 2 and "keller" in runs[0] and "xtuner" in runs[1], runs


@needs_chromium
@pytest.mark.timeout(480)
def test_notebook_07_compare_panel_runs_on_click(lab, tmp_path):
    url, token = lab
    with _lab_page(tmp_path) as page:
        _open_and_run_all(page, url, token, "07_compare.ipynb", timeout_ms=300_000)
        errors = page.locator(ERROR_OUTPUT, has_text="Traceback")
        assert errors.count() == 0, errors.first.inner_text()

        # the panel, drawn by ipywidgets, with the table of the run its notebook cell clicked
        panel = page.locator(".jp-OutputArea-output .jupyter-widgets.widget-vbox").filter(
            has=page.locator("select[multiple]")).first
        panel.wait_for(timeout=30_000)
        assert "ComparePanel(" not in page.locator(".jp-Notebook").inner_text()
        table = panel.locator("table.muonlab-compare")
        table.wait_for(timeout=30_000)
        assert "keller, momentum 0.9" in table.inner_text()
        assert "adamw" not in table.inner_text()

        panel.locator("select[multiple]").select_option(["keller", "adamw"])
        panel.locator(".widget-button", has_text="run").click()
        page.wait_for_function(
            """() => [...document.querySelectorAll('.widget-label')]
                     .some(l => l.textContent.startsWith('done:') && l.textContent.includes('adamw - keller'))""",
            timeout=180_000)
        rows = [r.inner_text() for r in table.locator("tr").all()]
        assert len(rows) == 3 and rows[1].startswith("keller") and rows[2].startswith("adamw"), rows
        assert "no Newton-Schulz" in rows[2] and "float32" in rows[1]  # the resolved choices shown
        assert panel.locator(".widget-output img").count() == 1


def test_a_run_without_chromium_says_why_the_browser_tests_skipped():
    """The browser tests run with a PATH holding no Chromium: they skip, and the summary at the end
    of the output names the package to install (a skip among the suite's others is easy to miss).
    Run as `make test` runs them, on xdist workers: the summary is written by the controller."""
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "--dist",
                          "loadscope", "-k", "notebook_",
                          str(Path(__file__).relative_to(REPO))], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "2 skipped" in out, out
    assert ("2 test(s) in tests/browser skipped: no Chromium on PATH: install Debian's `chromium` "
            "(apt-get install -y chromium)") in out, out
