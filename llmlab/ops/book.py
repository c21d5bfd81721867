"""``make book``: the course as a static site, from the notebooks ``make test`` executed.

Why: notebooks are committed without outputs, so on the repository's web page a reader sees no plot and no
answer.  The book (Sphinx + MyST-NB, settings in ``docs/book/conf.py``) shows what the lessons printed and drew,
so the course can be read without installing anything.  It executes nothing: ``make test`` already ran every
lesson and solution once and kept the executed copies (``build/executed/``, written by ``llmlab.ops.testing``),
with ``keys.sha256``: the digest of every API key an engine of that run made (``llmlab.serve.info.note_key``:
the embedded server's, and every engine, router and replica lessons 11-15 start, wherever its key file was).
A copy that is missing, failed, holds one of those keys, or was executed from other sources than the
repository's is refused with one sentence that names it (never the key).

The sources are staged in a folder of their own (``build/book-src``): the executed lessons and solutions, the
exercises as a learner gets them (unrun), the SLURM guide.  A cell tagged ``cluster-only`` (it needs a GPU
cluster) was skipped by the run and is shown unrun.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from llmlab.ops.exercises import source_text
from llmlab.serve.info import key_digest, noted_keys

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("notebooks", "exercises", "solutions")


EXECUTED = ROOT / "build" / "executed"
KEY_DIGESTS = "keys.sha256"  # beside the executed copies: the digest of every key the run's engines made
KEY_CHARACTERS = re.compile(r"[A-Za-z0-9_-]+")  # what secrets.token_urlsafe and token_hex are made of


class StaleCopy(RuntimeError):
    """An executed copy the book cannot use; the message says which and what to run."""


def stage(dest: Path, root: Path = ROOT, executed: Path = EXECUTED) -> Path:
    """Copy conf.py, index.md, the executed lessons and solutions, the exercises and the SLURM guide to ``dest``
    (emptied first)."""
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
            staged = json.loads(nb.read_text()) if part == "exercises" else executed_copy(nb, root, executed)
            (dest / part / nb.name).write_text(json.dumps(ipython_cells(staged), indent=1))
    return dest


def ipython_cells(nb: dict) -> dict:
    """Name IPython's lexer for the cells, as Jupyter does when it saves a notebook: lessons 08 and 09 run the
    ``llmlab`` command in ``!`` lines, which Sphinx's Python lexer cannot read (a warning, so a failed book)."""
    nb.setdefault("metadata", {}).setdefault("language_info", {})["pygments_lexer"] = "ipython3"
    return nb


def executed_copy(nb: Path, root: Path = ROOT, executed: Path = EXECUTED) -> dict:
    """The executed copy of a repository notebook, checked: present, every cell passed, no key, same sources."""
    rel = nb.relative_to(root)
    copy = executed / rel
    run = "run `make test` (or `make executed`, the notebooks alone) first"
    if not copy.is_file():
        raise StaleCopy(f"{rel} has no executed copy in {executed}: {run}.")
    done = json.loads(copy.read_text())
    meta = done.get("metadata", {}).get("llmlab", {})
    if meta.get("failed") or meta.get("key_found") or meta.get("server") != "embedded":
        why = ("an API key appears in its outputs" if meta.get("key_found") else f"cells {meta['failed']} failed"
               if meta.get("failed") else "it was not executed against the embedded server")
        raise StaleCopy(f"the executed copy of {rel} cannot go into the book: {why}; fix it, then {run}.")
    code = [source_text(c) for c in json.loads(nb.read_text())["cells"]]
    if [source_text(c) for c in done["cells"]] != code:
        raise StaleCopy(f"{rel} changed since it was executed ({meta.get('executed', 'unknown time')}): {run}.")
    if not_run := [t["cell"] for t in meta.get("cells", []) if t["outcome"] == "not run"]:
        raise StaleCopy(f"cells {not_run} of {rel} were not run (a run stopped part-way, or -k chose cells): {run}.")
    if holds_key(page_text(done), run_keys(executed)):
        raise StaleCopy(f"the executed copy of {rel} cannot go into the book: it holds the API key of an engine "
                        f"the run started; fix the cell that prints it, then {run}.")
    return done


def run_keys(executed: Path = EXECUTED) -> dict[int, set[str]]:
    """The digests of every key the run's engines made (``executed/keys.sha256``), by key length.

    Why read at build time, not only the run's verdict in each copy's metadata: the book is what gets published,
    so it checks what it is about to publish against every key, also of engines long stopped."""
    path = executed / KEY_DIGESTS
    if not path.is_file():
        raise StaleCopy(f"{path} is missing: the run kept no record of its engines' keys, so the copies cannot be "
                        "checked for them; run `make test` (or `make executed`) again.")
    return noted_keys(path)


def page_text(nb: dict) -> str:
    """The notebook's JSON without the data of its pictures (base64 of PNGs: seconds of hashing, and no printed
    key hides there); every source, text output, HTML and traceback stays."""
    def text_only(out: dict) -> dict:
        data = {k: v for k, v in out.get("data", {}).items() if not k.startswith("image/") or k.endswith("svg+xml")}
        return {**out, "data": data} if "data" in out else out

    cells = [{**c, "outputs": [text_only(o) for o in c.get("outputs", [])]} for c in nb.get("cells", [])]
    return json.dumps({**nb, "cells": cells})


def holds_key(text: str, digests: dict[int, set[str]]) -> bool:
    """Whether ``text`` holds one of the keys whose ``sha256:`` digests ``digests`` lists by key length.

    Every run of key characters is hashed at each window of a listed length, so a key glued to other letters
    (``key=abc...``, a URL) is found too; the key itself is never needed, only its digest."""
    for run in KEY_CHARACTERS.findall(text):
        for length, known in digests.items():
            if any(key_digest(run[i:i + length]) in known for i in range(len(run) - length + 1)):
                return True
    return False


def build(out: Path = ROOT / "build" / "book", src: Path = ROOT / "build" / "book-src",
          executed: Path = EXECUTED) -> int:
    """Stage the executed copies and run Sphinx (warnings are errors).  Returns Sphinx's exit status (2: a copy
    was refused, with the sentence on stderr); the site is ``out/index.html``."""
    try:
        stage(src, executed=executed)
    except StaleCopy as e:
        print(e, file=sys.stderr)
        return 2
    from sphinx.cmd.build import build_main

    return build_main(["-b", "html", "-W", "--keep-going", str(src), str(out)])  # its progress: a line a page


if __name__ == "__main__":
    status = build()
    if status == 0:
        print(f"the book: {ROOT / 'build' / 'book' / 'index.html'}")
    sys.exit(status)
