"""``make book``: the course as a static site, every lesson executed against the embedded server.

Why: notebooks are committed without outputs, so on the repository's web page a reader sees no plot and no
answer.  The book runs them (Sphinx + MyST-NB, settings in ``docs/book/conf.py``) and keeps what they printed
and drew, so the course can be read without installing anything.

The sources are staged in a folder of their own (``build/book-src``): the three course folders as they are,
with one change -- a cell tagged ``cluster-only`` (it needs a GPU cluster; nbval skips it the same way) gets
MyST-NB's ``skip-execution`` tag, and is shown unrun.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from llmlab.ops.testing import CLUSTER_ONLY  # the tag nbval skips; the book shows those cells unrun

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("notebooks", "exercises", "solutions")


def stage(dest: Path, root: Path = ROOT) -> Path:
    """Copy conf.py, index.md, the course's folders and the SLURM guide to ``dest`` (emptied first)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("conf.py", "index.md"):
        shutil.copy(root / "docs" / "book" / name, dest / name)
    (dest / "slurm").mkdir()  # the lessons link to the SLURM guide: it is a page of the book too
    shutil.copy(root / "slurm" / "README.md", dest / "slurm" / "README.md")
    for part in PARTS:
        (dest / part).mkdir()
        for nb in sorted((root / part).glob("*.ipynb")):
            (dest / part / nb.name).write_text(json.dumps(_skip_cluster_cells(json.loads(nb.read_text())), indent=1))
    return dest


def _skip_cluster_cells(nb: dict) -> dict:
    for cell in nb["cells"]:
        tags = cell.setdefault("metadata", {}).get("tags", [])
        if CLUSTER_ONLY in tags and "skip-execution" not in tags:
            cell["metadata"]["tags"] = [*tags, "skip-execution"]
    return nb


def build(out: Path = ROOT / "build" / "book", src: Path = ROOT / "build" / "book-src") -> int:
    """Stage, start the embedded server unless one runs, run Sphinx (warnings are errors), stop what was started.
    Returns Sphinx's exit status; the site is ``out/index.html``."""
    from sphinx.cmd.build import build_main

    from llmlab.serve import embedded

    stage(src)
    started = embedded.embedded_status() is None
    try:
        key = embedded.ensure_embedded().key()
        status = build_main(["-b", "html", "-W", "--keep-going", str(src), str(out)])  # its progress: a line a page
    finally:
        if started:
            embedded.stop_embedded()
    leaked = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and key.encode() in p.read_bytes())
    if leaked:  # a site is public: an output that printed the server's key must never reach it
        print(f"the server's API key appears in {', '.join(leaked)}: fix the cell that prints it.", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    status = build()
    if status == 0:
        print(f"the book: {ROOT / 'build' / 'book' / 'index.html'}")
    sys.exit(status)
