"""The course as data: ``llmlab/course.toml`` holds a row per lesson; ``llmlab course`` renders the lists made from it.

Why: a lesson used to be a row kept by hand in eleven places, four of them lists nothing compared (the home page's
map, the README's outline, ``docs/architecture.md``'s topic rows, ``llmlab.check``'s imports).  Now each of those
lists sits between two marker lines and is rendered from the manifest; ``llmlab course --check`` (in ``make
test``) fails when one was edited by hand, and names the file and the line.  The manifest's rows also pick what
``make test-cluster`` executes (``room``) and name the workshop path's sections: ``--check`` fails when a path's
cells use a name they never define (``llmlab.ops.paths``), and ``--path DIR`` writes the path's notebooks, which a
room's learners run.

Adding a lesson: its notebook, solution, module, check module and tests, one ``[[lesson]]`` row, ``llmlab course``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from llmlab.ops import paths
from llmlab.ops.exercises import source_text

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).resolve().parents[1] / "course.toml"
HOME = "notebooks/00_home.ipynb"


class ManifestError(ValueError):
    """The manifest (or the tree it describes) is wrong; the message names the row, the field and the fix."""


@dataclass(frozen=True)
class Lesson:
    number: str
    slug: str
    title: str
    minutes: int
    needs: str
    objectives: str
    summary: str
    topic: str
    module: str
    checks: list[str]
    tests: list[str]
    room: bool
    module_note: str = ""
    notebook_note: str = ""
    engines: list[str] = field(default_factory=list)

    @property
    def stem(self) -> str:
        return f"{self.number}_{self.slug}"

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.stem}.ipynb"

    @property
    def solution(self) -> str:
        return f"solutions/{self.stem}.ipynb"

    @property
    def exercise(self) -> str:
        return f"exercises/{self.stem}.ipynb"


@dataclass(frozen=True)
class Step:
    """One line of a workshop path: a lesson's sections at a time of day, or a break (no lesson)."""
    at: str
    lesson: str = ""
    sections: str = ""
    exercises: str = ""

    def section_numbers(self) -> list[int]:
        """``"1-4, 7"`` -> ``[1, 2, 3, 4, 7]``."""
        return _numbers(self.sections)

    def exercise_numbers(self) -> list[int]:
        """``"Exercises 1-2"`` -> ``[1, 2]``; ``"--"`` -> ``[]``."""
        return _numbers(re.sub(r"^\s*Exercises?\s*|^\s*-+\s*$", "", self.exercises))


def _numbers(text: str) -> list[int]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


@dataclass(frozen=True)
class Course:
    lessons: list[Lesson]
    workshop_title: str
    workshop_end: str
    workshop: list[Step]

    def lesson(self, number: str) -> Lesson:
        for lesson in self.lessons:
            if lesson.number == number:
                return lesson
        raise KeyError(number)

    def room_notebooks(self) -> list[str]:
        """The notebooks and solutions that read the server ``connect()`` finds, and the home page."""
        return [HOME] + [p for ls in self.lessons if ls.room for p in (ls.notebook, ls.solution)]


def _row(cls, raw: dict, where: str):
    """A dataclass from a TOML table; an unknown or missing field is one sentence naming it."""
    known = {f.name: f for f in fields(cls)}
    if unknown := sorted(set(raw) - set(known)):
        raise ManifestError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(known)}.")
    if missing := [n for n, f in known.items() if n not in raw and f.default is MISSING
                   and f.default_factory is MISSING]:
        raise ManifestError(f"{where}: field {missing[0]!r} is missing.")
    return cls(**raw)


