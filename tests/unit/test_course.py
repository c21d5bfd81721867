"""The course as data (llmlab/course.toml, llmlab.ops.course): the manifest agrees with the tree, and a list edited
by hand is found."""

import json
import re
import shutil
from pathlib import Path

import pytest

from llmlab.ops import course
from llmlab.ops.cli import main

ROOT = course.ROOT


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of what the manifest renders into and checks against (no models, no fixtures)."""
    for part in ("notebooks", "solutions", "exercises", "docs"):
        shutil.copytree(ROOT / part, tmp_path / part)
    shutil.copytree(ROOT / "llmlab", tmp_path / "llmlab", ignore=shutil.ignore_patterns("models", "__pycache__"))
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("fixtures", "__pycache__"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_the_repository_agrees_with_its_manifest():
    c = course.load()
    assert [ls.stem for ls in c.lessons] == sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")
                                                   if p.name != "00_home.ipynb")
    assert course.problems(c) == []
    assert course.sync(check=True) == []


def test_a_hand_edited_readme_row_fails_the_check_and_llmlab_course_renders_it_back(tree, capsys):
    readme = (tree / "README.md").read_text()
    row = "| 04 | `notebooks/04_sampling.ipynb` | "
    edited = readme.replace(row + "temperature", row + "heat")
    assert edited != readme
    (tree / "README.md").write_text(edited)
    assert main(["course", "--check", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "README.md differs from llmlab/course.toml" in err and "heat" in err
    assert main(["course", "--root", str(tree)]) == 0
    assert (tree / "README.md").read_text() == readme
    assert main(["course", "--check", "--root", str(tree)]) == 0


def test_a_lost_marker_is_one_sentence(tree, capsys):
    arch = tree / "docs" / "architecture.md"
    arch.write_text(arch.read_text().replace("<!-- /course:topics -->", ""))
    assert main(["course", "--check", "--root", str(tree)]) == 2
    assert "docs/architecture.md has no" in capsys.readouterr().err


def test_a_notebook_without_a_row_and_a_missing_workshop_section_are_named(tree):
    shutil.copy(tree / "notebooks" / "14_determinism.ipynb", tree / "notebooks" / "16_new_lesson.ipynb")
    nb = json.loads((tree / "notebooks" / "04_sampling.ipynb").read_text())
    for cell in nb["cells"]:
        cell["source"] = [line.replace("## 3. ", "## Three. ") for line in course.source_text(cell).splitlines(True)]
    (tree / "notebooks" / "04_sampling.ipynb").write_text(json.dumps(nb))
    found = course.problems(course.load(), tree)
    assert "notebooks/16_new_lesson.ipynb has no row in llmlab/course.toml: add one ([[lesson]])." in found
    assert any("lesson 04 has no section 3" in p for p in found)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace('minutes = 15', 'minutes = 15\nminuets = 3', 1), "unknown field 'minuets'"),
    (lambda t: t.replace('title = "Setup"\n', '', 1), "field 'title' is missing"),
    (lambda t: t.replace('number = "01"', 'number = "00"', 1), "must be unique and in order"),
    (lambda t: t.replace('lesson = "05"', 'lesson = "55"', 1), "names lesson 55, which has no row"),
    (lambda t: t.replace('room = true', 'room = tru', 1), "is not valid TOML"),
])
def test_a_malformed_manifest_names_the_row_and_the_field(tmp_path, edit, message):
    bad = tmp_path / "course.toml"
    bad.write_text(edit(course.MANIFEST.read_text()))
    with pytest.raises(course.ManifestError, match=message):
        course.load(bad)


def test_workshop_sections_are_read_as_numbers_and_the_room_set_is_the_lessons_that_call_connect():
    c = course.load()
    first = c.workshop[1]
    assert (first.lesson, first.section_numbers()) == ("01", [1, 2, 3, 4, 7])
    room = c.room_notebooks()
    assert course.HOME in room and "solutions/13_prefix_caching_at_scale.ipynb" in room
    finds = re.compile(r"llmlab\.connect\(\s*(\)|quiet=)")  # connect() with no URL: the server it finds
    for ls in c.lessons:  # a lesson that never asks connect() to find a server gains nothing from the cluster's
        # server (lesson 17 connects only to its own engine, by its URL); one that does, even to decide, must run there
        cells = json.loads((ROOT / ls.notebook).read_text())["cells"]
        calls = any(finds.search("".join(cell["source"])) for cell in cells if cell["cell_type"] == "code")
        does = "calls" if calls else "never calls"
        assert ls.room == calls, f"lesson {ls.number}: room = {ls.room}, but it {does} connect() without a URL"


def test_a_path_that_skips_the_section_defining_a_name_is_a_nameerror_named_by_the_check(tmp_path, capsys):
    """The review's finding: "04 sections 2-4" use ``top`` from section 1.  The check names the step, the name
    and the fix; the path as committed has no such name."""
    manifest = tmp_path / "course.toml"
    manifest.write_text(course.MANIFEST.read_text().replace('lesson = "04"\nsections = "1-4"',
                                                            'lesson = "04"\nsections = "2-4"', 1))
    found = course.problems(course.load(manifest))
    assert [p for p in found if "lesson 04's sections 2-4 use 'top'" in p and "NameError" in p], found
    assert not [p for p in course.problems(course.load()) if "NameError" in p]


def test_the_path_notebooks_hold_the_setup_cells_and_the_listed_sections_only(tmp_path, capsys):
    assert main(["course", "--path", str(tmp_path)]) == 0
    c = course.load()
    written = sorted(p.name for p in tmp_path.glob("*.ipynb"))
    assert written == sorted(Path(c.lesson(st.lesson).notebook).name for st in c.workshop if st.lesson)
    nb = json.loads((tmp_path / "02_kv_caching.ipynb").read_text())
    headings = [line for cell in nb["cells"] if cell["cell_type"] == "markdown"
                for line in course.source_text(cell).splitlines() if line.startswith("## ")]
    assert [h.split(".")[0] for h in headings] == ["## 1", "## 4", "## 5"]  # "1, 4, 5"; not "On a real cluster"
    lesson = json.loads((ROOT / "notebooks" / "02_kv_caching.ipynb").read_text())["cells"]
    setup = next(i for i, cell in enumerate(lesson) if course.source_text(cell).startswith("## "))
    assert setup >= 2 and nb["cells"][:setup] == lesson[:setup]  # the title and the set-up cells come first


def test_a_rehearsed_room_runs_each_lessons_path_exercises_after_it_as_solved(tmp_path):
    """Issue 47: the room rehearsal ran the lessons' sections only, so its progress report said 0 passed; with
    exercises=True each lesson of the path is followed by its path exercises, cut from the worked solutions."""
    c = course.load()
    written = [p.name for p in course.write_path(c, tmp_path, exercises=True)]
    assert written[written.index("02_kv_caching.ipynb") + 1] == "02_kv_caching.exercises.ipynb"
    assert "05_logprobs.exercises.ipynb" not in written  # the path gives lesson 05 no exercise ("--")
    nb = json.loads((tmp_path / "01_memory_arithmetic.exercises.ipynb").read_text())
    headings = [line for cell in nb["cells"] for line in course.source_text(cell).splitlines()
                if line.startswith("### Exercise")]
    assert [h.split(":")[0] for h in headings] == ["### Exercise 1", "### Exercise 2"]  # "Exercises 1-2"
    code = "\n".join(course.source_text(cell) for cell in nb["cells"] if cell["cell_type"] == "code")
    assert "llmlab.check.weights_405b_fp16(" in code and "llmlab.check.h100s_for_405b(" in code
    assert [st.exercise_numbers() for st in c.workshop if st.lesson][:3] == [[], [1, 2], [4]]


def test_undefined_names_reads_magics_and_knows_what_a_kernel_defines():
    from llmlab.ops.paths import undefined_names

    cells = [{"cell_type": "code", "source": "import os\nx = [y for y in range(3)]\n!echo {x}\ndisplay(x)"},
             {"cell_type": "code", "source": "def f(a):\n    return a + x + z\nawait g()\nfor k in x: print(k)"}]
    assert undefined_names(cells) == [(1, "g"), (1, "z")]


def test_the_learners_handout_lists_the_paths_steps_and_a_timing_made_from_its_text():
    """docs/handout.md (issue 47): each step's notebook as a link, its sections and exercise, and the path's words
    and code cells counted from the notebooks, so that a lesson that grows changes the timing on paper too."""
    c = course.load()
    page = course.handout(c)
    for st in c.workshop:
        if st.lesson:
            ls = c.lesson(st.lesson)
            assert f"| {st.at} | [{ls.number} {ls.title}](../{ls.notebook}) | {st.sections} |" in page
    words, cells = course.path_load(c)
    assert words > 1000 and cells > 10 and f"{words:,} words to read and {cells} code cells" in page
    assert page in (ROOT / "docs" / "handout.md").read_text()  # rendered into the page (llmlab course --check)
