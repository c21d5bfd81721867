"""The course as data: ``llmlab/course.toml`` holds a row per lesson; ``llmlab course`` renders the lists made from it.

Why: a lesson used to be a row kept by hand in eleven places, four of them lists nothing compared (the home page's
map, the README's outline, ``docs/architecture.md``'s topic rows, ``llmlab.check``'s imports).  Now each of those
lists sits between two marker lines and is rendered from the manifest; ``llmlab course --check`` (in ``make
test``) fails when one was edited by hand, and names the file and the line.  The manifest's rows also pick what
``make test-cluster`` executes (``room``) and name the workshop path's sections: ``--check`` fails when a path's
cells use a name they never define (``llmlab.ops.paths``), and ``--path DIR`` writes the path's notebooks, which a
room's learners run.

The path's times are computed, not typed (issue 51: a path typed as fitting three hours took 3 h 30 to 4 h 10 once
a newcomer read it): each step's minutes come from its cells at the manifest's pace (words read, code cells run,
lines of an answer written), ``llmlab course`` prints them against each step's slot, and each path lesson's first
cell carries a banner rendered from its step (what of it is on the path), checked like the other lists.

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
from llmlab.ops.exercises import BEGIN, END, source_text

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
    """One step of a workshop path: the instructor's ``talk``, then a lesson's sections and exercises in ``slot``
    minutes of the learners' own; a step with no lesson is a break (its slot is the break)."""
    slot: int
    lesson: str = ""
    sections: str = ""
    exercises: str = ""
    talk: int = 0

    def section_list(self) -> list[paths.Section]:
        """``"1-4, 7, On a real cluster"`` -> ``[1, 2, 3, 4, 7, "On a real cluster"]``: numbers for ``## N.``
        sections, a heading's text for the others."""
        out = []
        for part in filter(None, (p.strip() for p in self.sections.split(","))):
            out += _numbers(part) if re.fullmatch(r"\d+(\s*-\s*\d+)?", part) else [part]
        return out

    def sections_text(self) -> str:
        """The sections as a learner reads them: ``1, 4, 5 and "On a real cluster"``."""
        shown = [p if re.fullmatch(r"[\d\s-]+", p) else f'"{p}"'
                 for p in (p.strip() for p in self.sections.split(",")) if p]
        return ", ".join(shown[:-1]) + " and " + shown[-1] if len(shown) > 1 else shown[0]

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
class Pace:
    """How the path's minutes are computed from its cells (the ``[workshop]`` table's figures; see its comment)."""
    taught: int = 180                    # the class, talk and break included
    words_per_minute: int = 130          # dense technical prose, read by a newcomer
    code_cell_minutes: float = 0.75      # read a cell, run it, look at what it printed
    written_line_minutes: float = 1.5    # a line of an exercise's answer: write it, run the check, read its hint


@dataclass(frozen=True)
class Course:
    lessons: list[Lesson]
    workshop_title: str
    workshop: list[Step]
    pace: Pace = field(default_factory=Pace)

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
    ws = dict(data.get("workshop", {}))
    steps = [_row(Step, raw, f"{path}, workshop step {i + 1}") for i, raw in enumerate(ws.pop("step", []))]
    for i, st in enumerate(steps):
        if st.lesson and st.lesson not in numbers:
            raise ManifestError(f"{path}: workshop step {i + 1} names lesson {st.lesson}, which has no row.")
    title = ws.pop("title", "The workshop path")
    return Course(lessons, title, steps, _row(Pace, ws, f"{path}, [workshop]"))


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


def clock(minutes: float) -> str:
    """Minutes from the class's start as a time of day on a clock that starts at 0:00."""
    return f"{int(minutes) // 60}:{int(minutes) % 60:02d}"


def schedule(course: Course) -> list[tuple[int, Step]]:
    """Each step with its start, in minutes from the class's start: its talk, then its slot (times are computed,
    so a longer slot moves every step after it)."""
    out, at = [], 0
    for st in course.workshop:
        out.append((at, st))
        at += st.talk + st.slot
    return out


