"""JupyterLab in a headless browser: Debian's chromium driven by Playwright's Python API.

Why: nbval proves that a notebook's cells run, not that its widgets respond in a browser.  This module
starts a private JupyterLab on temporary copies of notebooks, opens one in chromium, runs all cells and
gives the tests (tests/engine/test_browser.py) and ``make screenshots`` the same handles on the widgets.

The browser is the system's (``apt-get install chromium``; .ci/run does it): Playwright's own browser
download is never used.  From a shell, ``python tests/lab_browser.py docs/img`` writes the README's
screenshots (``make screenshots``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHROMIUM = os.environ.get("LLMLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CALCULATOR = "01_memory_arithmetic.ipynb"
EXPLORER = "04_sampling.ipynb"


def skip_reason() -> str | None:
    """Why browser tests cannot run here, or None.  CI installs chromium, so there they always run."""
    if not Path(CHROMIUM).exists():
        return "no chromium on this machine: `apt-get install chromium` (.ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is missing: pip install -e '.[test]'"
    return None


@dataclass
class Lab:
    """A running JupyterLab: where it listens, its token, and the folder it serves."""

    url: str
    token: str
    root: Path

    def api(self, path: str) -> object:
        req = urllib.request.Request(f"{self.url}/api/{path}", headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(notebooks: list[str] = (), timeout: float = 60, course: bool = False) -> Iterator[Lab]:
    """JupyterLab on temporary copies of ``notebooks`` (it autosaves outputs into the files it opens).

    ``course=True``: a copy of the whole course instead, as ``llmlab lab`` and the OnDemand app serve it
    (notebooks/, exercises/ and solutions/ side by side, the course's settings, opened on the home page).
    A fresh workspaces folder per server: with a shared one, a "Select Kernel" dialog can block the run.
    The token reaches the server through the environment (JUPYTER_TOKEN), not through ``ps``.
    """
    from llmlab.ops.cli import _home_page, lab_environment

    tmp = Path(tempfile.mkdtemp(prefix="llmlab-lab-"))
    root, workspaces = tmp / "root", tmp / "workspaces"
    root.mkdir()
    workspaces.mkdir()
    for name in notebooks:
        shutil.copy(NOTEBOOKS / name, root / name)
    for part in ("notebooks", "exercises", "solutions") if course else ():
        shutil.copytree(ROOT / part, root / part)
    # Private settings: every cell rendered (no windowing: a half-painted plot in a screenshot), and no
    # "Jupyter news?" notification over the widgets.
    for plugin, value in [("notebook-extension/tracker", {"windowingMode": "none"}),
                          ("apputils-extension/notification", {"fetchNews": "false"})]:
        path = tmp / "settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    token, port = secrets.token_hex(16), _free_port()
    jupyter = Path(sys.executable).parent / "jupyter"
    cmd = [str(jupyter), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--ServerApp.root_dir={root}",
           "--allow-root", "--LabApp.expose_app_in_browser=True", f"--LabApp.workspaces_dir={workspaces}",
           f"--LabApp.user_settings_dir={tmp / 'settings'}",
           "--ServerApp.open_browser=False", *_home_page(root)]
    log = open(tmp / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**(lab_environment() if course else os.environ), "JUPYTER_TOKEN": token})
    lab = Lab(f"http://127.0.0.1:{port}", token, root)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                lab.api("status")
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s; its log:\n"
                                       f"{(tmp / 'jupyterlab.log').read_text()[-3000:]}") from None
                time.sleep(0.3)
        yield lab
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)  # the server and the kernels it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000):
    """A Playwright page in the system's headless chromium (--no-sandbox: CI runs as root).  Its actions wait up to
    60 s and ``expect`` up to 30 s (Playwright's 5 s default: a clean clone's run once saw the explorer's kernel
    redraw only 2 of 5 slider steps in 5 s while the other lane started an engine)."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


def current_path(page) -> str:
    """The path of the document in JupyterLab's active tab."""
    return page.evaluate("window.jupyterapp.shell.currentWidget?.context?.path ?? ''")


def link(page, text: str, within: str = ""):
    """A rendered Markdown link of the active notebook, by its text (and the text of the row it is in)."""
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    return (panel.locator(f"tr:has-text('{within}')") if within else panel).locator(f"a:text-is('{text}')").first


def _kernel_idle(lab: Lab, name: str) -> bool:
    """Whether the kernel of ``name`` is idle; not yet, while JupyterLab's server is too busy to say within its 5 s
    (a clean clone's run once saw /api/sessions time out while the kernel started): the caller's deadline decides."""
    try:
        sessions = [s for s in lab.api("sessions") if s.get("path", "").endswith(name)]
    except (TimeoutError, urllib.error.URLError):  # a timed-out read, or a timed-out connect
        return False
    return bool(sessions) and sessions[0]["kernel"]["execution_state"] == "idle"


def open_and_run(page, lab: Lab, name: str, timeout: float = 240) -> None:
    """Open notebook ``name``, wait for its kernel, run all cells and wait until the kernel is idle again."""
    page.goto(f"{lab.url}/lab/tree/{name}?token={lab.token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    deadline = time.monotonic() + timeout
    while not _kernel_idle(lab, name):
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if accept.count():
            accept.first.click()
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel of {name} was not idle within {timeout:.0f} s")
        time.sleep(0.5)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    time.sleep(1)
    while not _kernel_idle(lab, name):
        if time.monotonic() > deadline:
            raise AssertionError(f"running all cells of {name} took more than {timeout:.0f} s")
        time.sleep(0.5)


def errors(page) -> list[str]:
    """Text of every error output (a traceback) in the open notebook."""
    return page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
                        ':has-text("Traceback"), .jp-OutputArea-output:has(.jp-RenderedText'
                        '[data-mime-type="application/vnd.jupyter.error"])').all_inner_texts()


def interact(page):
    """The notebook's one ``ipywidgets.interactive`` (its controls and its output)."""
    return page.locator(".widget-interact").first


def control(widget, label: str):
    """The control of ``widget`` whose label (the keyword name that ``interactive`` gives it) is ``label``."""
    return widget.locator(f".widget-inline-hbox:has(> .widget-label:text-is('{label}'))").first


def set_slider(widget, label: str, value) -> None:
    """Type a value into a slider's editable readout, as a learner can; Enter commits it."""
    readout = control(widget, label).locator(".widget-readout")
    readout.click()
    readout.press("Control+a")
    readout.type(str(value))
    readout.press("Enter")


def nudge_slider(widget, label: str, steps: int = 1) -> None:
    """Move a slider's handle with the arrow keys, one step each."""
    handle = control(widget, label).locator(".noUi-handle")
    handle.focus()
    for _ in range(abs(steps)):
        handle.press("ArrowRight" if steps > 0 else "ArrowLeft")


def choose(widget, label: str, value: str) -> None:
    control(widget, label).locator("select").select_option(value)


def output(widget):
    """The output area of the ``interactive`` (printed text and plots)."""
    return widget.locator(".widget-output").first


def cell_of(widget):
    return widget.locator("xpath=ancestor::div[contains(@class, 'jp-Cell')][1]")


def screenshots(out_dir: Path) -> list[Path]:
    """The course's home page, the calculator of notebook 01 and the sampling explorer of notebook 04, as the
    README shows them.

    Notebook 04 needs a server: ``llmlab.connect()`` in its kernel starts the embedded one under a
    private LLMLAB_HOME, which is stopped at the end.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    home = tempfile.mkdtemp(prefix="llmlab-screenshots-home-")
    os.environ["LLMLAB_HOME"] = home
    for var in ("LLMLAB_BASE_URL", "LLMLAB_API_KEY", "LLMLAB_API_KEY_FILE", "LLMLAB_CONNECTION_FILE"):
        os.environ.pop(var, None)
    written = []
    try:
        with jupyterlab(course=True) as lab, browser_page(width=1200, height=820) as page:
            page.goto(f"{lab.url}/?token={lab.token}")  # the file browser stays: it shows the course's tree
            link(page, "exercises", within="Memory arithmetic").wait_for()
            time.sleep(2)
            page.screenshot(path=out_dir / "course-home.png")
            written.append(out_dir / "course-home.png")
        with jupyterlab([CALCULATOR, EXPLORER]) as lab, browser_page(width=1200) as page:
            for name, moves, png in [
                (CALCULATOR, lambda w: (choose(w, "model", "llama3.1-405b"), choose(w, "dtype", "fp8"),
                                        set_slider(w, "context", 32768), set_slider(w, "concurrency", 8)),
                 "memory-calculator.png"),
                (EXPLORER, lambda w: (set_slider(w, "temperature", 0.7), set_slider(w, "top_p", 0.9)),
                 "sampling-explorer.png"),
            ]:
                open_and_run(page, lab, name)
                page.evaluate("window.jupyterapp.shell.collapseLeft()")  # the file browser: room for the plot
                widget = interact(page)
                before = output(widget).inner_html()
                moves(widget)
                page.wait_for_function("([el, old]) => el.innerHTML !== old",
                                       arg=[output(widget).element_handle(), before])
                output(widget).locator("img").wait_for()  # both draw a plot: the text first, the plot after it
                page.wait_for_function("el => el.querySelector('img').complete", arg=output(widget).element_handle())
                widget.scroll_into_view_if_needed()
                page.evaluate("el => el.querySelector('img').decode()", output(widget).element_handle())
                time.sleep(2)  # let the browser paint what scrolled into view
                cell_of(widget).screenshot(path=out_dir / png)
                written.append(out_dir / png)
    finally:
        from llmlab.serve import embedded

        embedded.stop_embedded()
        shutil.rmtree(home, ignore_errors=True)
    return written


if __name__ == "__main__":
    reason = skip_reason()
    if reason:
        sys.exit(f"cannot take screenshots: {reason}")
    for path in screenshots(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "img")):
        print(f"wrote {path}")
