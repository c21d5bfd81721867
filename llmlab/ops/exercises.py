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


# --- leaks: an exercise's answer printed by its lesson -----------------------------------------------------------
# ``llmlab exercises --leaks build/executed`` (make test, after the lanes) reads the executed copies of every lesson
# and solution, and fails when a number an answer cell (one holding ``# BEGIN SOLUTION``) prints also appears in
# what the same lesson's cells print: then the lesson gave the answer away.

NOT_NUMBERS = re.compile(
    r"\w+://\S+"                                  # URLs: http://127.0.0.1:59301/v1
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"      # addresses: 127.0.0.1:8000
    r"|\blocalhost:\d+"
    r"|\S*[A-Za-z_~.]\S*/\S*|\S*/\S*[A-Za-z_]\S*"  # file paths: /tmp/x/run-1234.log, benchmarks/results/h200-...
)
# A log record (vLLM's engine logs to stdout in a kernel: "INFO 11-27 00:21:17 [model.py:2152] ..."), colours and all
LOG_RECORD = re.compile(r"^.*\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\b.*\[[\w.-]+\.py:\d+\].*$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
NUMBER = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|(?<![\w.,])\d+(?:_\d+)*(?:\.\d+)?")
MIN_SIGNIFICANT = 4
EXERCISE = re.compile(r"^#+\s*(Exercise\s+[\w.]+)", re.M)


def printed(cell: dict) -> str:
    """What a code cell printed: its stdout streams and its results' text/plain (never stderr: engine logs and
    progress bars)."""
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream" and o.get("name") == "stdout":
            out.append(source_text({"source": o.get("text", "")}))
        elif o.get("output_type") in ("execute_result", "display_data"):
            out.append(source_text({"source": o.get("data", {}).get("text/plain", "")}))
    return "\n".join(out)


def numbers(text: str) -> set[str]:
    """The numbers in a text, log records, URLs and paths left out, thousands separators (``,`` and ``_``)
    removed."""
    text = NOT_NUMBERS.sub(" ", LOG_RECORD.sub("", ANSI.sub("", text)))
    return {n.replace(",", "").replace("_", "") for n in NUMBER.findall(text)}


def significant(number: str) -> int:
    """Its significant digits: 1,024,000 has 4, 63.00 has 4, 0.66 has 2."""
    digits = number.replace(".", "").lstrip("0")
    return len(digits if "." in number else digits.rstrip("0"))


def exercise_sections(nb: dict) -> list[tuple[str, list[dict]]]:
    """Each exercise's title ("Exercise 4") and its cells: from its heading to the next exercise's."""
    sections: list[tuple[str, list[dict]]] = []
    for cell in nb["cells"]:
        found = EXERCISE.search(source_text(cell)) if cell["cell_type"] == "markdown" else None
        if found:
            sections.append((found.group(1), []))
        if sections:
            sections[-1][1].append(cell)
    return sections


def leaks(lesson: dict, solution: dict) -> list[tuple[str, str, int]]:
    """(exercise, number, lesson cell) for every number of >= 4 significant digits that an answer cell prints and a
    cell of the lesson prints too, unless the exercise's own text (markdown and sources: the givens) holds it."""
    lesson_cells = [(i, numbers(printed(c))) for i, c in enumerate(lesson["cells"]) if c["cell_type"] == "code"]
    found = []
    for title, cells in exercise_sections(solution):
        givens = set().union(*(numbers(source_text(c)) for c in cells))
        answers = set().union(*(numbers(printed(c)) for c in cells
                                if c["cell_type"] == "code" and BEGIN in source_text(c)))
        for n in sorted(answers - givens):
            if significant(n) >= MIN_SIGNIFICANT:
                found += [(title, n, i) for i, nums in lesson_cells if n in nums]
    return found


def find_leaks(executed: Path) -> tuple[int, list[str]]:
    """Compare every executed solution in ``executed/solutions`` with its lesson in ``executed/notebooks``; return
    how many pairs were compared and one line per leak."""
    pairs, lines = 0, []
    for sol in sorted((executed / "solutions").glob("*.ipynb")):
        les = executed / "notebooks" / sol.name
        if not les.exists():
            continue
        pairs += 1
        for title, n, cell in leaks(json.loads(les.read_text()), json.loads(sol.read_text())):
            lines.append(f"notebooks/{sol.name} cell {cell} prints {n}, the answer of solutions/{sol.name} {title}")
    return pairs, lines