def load(path: Path = MANIFEST) -> Course:
    """Read and check the manifest's own consistency (not yet the tree's: see :func:`problems`)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path} is not valid TOML ({e}); fix that line.") from None
    lessons = [_row(Lesson, raw, f"{path}, lesson {i + 1}") for i, raw in enumerate(data.get("lesson", []))]
    numbers = [ls.number for ls in lessons]
    if numbers != sorted(numbers) or len(set(numbers)) != len(numbers):
        raise ManifestError(f"{path}: lesson numbers must be unique and in order; they are {', '.join(numbers)}.")
    ws = data.get("workshop", {})
    steps = [_row(Step, raw, f"{path}, workshop step {i + 1}") for i, raw in enumerate(ws.get("step", []))]
    for st in steps:
        if st.lesson and st.lesson not in numbers:
            raise ManifestError(f"{path}: the workshop step at {st.at} names lesson {st.lesson}, which has no row.")
    return Course(lessons, ws.get("title", "The workshop path"), ws.get("end", ""), steps)


# --- what the manifest renders --------------------------------------------------------------------------------

def _headings(nb_path: Path, level: str) -> list[str]:
    nb = json.loads(nb_path.read_text())
    return [line for c in nb["cells"] if c["cell_type"] == "markdown"
            for line in source_text(c).splitlines() if re.match(rf"{level} ", line)]


def exercise_count(lesson: Lesson, root: Path = ROOT) -> int:
    """How many exercises the solution notebook holds (its ``### Exercise`` headings)."""
    return sum(1 for h in _headings(root / lesson.solution, "#+") if re.match(r"#+ +Exercise\b", h))


def home_map(course: Course, root: Path = ROOT) -> str:
    rows = ["| # | lesson | time | needs | you will be able to |", "|---|---|---|---|---|"]
    for ls in course.lessons:
        label = "exercise" if exercise_count(ls, root) == 1 else "exercises"
        rows.append(f"| {ls.number} | [{ls.title}]({ls.stem}.ipynb) · [{label}](../{ls.exercise}) | "
                    f"{ls.minutes} min | {ls.needs} | {ls.objectives} |")
    hours = sum(ls.minutes for ls in course.lessons) / 60
    rows += ["", f"The full path, for self-study, is every lesson in order with its exercises: about {hours:g} hours."]
    return "\n".join(rows)


def workshop_table(course: Course) -> str:
    rows = [f"## {course.workshop_title}", "",
            "For a workshop of three hours, follow these sections in this order; skip the others (they stay for "
            "later).", "", "| time | lesson | sections | exercise |", "|---|---|---|---|"]
    for st in course.workshop:
        if st.lesson:
            ls = course.lesson(st.lesson)
            rows.append(f"| {st.at} | {ls.number} {ls.title} | {st.sections} | {st.exercises} |")
        else:
            rows.append(f"| {st.at} | break | | |")
    rows.append(f"| {course.workshop_end} | end | | |")
    return "\n".join(rows)


READING_WORDS_PER_MINUTE = 200  # an adult's reading of technical prose, about


def path_load(course: Course, root: Path = ROOT) -> tuple[int, int]:
    """Words of prose and code cells a learner meets on the workshop path (the lessons' sections as the room runs
    them, :func:`write_path`; the exercises come on top): what a realistic timing is made from."""
    words = cells = 0
    for st in course.workshop:
        if st.lesson:
            nb = paths.path_notebook(root / course.lesson(st.lesson).notebook, st.section_numbers())
            words += sum(len(source_text(c).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
            cells += sum(c["cell_type"] == "code" for c in nb["cells"])
    return words, cells


def handout(course: Course, root: Path = ROOT) -> str:
    """The learner's page (docs/handout.md): what to open when, and what the path asks of them in time."""
    rows = ["| time | open | sections | then |", "|---|---|---|---|"]
    for st in course.workshop:
        if st.lesson:
            ls = course.lesson(st.lesson)
            rows.append(f"| {st.at} | [{ls.number} {ls.title}](../{ls.notebook}) | {st.sections} | "
                        f"{st.exercises if st.exercises != '--' else ''} |")
        else:
            rows.append(f"| {st.at} | break | | |")
    rows.append(f"| {course.workshop_end} | end | | |")
    words, cells = path_load(course, root)
    reading = words / READING_WORDS_PER_MINUTE
    rows += ["", f"The path is {words:,} words to read and {cells} code cells to run, besides the exercises: about "
             f"{reading:.0f} minutes of reading alone at {READING_WORDS_PER_MINUTE} words a minute. Taught, with "
             "the instructor talking and questions asked, plan three and a half to four hours, or leave the "
             "exercises for afterwards."]
    return "\n".join(rows)


def readme_outline(course: Course) -> str:
    rows = ["| # | notebook | topic |", "|---|---|---|"]
    rows += [f"| {ls.number} | `{ls.notebook}` | {ls.summary} |" for ls in course.lessons]
    return "\n".join(rows)


def _module_text(ls: Lesson, root: Path) -> str:
    pkg = root / "llmlab" / ls.module
    if pkg.is_dir():
        parts = sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__")
        text = f"`{ls.module}/` ({', '.join(parts)})"
    else:
        text = f"`{ls.module}.py`"
    return f"{text} {ls.module_note}".strip()


def architecture_rows(course: Course, root: Path = ROOT) -> str:
    rows = ["| topic | notebook | lesson module | tests |", "|---|---|---|---|"]
    for ls in course.lessons:
        nb = f"`{ls.stem}` {ls.notebook_note}".strip()
        tests = ", ".join(f"`{t}.py`" for t in ls.tests)
        rows.append(f"| {ls.topic} | {nb} | {_module_text(ls, root)} | {tests} |")
    return "\n".join(rows)


def check_functions(module: str) -> list[str]:
    """The exercise checks a check module defines (its public functions)."""
    mod = importlib.import_module(f"llmlab.check.{module}")
    names = [n for n, o in vars(mod).items()
             if inspect.isfunction(o) and o.__module__ == mod.__name__ and not n.startswith("_")]
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])  # as ruff


def check_imports(course: Course) -> str:
    """``llmlab/check/__init__.py``'s import lines, one check module each, as ruff formats them."""
    lines = []
    for module in sorted({m for ls in course.lessons for m in ls.checks}):
        names = check_functions(module)
        one = f"from llmlab.check.{module} import {', '.join(names)}  # noqa: F401"
        if len(one) <= 120:
            lines.append(one)
        else:
            lines += [f"from llmlab.check.{module} import (  # noqa: F401", *(f"    {n}," for n in names), ")"]
    return "\n".join(lines) + "\n"  # ruff's isort wants a blank line before the end marker


# --- the regions in the tree ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    """A rendered list inside a file, between ``<begin>`` and ``<end>`` lines (in a notebook: inside one cell)."""
    path: str
    name: str
    render: Callable[[Course, Path], str]
    comment: str = "<!-- {} -->"

    @property
    def begin(self) -> str:
        return self.comment.format(f"course:{self.name} (rendered from llmlab/course.toml by `llmlab course`)")

    @property
    def end(self) -> str:
        return self.comment.format(f"/course:{self.name}")


REGIONS = [
    Region(HOME, "map", lambda c, r: home_map(c, r)),
    Region(HOME, "workshop", lambda c, r: workshop_table(c)),
    Region("README.md", "outline", lambda c, r: readme_outline(c)),
    Region("docs/handout.md", "handout", lambda c, r: handout(c, r)),
    Region("docs/architecture.md", "topics", lambda c, r: architecture_rows(c, r)),
    Region("llmlab/check/__init__.py", "checks", lambda c, r: check_imports(c), "# {}"),
]


def _no_markers(region: Region) -> ManifestError:
    return ManifestError(f"{region.path} has no {region.begin!r} ... {region.end!r} lines: put them back around "
                         f"the {region.name} list (or restore the file from git), then run `llmlab course`.")


def _replace(text: str, region: Region, body: str) -> str:
    start, stop = text.find(region.begin), text.find(region.end)
    if start < 0 or stop < start:
        raise _no_markers(region)
    return text[:start] + region.begin + "\n" + body + "\n" + text[stop:]


def _render_file(path: Path, regions: list[Region], course: Course, root: Path) -> str:
    """The file's text with every region rendered (a notebook's cells are edited as JSON, one cell each)."""
    text = path.read_text()
    if path.suffix != ".ipynb":
        for region in regions:
            text = _replace(text, region, region.render(course, root))
        return text
    nb = json.loads(text)
    for region in regions:
        cells = [c for c in nb["cells"] if region.begin in source_text(c)]
        if not cells:
            raise _no_markers(region)
        cells[0]["source"] = _replace(source_text(cells[0]), region, region.render(course, root)).splitlines(True)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def problems(course: Course, root: Path = ROOT) -> list[str]:
    """What in the tree disagrees with the manifest: a file a row names that is missing, a lesson without a row,
    a workshop section the lesson does not have."""
    out = []
    listed = {ls.notebook for ls in course.lessons} | {HOME}
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        if f"notebooks/{nb.name}" not in listed:
            out.append(f"notebooks/{nb.name} has no row in llmlab/course.toml: add one ([[lesson]]).")
    tests = {p.stem for p in (root / "tests").rglob("test_*.py")}
    for ls in course.lessons:
        for path in (ls.notebook, ls.solution, ls.exercise):
            if not (root / path).is_file():
                out.append(f"lesson {ls.number}: {path} does not exist.")
        if not ((root / "llmlab" / f"{ls.module}.py").is_file() or (root / "llmlab" / ls.module).is_dir()):
            out.append(f"lesson {ls.number}: module {ls.module!r} is neither llmlab/{ls.module}.py nor a package.")
        out += [f"lesson {ls.number}: check module llmlab/check/{c}.py does not exist." for c in ls.checks
                if not (root / "llmlab" / "check" / f"{c}.py").is_file()]
        out += [f"lesson {ls.number}: test module {t}.py is not under tests/." for t in ls.tests if t not in tests]
    for st in course.workshop:
        if st.lesson and (root / course.lesson(st.lesson).notebook).is_file():
            have = {int(m[1]) for h in _headings(root / course.lesson(st.lesson).notebook, "##")
                    if (m := re.match(r"## (\d+)\.", h))}
            out += [f"the workshop step at {st.at}: lesson {st.lesson} has no section {n} (its '## {n}.' heading)."
                    for n in st.section_numbers() if n not in have]
            solution = root / course.lesson(st.lesson).solution
            if solution.is_file():
                have = paths.exercise_numbers(json.loads(solution.read_text()))
                out += [f"the workshop step at {st.at}: {course.lesson(st.lesson).solution} has no Exercise {n} (its "
                        f"'### Exercise {n}' heading)." for n in st.exercise_numbers() if n not in have]
                cells = paths.exercises_notebook(solution, st.exercise_numbers())["cells"]
                out += [f"the workshop step at {st.at}: lesson {st.lesson}'s {st.exercises} use {name!r} (cell {i + 1} "
                        "of the exercises a room runs) but never define it: define it in the solution's setup cells."
                        for i, name in paths.undefined_names(cells)]
            cells = paths.path_notebook(root / course.lesson(st.lesson).notebook, st.section_numbers())["cells"]
            out += [f"the workshop step at {st.at}: lesson {st.lesson}'s sections {st.sections} use {name!r} (cell "
                    f"{i + 1} of the path) but never define it, so a learner meets a NameError: add the section that "
                    "defines it to the path, or define it in the lesson's setup cells."
                    for i, name in paths.undefined_names(cells)]
    return out


def write_path(course: Course, out: Path, root: Path = ROOT, exercises: bool = False) -> list[Path]:
    """The workshop path's notebooks, one per lesson step, under ``out`` (what each learner of a room runs).
    ``exercises``: after each lesson, its path exercises as the worked solutions do them (``NN_slug.exercises``):
    a rehearsed room then shows what the room's progress view shows on the day, exercises passed."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for st in course.workshop:
        if st.lesson:
            ls = course.lesson(st.lesson)
            written.append(_write(out / Path(ls.notebook).name,
                                  paths.path_notebook(root / ls.notebook, st.section_numbers())))
            if exercises and st.exercise_numbers():
                written.append(_write(out / f"{Path(ls.notebook).stem}.exercises.ipynb",
                                      paths.exercises_notebook(root / ls.solution, st.exercise_numbers())))
    return written


def path_lessons(course: Course | None = None) -> list[str]:
    """The workshop path's lessons (notebook stems), in its order: the columns of the room's progress view."""
    course = course or load()
    return list(dict.fromkeys(Path(course.lesson(st.lesson).notebook).stem for st in course.workshop if st.lesson))


def _write(file: Path, nb: dict) -> Path:
    file.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return file


def sync(root: Path = ROOT, check: bool = False, manifest: Path = MANIFEST) -> list[str]:
    """Render every region.  ``check``: write nothing, return one message per file that differs (with the first
    differing line) and per problem of :func:`problems`; otherwise write the files and return those problems."""
    course = load(manifest)
    out = problems(course, root)
    for path in dict.fromkeys(r.path for r in REGIONS):
        file = root / path
        new = _render_file(file, [r for r in REGIONS if r.path == path], course, root)
        old = file.read_text()
        if new == old:
            continue
        if not check:
            file.write_text(new)
            continue
        diff = [d for d in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
                if d[:1] in "+-" and not d.startswith(("+++", "---"))]
        out.append(f"{path} differs from llmlab/course.toml (edit the manifest, then run `llmlab course`): "
                   f"{diff[0][:160] if diff else 'whitespace'}")
    return out
