"""Generate ``exercises/`` from ``solutions/``: ``llmlab exercises`` (``--check`` to detect drift).

Why one source: an exercise notebook and its solution drift apart the moment they are edited
separately.  So only ``solutions/`` is edited; in every code cell, the lines between ``# BEGIN SOLUTION``
and ``# END SOLUTION`` are replaced by a prompt for the learner, outputs are stripped, and the result is
written to ``exercises/``.  CI regenerates and fails if the committed exercises differ.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
PLACEHOLDER = ["# YOUR CODE HERE", "raise NotImplementedError()"]


def strip_solution(source: str) -> str:
    """Replace each BEGIN/END SOLUTION block (markers included) with the placeholder, same indentation."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + p for p in PLACEHOLDER]
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "\n".join(out)


def source_text(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def to_exercise(nb: dict, name: str = "notebook") -> dict:
    """Return the exercise version of a solution notebook (a new dict; outputs stripped)."""
    nb = json.loads(json.dumps(nb))
    solved = 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = source_text(cell)
        try:
            new = strip_solution(src)
        except ValueError as e:
            raise ValueError(f"{name}, cell {i}: {e}") from None
        solved += new != src
        cell["source"] = new
        cell["outputs"], cell["execution_count"] = [], None
    if not solved:
        raise ValueError(f"{name} has no '{BEGIN}' block: it is not an exercise")
    return nb


def dumps(nb: dict) -> str:
    """Serialise exactly as Jupyter and nbformat do, so a saved notebook does not show as drift."""
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def generate(solutions: Path = Path("solutions"), exercises: Path = Path("exercises"),
             check: bool = False) -> list[str]:
    """Write (or, with ``check``, compare) every exercise; return the names that differ (or were written)."""
    exercises.mkdir(exist_ok=True)
    changed = []
    for sol in sorted(solutions.glob("*.ipynb")):
        text = dumps(to_exercise(json.loads(sol.read_text()), sol.name))
        target = exercises / sol.name
        if not target.exists() or target.read_text() != text:
            changed.append(sol.name)
            if not check:
                target.write_text(text)
    stale = sorted({p.name for p in exercises.glob("*.ipynb")} - {p.name for p in solutions.glob("*.ipynb")})
    for name in stale:
        changed.append(f"{name} (no solution)")
        if not check:
            (exercises / name).unlink()
    return changed


PATTERN_CHECK = re.compile(r"llmlab\.check\.\w+\(")


def check_calls(nb: dict) -> int:
    """How many cells call ``llmlab.check.*`` (every exercise notebook needs at least one)."""
    return sum(bool(PATTERN_CHECK.search(source_text(c))) for c in nb["cells"] if c["cell_type"] == "code")