def taught_minutes(course: Course) -> int:
    """The class as the manifest plans it: every step's talk and slot, and the breaks."""
    return sum(st.talk + st.slot for st in course.workshop)


@dataclass(frozen=True)
class StepTime:
    """What a path step asks of a learner, counted from its cells, and the minutes that makes at the manifest's pace
    (the words folded into ``<details>`` asides are counted apart: they are not on the path's clock)."""
    words: int
    folded: int
    code_cells: int
    exercise_words: int
    exercise_cells: int
    written_lines: int
    minutes: float


def _written_lines(cell: dict) -> int:
    """Lines of an answer the learner writes: code between the solution's markers (not blank, not a comment)."""
    lines, inside = 0, False
    for line in source_text(cell).splitlines():
        s = line.strip()
        if s in (BEGIN, END):
            inside = s == BEGIN
        elif inside and s and not s.startswith("#"):
            lines += 1
    return lines


def step_time(course: Course, st: Step, root: Path = ROOT) -> StepTime:
    """Count a lesson step's path cells (:func:`paths.path_notebook`) and its path exercises (as the solutions hold
    them) and turn them into minutes: reading at ``words_per_minute``, every code cell at ``code_cell_minutes``,
    every line of an answer at ``written_line_minutes``."""
    ls, pace = course.lesson(st.lesson), course.pace
    lesson = paths.path_notebook(root / ls.notebook, st.section_list())["cells"]
    ex = (paths.exercises_notebook(root / ls.solution, st.exercise_numbers())["cells"]
          if st.exercise_numbers() and (root / ls.solution).is_file() else [])
    words = [paths.reading_words(c) for c in lesson]
    ex_words = sum(paths.reading_words(c)[0] for c in ex)
    code = sum(c["cell_type"] == "code" for c in lesson)
    ex_code = sum(c["cell_type"] == "code" for c in ex)
    written = sum(_written_lines(c) for c in ex if c["cell_type"] == "code")
    read = sum(w for w, _ in words)
    minutes = ((read + ex_words) / pace.words_per_minute + (code + ex_code) * pace.code_cell_minutes
               + written * pace.written_line_minutes)
    return StepTime(read, sum(f for _, f in words), code, ex_words, ex_code, written, minutes)


def _path_rows(course: Course, root: Path, notebooks: str) -> list[str]:
    """The path's steps as table rows: start, lesson (a link, ``notebooks`` being the way from the page to the
    lessons), sections, exercises (a link), slot; then the end and what the class and a learner alone take."""
    rows = ["| time | lesson | sections | then | your minutes |", "|---|---|---|---|---|"]
    for at, st in schedule(course):
        if st.lesson:
            ls = course.lesson(st.lesson)
            then = f"[{st.exercises}](../{ls.exercise})" if st.exercise_numbers() else ""
            rows.append(f"| {clock(at)} | [{ls.number} {ls.title}]({notebooks}{ls.stem}.ipynb) | "
                        f"{st.sections_text()} | {then} | {st.slot} |")
        else:
            rows.append(f"| {clock(at)} | break | | | {st.slot} |")
    talk = sum(st.talk for st in course.workshop)
    pause = sum(st.slot for st in course.workshop if not st.lesson)
    own = sum(step_time(course, st, root).minutes for st in course.workshop if st.lesson)
    pace = course.pace
    return rows + [f"| {clock(taught_minutes(course))} | end | | | |", "",
                   f"Taught, the path is a class of {taught_minutes(course) / 60:g} hours: {talk} minutes of the "
                   f"instructor's talk between the steps, a {pause}-minute break, and each step's minutes of your "
                   f"own. Alone, at your own pace, it takes about {5 * round(own / 5)} minutes (reading at "
                   f"{pace.words_per_minute} words a minute, {pace.code_cell_minutes:g} min a code cell, "
                   f"{pace.written_line_minutes:g} min a line of an answer)."]


