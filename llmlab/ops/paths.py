"""The workshop path as notebooks: a lesson's setup cells and the path's sections, and the names they leave undefined.

Why: the home page's 3-hour path says "04 sections 2-4"; a learner who runs only those cells, in a fresh kernel,
must not meet a NameError because section 1 defined ``top``.  ``path_notebook`` cuts exactly what the path says
(the cells before the first ``## `` heading -- title, imports, ``connect()`` -- then each listed section up to the
next ``## `` heading: a numbered one by its number, ``## N.``, another by its heading's text, e.g. "On a real
cluster", the bridge from the tiny model to 70B and 405B), ``undefined_names`` reads those cells as Python and
names what they use but never define, and ``llmlab course --check`` fails on any such name.  The room (issue #36)
executes these very notebooks, one kernel per learner, so the path is both checked statically and run as written.

A cell belongs to the section its ``## `` heading opens, so text above a heading in the same cell moves with it
(issue 51: four takeaways left the path that way): ``buried_headings`` names such cells, and the check fails on
them.  ``reading_words`` is what a learner reads of a cell: HTML comments (the course's markers) and the body of
a collapsed ``<details>`` aside are not on the path's clock.
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
import re
from pathlib import Path

from llmlab.ops.exercises import source_text

# Names a Jupyter kernel defines before the first cell runs.
KERNEL_NAMES = frozenset({"display", "get_ipython", "In", "Out", "exit", "quit", "__file__"}) | set(dir(builtins))


_COMMENT = re.compile(r"<!--.*?-->", re.S)
_DETAILS = re.compile(r"<details>(.*?)</details>", re.S | re.I)
_SUMMARY = re.compile(r"<summary>(.*?)</summary>", re.S | re.I)


Section = int | str  # a lesson's section: the number of a "## N." heading, or the text of another "## " heading


def _section(cell: dict) -> Section | bool:
    """A markdown cell's ``## `` heading: its number for ``## N.``, its text for another ``## `` heading (e.g. "On
    a real cluster"), False for a cell that opens no section."""
    if cell["cell_type"] != "markdown":
        return False
    for line in source_text(cell).splitlines():
        if line.startswith("## "):
            m = re.match(r"## (\d+)\.", line)
            return int(m[1]) if m else line[3:].strip()
    return False


def sections(nb: dict) -> list[Section]:
    """The sections a lesson has, in its order."""
    return [s for c in nb["cells"] if (s := _section(c)) is not False]


def buried_headings(nb: dict) -> list[tuple[int, str]]:
    """(cell index, heading) for each ``## `` heading with text above it in its markdown cell (blank lines and
    HTML comments do not count): that text would go with the heading's section, not the one it ends."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        above = False
        for line in source_text(cell).splitlines():
            if line.startswith("## ") and above:
                out.append((i, line))
            above = above or bool(_COMMENT.sub("", line).strip())
    return out


def reading_words(cell: dict) -> tuple[int, int]:
    """(words a learner reads, words folded away in ``<details>`` asides) of a markdown cell; (0, 0) for code."""
    if cell["cell_type"] != "markdown":
        return 0, 0
    text = _COMMENT.sub("", source_text(cell))
    folded = 0
    for m in _DETAILS.finditer(text):
        summary = _SUMMARY.search(m[1])
        folded += _words(m[1]) - (_words(summary[1]) if summary else 0)
    shown = _DETAILS.sub(lambda m: s[1] if (s := _SUMMARY.search(m[1])) else "", text)
    return _words(shown), folded


def _words(text: str) -> int:
    """Words, not a table's pipes and rules: tokens with a letter or a digit."""
    return sum(1 for w in text.split() if re.search(r"\w", w))


def _cut(nb: dict, heading, wanted: list) -> list[dict]:
    """The setup cells (before the first heading that ``heading`` sees) and the cells under each wanted one, in the
    notebook's order."""
    setup = current = object()
    out = []
    for cell in nb["cells"]:
        found = heading(cell)
        if found is not False:
            current = found
        if current is setup or current in wanted:
            out.append(cell)
    return out


def _copy_with(nb: dict, cells: list[dict]) -> dict:
    cut = copy.deepcopy(nb)
    cut["cells"] = copy.deepcopy(cells)
    return cut


def path_cells(nb: dict, wanted: list[Section]) -> list[dict]:
    """The setup cells (before the first ``## `` heading) and the cells of each listed section."""
    return _cut(nb, _section, wanted)


def path_notebook(nb_path: Path, wanted: list[Section]) -> dict:
    """A copy of the lesson holding only the path's cells (outputs as the lesson has them: stripped in git)."""
    nb = json.loads(Path(nb_path).read_text())
    return _copy_with(nb, path_cells(nb, wanted))


def _exercise(cell: dict) -> int | None | bool:
    """A markdown cell's ``### Exercise N`` heading: N; None for a heading that ends an exercise (a ``## `` one, or
    the course's links at the end); False for a cell that opens nothing."""
    if cell["cell_type"] != "markdown":
        return False
    text = source_text(cell)
    if "llmlab: course links" in text:
        return None
    for line in text.splitlines():
        if m := re.match(r"### Exercise (\d+)", line):
            return int(m[1])
        if line.startswith("## "):
            return None
    return False


def exercise_numbers(nb: dict) -> set[int]:
    """The exercises a solutions notebook holds (its ``### Exercise N`` headings)."""
    return {n for c in nb["cells"] if type(n := _exercise(c)) is int}


def exercises_notebook(nb_path: Path, numbers: list[int]) -> dict:
    """A copy of a solutions notebook holding its setup cells (before the first heading) and the listed exercises:
    what a learner on the path runs after the lesson's sections, as the worked solutions do it."""
    nb = json.loads(Path(nb_path).read_text())
    return _copy_with(nb, _cut(nb, _exercise, numbers))


def _python(cell: dict) -> str:
    """The cell as plain Python: IPython's own transformer turns ``!cmd`` and ``%magic`` lines into calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source_text(cell))


def _bound_and_used(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Every name the code binds anywhere (assignments, imports, defs, parameters, loop and ``with`` targets,
    comprehension variables) and every name it reads."""
    bound, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used


def undefined_names(cells: list[dict]) -> list[tuple[int, str]]:
    """(cell index, name) for each name a code cell reads that neither it nor an earlier cell binds: what would
    stop a fresh kernel with a NameError.  A name bound only later in the same cell is not flagged (rare in a
    lesson, and a test of the cell's own order is nbval's)."""
    known, out = set(KERNEL_NAMES), []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        bound, used = _bound_and_used(ast.parse(_python(cell)))
        out += [(i, name) for name in sorted(used - bound - known)]
        known |= bound
    return out
