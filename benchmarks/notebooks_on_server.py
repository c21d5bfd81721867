"""Run lessons' code cells against whatever server ``llmlab.connect()`` finds, on a machine without Jupyter.

Why: issue 20 asks what the notebooks do against a real GPU server, and the lent GPU machines have no Jupyter
kernel to run nbval with (nothing can be installed there beyond what travels with the call).  This runs each
notebook's code cells in order, in one namespace per notebook, as a kernel would, with matplotlib drawing
nowhere; cells that nbval skips in CI ("cluster-only") run too, since here the cluster's server is present.
It reports, per cell, ok or the exception's last line: a lesson cell that assumes the tiny model shows up as
a failure.  It is a stand-in for a kernel, not a test of the notebook's outputs (nbval in CI does that).

    LLMLAB_CONNECTION_FILE=... python benchmarks/notebooks_on_server.py notebooks/0[2-6]*.ipynb --out report.json
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import inspect
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path


def shell_lines(source: str) -> str:
    """A cell's ``!command {name}`` lines (lessons 08 and 09 run the ``llmlab`` command so) as Python that runs the
    command in a shell, with ``{name}`` filled from the notebook's names as IPython fills it."""
    lines = []
    for line in source.splitlines():
        command = line.lstrip()
        if command.startswith("!"):
            lines.append(f"{line[:len(line) - len(command)]}__shell__(f{command[1:]!r})")
        else:
            lines.append(line)
    return "\n".join(lines)


def _shell(command: str) -> None:
    done = subprocess.run(command, shell=True, capture_output=True, text=True)  # noqa: S602 -- the lesson's line
    print(done.stdout + done.stderr, end="")


def run_notebook(path: Path) -> list[dict]:
    """Every code cell of ``path`` in one namespace; the cell numbers are nbval's (code cells only)."""
    import matplotlib

    matplotlib.use("Agg")
    namespace = {"__name__": "__main__", "display": lambda *args, **kwargs: None, "__shell__": _shell}
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    report = []
    for number, cell in enumerate(cells):
        source = "".join(cell["source"])
        start, printed = time.monotonic(), io.StringIO()
        try:
            code = compile(shell_lines(source), f"{path.name} cell {number}", "exec",
                           flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            with contextlib.redirect_stdout(printed):
                result = eval(code, namespace)  # noqa: S307 -- the lesson's own cell, as a kernel runs it
                if inspect.iscoroutine(result):  # a cell with top-level await, which IPython allows
                    asyncio.run(result)
            status, error = "ok", ""
        except Exception as e:  # noqa: BLE001 -- every failure is a line of the report
            status, error = "failed", "".join(traceback.format_exception_only(e)).strip()[-600:]
        report.append({"cell": number, "status": status, "error": error,
                       "seconds": round(time.monotonic() - start, 2),
                       "first_line": source.splitlines()[0] if source else "", "printed": printed.getvalue()[-400:]})
        last = error.splitlines()[-1] if error else ""
        print(f"{path.name} cell {number:2d}: {status} ({report[-1]['seconds']} s) {last}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="the JSON report")
    a = ap.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    out, paths, results = a.out.resolve(), [p.resolve() for p in a.notebooks], {}
    for path in paths:
        os.chdir(path.parent)  # as Jupyter does: a notebook's relative paths are its folder's
        results[path.name] = run_notebook(path)
        out.write_text(json.dumps(results, indent=1))  # after each notebook: a run cut short keeps what it found
    failed = {name: [c["cell"] for c in cells if c["status"] != "ok"] for name, cells in results.items()}
    print("failed cells:", {k: v for k, v in failed.items() if v} or "none", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