def workshop_table(course: Course, root: Path = ROOT) -> str:
    """The home page's path: each step's lesson and exercises as links (they open in JupyterLab), its minutes."""
    return "\n".join([f"## {course.workshop_title}", "",
                      "For a workshop of three hours, open each step's lesson and run the sections named here, in "
                      "this order (the lesson's first cell names them too); skip the others: they stay for later.",
                      "", *_path_rows(course, root, "")])


def handout(course: Course, root: Path = ROOT) -> str:
    """The learner's page (docs/handout.md): what to open when, and what the path asks of them in time."""
    return "\n".join(_path_rows(course, root, "../notebooks/"))


def timing(course: Course, root: Path = ROOT) -> str:
    """The path's table for the instructor (``llmlab course`` prints it): each step's counts, computed minutes and
    slot, the class's total and the self-paced time."""
    pace = course.pace
    rows = [f"{course.workshop_title}: minutes computed at {pace.words_per_minute} words a minute, "
            f"{pace.code_cell_minutes:g} min a code cell, {pace.written_line_minutes:g} min a line of an answer",
            f"{'start':>5}  {'step':<28} {'words':>6} {'folded':>6} {'cells':>5} {'ex.words':>8} {'ex.cells':>8} "
            f"{'lines':>5} {'computed':>8} {'slot':>4} {'talk':>4}"]
    own = 0.0
    for at, st in schedule(course):
        if not st.lesson:
            rows.append(f"{clock(at):>5}  {'break':<28} {'':>6} {'':>6} {'':>5} {'':>8} {'':>8} {'':>5} {'':>8} "
                        f"{st.slot:>4} {st.talk:>4}")
            continue
        ls, tm = course.lesson(st.lesson), step_time(course, st, root)
        own += tm.minutes
        flag = "  OVER" if tm.minutes > st.slot else ""
        rows.append(f"{clock(at):>5}  {(ls.number + ' ' + ls.title)[:28]:<28} {tm.words:>6,} {tm.folded:>6,} "
                    f"{tm.code_cells:>5} {tm.exercise_words:>8} {tm.exercise_cells:>8} {tm.written_lines:>5} "
                    f"{tm.minutes:>8.1f} {st.slot:>4} {st.talk:>4}{flag}")
    slots = sum(st.slot for st in course.workshop if st.lesson)
    talk = sum(st.talk for st in course.workshop)
    rows.append(f"taught: {taught_minutes(course)} of {pace.taught} min ({talk} talk, "
                f"{sum(st.slot for st in course.workshop if not st.lesson)} break, {slots} in the steps' slots); "
                f"self-paced: {own:.0f} min of the learner's own (no talk, no break)")
    return "\n".join(rows)


