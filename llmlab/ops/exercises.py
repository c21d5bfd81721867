"""Generate ``exercises/`` from ``solutions/``: ``llmlab exercises`` (``--check`` to detect drift).

Why one source: an exercise notebook and its solution drift apart the moment they are edited
separately.  So only ``solutions/`` is edited; in every code cell, the lines between ``# BEGIN SOLUTION``
and ``# END SOLUTION`` are replaced by a prompt for the learner, outputs are stripped, and the result is
written to ``exercises/``.  CI regenerates and fails if the committed exercises differ.
"""

from __future__ import annotations

import json
import math
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
# what the same lesson's cells print, or the solution's cells outside that exercise: then the learner has it
# before working it out.  Three ways to print it: the same digits (4 significant or more); the same quantity in
# another unit of its family within ``TOLERANCE``, the most any check accepts (llmlab/check/disagg.py's 1 %):
# 2,684,354,560 B printed as "2,560.0 MiB" or "2.5 GiB", 0.0537 s as "54 ms", 6.96 GB/s as "7.0 GB/s"; or, without
# a unit, rounded to 3 significant digits or more ("53.7" for 53.687).  A check that accepts the figure the lesson
# printed has been answered by the lesson (issue 48: lesson 18's three exercises).  Without a unit only an exact
# rounding counts: lessons print timings that move from run to run, and one near an answer by chance is no leak.

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

TOLERANCE = 0.01        # the widest tolerance of a check (check/disagg.py's _near): a figure this close is accepted
MIN_ROUNDED = 4         # an answer printed with fewer digits (60.5, 0.5) is too common a number to match loosely
# Each unit's size in its family's base; a figure printed with one may be the answer in any other of the family.
UNITS = {"bytes": {"B": 1, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
                   "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40},
         "seconds": {"s": 1, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9, "min": 60},
         "bytes/s": {"B/s": 1, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "MiB/s": 2**20, "GiB/s": 2**30,
                     "Gbit/s": 1.25e8, "Gb/s": 1.25e8},
         "FLOP": {"FLOP": 1, "GFLOP": 1e9, "TFLOP": 1e12, "PFLOP": 1e15},
         "FLOP/s": {"FLOP/s": 1, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "TFLOPS": 1e12, "PFLOP/s": 1e15},
         "share": {"%": 0.01}}
UNIT_OF = {u: family for family, units in UNITS.items() for u in units}
SLASH = "\u2044"  # a rate's "/" while paths are dropped (NOT_NUMBERS would take "GB/s" for one)
WITH_UNIT = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|\d+(?:_\d+)*(?:\.\d+)?)[ \u202f]?("
                       + "|".join(re.escape(u.replace("/", SLASH)) for u in sorted(UNIT_OF, key=len, reverse=True))
                       + r")(?![\w/\u2044])")


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


def _clean(text: str) -> str:
    return NOT_NUMBERS.sub(" ", LOG_RECORD.sub("", ANSI.sub("", text)))


def numbers(text: str) -> set[str]:
    """The numbers in a text, log records, URLs and paths left out, thousands separators (``,`` and ``_``)
    removed."""
    return {n.replace(",", "").replace("_", "") for n in NUMBER.findall(_clean(text))}


def figures(text: str) -> set[tuple[str, str | None]]:
    """The numbers of :func:`numbers` with the unit printed after each, if it is one of :data:`UNITS`
    (``("2560.0", "MiB")``), else ``None``."""
    for unit in UNIT_OF:
        if "/" in unit:
            text = re.sub(rf"(?<=[\d ]){re.escape(unit)}(?![\w/])", unit.replace("/", SLASH), text)
    text = _clean(text)
    with_unit = {(m.group(1).replace(",", "").replace("_", ""), m.group(2).replace(SLASH, "/"))
                 for m in WITH_UNIT.finditer(text)}
    bare = {(n.replace(",", "").replace("_", ""), None) for n in NUMBER.findall(text)}
    return with_unit | {f for f in bare if f[0] not in {n for n, _ in with_unit}}


def significant(number: str) -> int:
    """Its significant digits: 1,024,000 has 4, 63.00 has 4, 0.66 has 2."""
    digits = number.replace(".", "").lstrip("0")
    return len(digits if "." in number else digits.rstrip("0"))


def _rounded(value: float, digits: int) -> float:
    """``value`` rounded to ``digits`` significant digits (53.687, 3 -> 53.7)."""
    return float(f"{value:.{digits}g}") if value else 0.0


def _gives(figure: tuple[str, str | None], answer: str) -> bool:
    """Whether a printed figure gives ``answer`` away, as a check would accept it:

    - the same digits, at least :data:`MIN_SIGNIFICANT` of them;
    - the same quantity in a unit of its family ("2.5 GiB", "53.7 ms", "7.0 GB/s": 2 significant digits or more),
      within :data:`TOLERANCE`, or exactly for a whole-number answer (bytes and tokens are checked to the unit);
    - without a unit, the answer rounded to the figure's 3 or more significant digits ("53.7" for 53.687).  A figure
      with no fraction ("296", "296.0") is a count (steps, gaps), and a whole-number answer is never accepted
      rounded, so neither counts here.

    Only an answer printed with :data:`MIN_ROUNDED` significant digits or more can be matched by a rounding."""
    number, unit = figure
    if number == answer:
        return significant(answer) >= MIN_SIGNIFICANT
    digits, value, want, whole = significant(number), float(number), float(answer), "." not in answer
    if significant(answer) < MIN_ROUNDED or want == 0:
        return False
    if unit is not None:
        family = UNITS[UNIT_OF[unit]]
        return digits >= 2 and any(abs(value * family[unit] / size - want) < 0.5 if whole
                                   else math.isclose(value * family[unit] / size, want, rel_tol=TOLERANCE)
                                   for size in family.values())
    fraction = number.partition(".")[2].strip("0")
    return (not whole and bool(fraction) and 3 <= digits < significant(answer)
            and math.isclose(value, _rounded(want, digits), rel_tol=1e-9))


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


def leaks(lesson: dict, solution: dict) -> list[tuple[str, str, int | str, str]]:
    """(exercise, answer, where, shown) for every number an answer cell prints that a cell of the lesson
    (``where``: its index) or of the solution outside that exercise (``where``: ``"solution cell N"``) gives away
    (:func:`_gives`; ``shown``: the figure it printed, "2.5 GiB"), unless the exercise's own text (markdown and
    sources: the givens) holds it."""
    elsewhere = [(i, figures(printed(c))) for i, c in enumerate(lesson["cells"]) if c["cell_type"] == "code"]
    found = []
    for title, cells in exercise_sections(solution):
        givens = set().union(*(numbers(source_text(c)) for c in cells))
        answers = set().union(*(numbers(printed(c)) for c in cells
                                if c["cell_type"] == "code" and BEGIN in source_text(c)))
        own = {id(c) for c in cells}
        others = [(f"solution cell {i}", figures(printed(c))) for i, c in enumerate(solution["cells"])
                  if c["cell_type"] == "code" and id(c) not in own]
        for n in sorted(answers - givens):
            for where, printed_there in elsewhere + others:
                shown = sorted(" ".join(filter(None, f)) for f in printed_there if _gives(f, n))
                if shown:
                    found.append((title, n, where, shown[0]))
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
        for title, n, cell, shown in leaks(json.loads(les.read_text()), json.loads(sol.read_text())):
            where = f"solutions/{sol.name} {cell}" if isinstance(cell, str) else f"notebooks/{sol.name} cell {cell}"
            lines.append(f"{where} prints {shown}, the answer of solutions/{sol.name} {title} ({n})")
    return pairs, lines