def banner(course: Course, lesson: Lesson) -> str | None:
    """The line a path lesson's first cell carries (rendered, like the home page's table): which of its sections
    and exercises are on the path; None for a lesson off the path."""
    steps = [(at, st) for at, st in schedule(course) if st.lesson == lesson.number]
    if not steps:
        return None
    at, st = steps[0]
    lessons = [s for s in course.workshop if s.lesson]
    then = f", then {st.exercises} in [its exercises](../{lesson.exercise})" if st.exercise_numbers() else ""
    many = len(st.section_list()) > 1
    step = lessons.index(st)
    after = course.lesson(lessons[step + 1].lesson) if step + 1 < len(lessons) else None
    # the path is not in the lessons' order (00, 03, 01, ...): the closing "Next:" cell follows the numbers
    nxt = f"next on the path: [{after.number} {after.title}]({after.stem}.ipynb)" if after else "the path ends here"
    return (f"> **On the 3-hour path** (step {step + 1} of {len(lessons)}, "
            f"{clock(at)}-{clock(at + st.talk + st.slot)}, {st.slot} minutes of your own): section"
            f"{'s' if many else ''} {st.sections_text()}{then}. The other sections stay for later; {nxt}.")


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
    Region(HOME, "workshop", lambda c, r: workshop_table(c, r)),
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
    a workshop section the lesson does not have, a path step whose cells need more minutes than its slot, a
    heading with text above it in its cell."""
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
    for at, st in schedule(course):
        if st.lesson and (root / course.lesson(st.lesson).notebook).is_file():
            out += _step_problems(course, at, st, root)
    out += overruns(course, root)
    for part in ("notebooks", "solutions"):
        for nb in sorted((root / part).glob("*.ipynb")):
            out += [f"{part}/{nb.name}, cell {i}: the heading {line!r} has text above it in its cell, so that text "
                    "goes with the heading's section (and off a path that skips it): split the cell at the heading."
                    for i, line in paths.buried_headings(json.loads(nb.read_text()))]
    return out


def _step_problems(course: Course, at: int, st: Step, root: Path) -> list[str]:
    """A path step's sections and exercises that the lesson lacks, names they use but never define, and computed
    minutes over the slot."""
    ls = course.lesson(st.lesson)
    name = f"the workshop step at {clock(at)} ({ls.number} {ls.title})"
    have = paths.sections(json.loads((root / ls.notebook).read_text()))
    out = [f"{name}: {ls.notebook} has no section {s!r} (its '## {s}.' heading)." if isinstance(s, int) else
           f"{name}: {ls.notebook} has no section {s!r} (a '## {s}' heading)." for s in st.section_list()
           if s not in have]
    solution = root / ls.solution
    if solution.is_file():
        have = paths.exercise_numbers(json.loads(solution.read_text()))
        out += [f"{name}: {ls.solution} has no Exercise {n} (its '### Exercise {n}' heading)."
                for n in st.exercise_numbers() if n not in have]
        cells = paths.exercises_notebook(solution, st.exercise_numbers())["cells"]
        out += [f"{name}: lesson {st.lesson}'s {st.exercises} use {n!r} (cell {i + 1} of the exercises a room runs) "
                "but never define it: define it in the solution's setup cells."
                for i, n in paths.undefined_names(cells)]
    cells = paths.path_notebook(root / ls.notebook, st.section_list())["cells"]
    out += [f"{name}: lesson {st.lesson}'s sections {st.sections} use {n!r} (cell {i + 1} of the path) but never "
            "define it, so a learner meets a NameError: add the section that defines it to the path, or define it "
            "in the lesson's setup cells." for i, n in paths.undefined_names(cells)]
    return out


def overruns(course: Course, root: Path = ROOT) -> list[str]:
    """The path's steps whose cells need more minutes than their slot, and talk, slots and breaks over the class."""
    out = []
    for at, st in schedule(course):
        if st.lesson and (tm := step_time(course, st, root)).minutes > st.slot:
            ls = course.lesson(st.lesson)
            out.append(f"the workshop step at {clock(at)} ({ls.number} {ls.title}): its cells compute to "
                       f"{tm.minutes:.1f} min ({tm.words:,} words, {tm.code_cells} code cells, then "
                       f"{tm.exercise_words} words, {tm.exercise_cells} code cells and {tm.written_lines} lines to "
                       f"write in {st.exercises}), {tm.minutes - st.slot:.1f} over its slot of {st.slot}: fold "
                       "asides into <details>, move text off the path's sections, or give the step a longer slot.")
    if taught_minutes(course) > course.pace.taught:
        out.append(f"the workshop's talk, slots and breaks add up to {taught_minutes(course)} min, more than the "
                   f"taught class of {course.pace.taught}: shorten a slot or a talk in llmlab/course.toml.")
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
                                  paths.path_notebook(root / ls.notebook, st.section_list())))
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


BANNER = Region("", "path", lambda c, r: "")  # its markers; each lesson's body is :func:`banner`'s line


def _with_banner(path: Path, line: str | None) -> str:
    """A lesson's text with its path banner set to ``line`` in its first cell, under the title (the markers are put
    there if missing), or taken out (``None``: a lesson off the path)."""
    nb = json.loads(path.read_text())
    first = nb["cells"][0]
    if first["cell_type"] != "markdown":
        raise ManifestError(f"{path.name}'s first cell is code: a lesson opens with its title, a markdown cell that "
                            "also carries its path banner; put the title back first.")
    text = source_text(first)
    start, stop = text.find(BANNER.begin), text.find(BANNER.end)
    if start < 0 and line is None:
        return path.read_text()
    if start >= 0 and stop > start:
        text = text[:start] + text[stop + len(BANNER.end):].lstrip("\n")
    if line is not None:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{BANNER.begin}\n{line}\n{BANNER.end}\n\n{rest.lstrip(chr(10))}".rstrip("\n")
    first["source"] = text.splitlines(True)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


LINKS = "<!-- llmlab: course links -->"  # opens each lesson's, solution's and exercise notebook's closing cell


def course_links(course: Course, ls: Lesson, part: str) -> str:
    """The closing cell of lesson ``ls``'s notebook in ``part`` (notebooks, solutions or exercises): where to go
    next, in the manifest's order and with its titles, so that a lesson added, moved or renamed is linked right
    everywhere at once (by hand, 13's title and 15-18's solutions' next lesson drifted)."""
    at = course.lessons.index(ls)
    after = course.lessons[at + 1] if at + 1 < len(course.lessons) else None
    if part == "notebooks":
        then = (f"then the next lesson, [{after.number} · {after.title}]({Path(after.notebook).name})" if after
                else "that is the end of the course")
        body = (f"**Next:** this lesson's exercises, [{ls.exercise}](../{ls.exercise}) (worked solutions: "
                f"[{ls.solution}](../{ls.solution})); {then}. Back to the [course home]({Path(HOME).name}).")
    else:
        then = f"; **next** lesson: [{after.number} · {after.title}](../{after.notebook})" if after else ""
        body = (f"**Back** to the lesson, [{ls.number} · {ls.title}](../{ls.notebook}){then}. The "
                f"[course home](../{HOME}) shows your progress.")
    return f"{LINKS}\n---\n\n{body}"


def _with_links(path: Path, text: str, cell: str) -> str:
    """A notebook's ``text`` with its closing links cell (the markdown cell that opens with :data:`LINKS`) set to
    ``cell``; a notebook without one gets it as its last cell."""
    nb = json.loads(text)
    found = [c for c in nb["cells"] if c["cell_type"] == "markdown" and source_text(c).startswith(LINKS)]
    if len(found) > 1:
        raise ManifestError(f"{path.name} has {len(found)} cells that open with {LINKS!r}: keep the last one only, "
                            "then run `llmlab course`.")
    if not found:
        found = [{"cell_type": "markdown", "metadata": {}, "source": []}]
        nb["cells"].append(found[0])
    found[0]["source"] = cell.splitlines(True)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def rendered(course: Course, root: Path = ROOT) -> dict[str, str]:
    """Every file the manifest renders into, with its new text: the regions' files, each lesson's first cell
    (its path banner, or none) and the closing links cell of its lesson, solution and exercise notebooks."""
    out = {path: _render_file(root / path, [r for r in REGIONS if r.path == path], course, root)
           for path in dict.fromkeys(r.path for r in REGIONS)}
    for ls in course.lessons:
        for part, path in (("notebooks", ls.notebook), ("solutions", ls.solution), ("exercises", ls.exercise)):
            file = root / path
            if file.is_file():
                text = _with_banner(file, banner(course, ls)) if part == "notebooks" else file.read_text()
                out[path] = _with_links(file, text, course_links(course, ls, part))
    return out


def sync(root: Path = ROOT, check: bool = False, manifest: Path = MANIFEST) -> list[str]:
    """Render every region.  ``check``: write nothing, return one message per file that differs (with the first
    differing line) and per problem of :func:`problems`; otherwise write the files and return those problems."""
    course = load(manifest)
    out = problems(course, root)
    for path, new in rendered(course, root).items():
        file = root / path
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
