"""The course as data (llmlab/course.toml, llmlab.ops.course): the manifest agrees with the tree, and a list edited
by hand is found."""

import json
import re
import shutil
from pathlib import Path

import pytest

from llmlab.ops import course, paths
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
    assert any("notebooks/04_sampling.ipynb has no section 3 (its '## 3.' heading)" in p for p in found)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace('minutes = 15', 'minutes = 15\nminuets = 3', 1), "unknown field 'minuets'"),
    (lambda t: t.replace('title = "Setup"\n', '', 1), "field 'title' is missing"),
    (lambda t: t.replace('number = "01"', 'number = "00"', 1), "must be unique and in order"),
    (lambda t: t.replace('lesson = "06"', 'lesson = "55"', 1), "names lesson 55, which has no row"),
    (lambda t: t.replace('talk = 5', 'talk = 5\nat = "0:00"', 1), "unknown field 'at'"),
    (lambda t: t.replace('taught = 180', 'taught = 180\nreading = 200', 1), r"\[workshop\]: unknown field 'reading'"),
    (lambda t: t.replace('room = true', 'room = tru', 1), "is not valid TOML"),
])
def test_a_malformed_manifest_names_the_row_and_the_field(tmp_path, edit, message):
    bad = tmp_path / "course.toml"
    bad.write_text(edit(course.MANIFEST.read_text()))
    with pytest.raises(course.ManifestError, match=message):
        course.load(bad)


def test_workshop_sections_are_read_as_numbers_and_headings_and_the_room_set_is_the_lessons_that_call_connect():
    step = course.Step(slot=20, lesson="02", sections="1, 4-5, On a real cluster")
    assert step.section_list() == [1, 4, 5, "On a real cluster"]
    assert step.sections_text() == '1, 4-5 and "On a real cluster"'
    c = course.load()
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
    text = course.MANIFEST.read_text()
    sections = re.search(r'lesson = "04"\nsections = "([^"]*)"', text)[1]
    assert sections.startswith("1-")
    manifest.write_text(text.replace(f'lesson = "04"\nsections = "{sections}"',
                                     f'lesson = "04"\nsections = "2{sections[1:]}"', 1))
    found = course.problems(course.load(manifest))
    assert [p for p in found if f"lesson 04's sections 2{sections[1:]} use 'top'" in p and "NameError" in p], found
    assert not [p for p in course.problems(course.load()) if "NameError" in p]


def test_the_path_notebooks_hold_the_setup_cells_and_the_listed_sections_only(tmp_path, capsys):
    assert main(["course", "--path", str(tmp_path)]) == 0
    c = course.load()
    written = sorted(p.name for p in tmp_path.glob("*.ipynb"))
    assert written == sorted(Path(c.lesson(st.lesson).notebook).name for st in c.workshop if st.lesson)
    nb = json.loads((tmp_path / "02_kv_caching.ipynb").read_text())
    headings = [line for cell in nb["cells"] if cell["cell_type"] == "markdown"
                for line in course.source_text(cell).splitlines() if line.startswith("## ")]
    assert [h.split(".")[0] for h in headings] == ["## 1", "## 4", "## 5", "## On a real cluster"]
    lesson = json.loads((ROOT / "notebooks" / "02_kv_caching.ipynb").read_text())["cells"]
    setup = next(i for i, cell in enumerate(lesson) if course.source_text(cell).startswith("## "))
    assert setup >= 2 and nb["cells"][:setup] == lesson[:setup]  # the title and the set-up cells come first


def test_a_rehearsed_room_runs_each_lessons_path_exercises_after_it_as_solved(tmp_path):
    """Issue 47: the room rehearsal ran the lessons' sections only, so its progress report said 0 passed; with
    exercises=True each lesson of the path is followed by its path exercises, cut from the worked solutions."""
    c = course.load()
    written = [p.name for p in course.write_path(c, tmp_path, exercises=True)]
    assert written[written.index("02_kv_caching.ipynb") + 1] == "02_kv_caching.exercises.ipynb"
    assert "00_setup.exercises.ipynb" not in written  # the path gives lesson 00 no exercise ("--")
    nb = json.loads((tmp_path / "01_memory_arithmetic.exercises.ipynb").read_text())
    headings = [line for cell in nb["cells"] for line in course.source_text(cell).splitlines()
                if line.startswith("### Exercise")]
    assert [h.split(":")[0] for h in headings] == ["### Exercise 1", "### Exercise 2"]  # "Exercises 1-2"
    code = "\n".join(course.source_text(cell) for cell in nb["cells"] if cell["cell_type"] == "code")
    assert "llmlab.check.weights_405b_fp16(" in code and "llmlab.check.h100s_for_405b(" in code
    assert {st.lesson: st.exercise_numbers() for st in c.workshop if st.lesson}["01"] == [1, 2]


def test_undefined_names_reads_magics_and_knows_what_a_kernel_defines():
    from llmlab.ops.paths import undefined_names

    cells = [{"cell_type": "code", "source": "import os\nx = [y for y in range(3)]\n!echo {x}\ndisplay(x)"},
             {"cell_type": "code", "source": "def f(a):\n    return a + x + z\nawait g()\nfor k in x: print(k)"}]
    assert undefined_names(cells) == [(1, "g"), (1, "z")]


def test_the_learners_handout_and_the_home_page_link_each_step_and_state_the_taught_and_self_paced_time():
    """docs/handout.md (issue 47) and the home page's path (issue 51): each step's lesson and exercises as links,
    its sections and minutes, the class's time and the time alone, computed from the notebooks."""
    c = course.load()
    own = sum(course.step_time(c, st).minutes for st in c.workshop if st.lesson)
    for page, to_lessons in ((course.handout(c), "../notebooks/"), (course.workshop_table(c), "")):
        for at, st in course.schedule(c):
            if st.lesson:
                ls = c.lesson(st.lesson)
                assert f"| {course.clock(at)} | [{ls.number} {ls.title}]({to_lessons}{ls.stem}.ipynb) | " in page
                assert (f"[{st.exercises}](../{ls.exercise})" in page) == bool(st.exercise_numbers())
        assert f"a class of {course.taught_minutes(c) / 60:g} hours" in page
        assert f"about {5 * round(own / 5)} minutes" in page  # rounded: a prose edit rarely changes it
    assert course.handout(c) in (ROOT / "docs" / "handout.md").read_text()  # rendered (llmlab course --check)
    home = "".join(course.source_text(cell) for cell in json.loads((ROOT / course.HOME).read_text())["cells"])
    assert course.workshop_table(c) in home


def test_the_paths_minutes_are_computed_from_its_cells_at_the_manifests_pace(tree):
    """Issue 51: 130 more words on a path section cost a minute, a code cell 0.75, a line of an answer 1.5; words
    folded into a <details> aside cost nothing; a section off the path costs nothing."""
    c = course.load()
    step = next(st for st in c.workshop if st.lesson == "03")
    before = course.step_time(c, step, tree)
    nb_path = tree / c.lesson("03").notebook
    nb = json.loads(nb_path.read_text())
    first = next(i for i, cell in enumerate(nb["cells"]) if course.source_text(cell).startswith("## 1."))
    off = next(i for i, cell in enumerate(nb["cells"]) if course.source_text(cell).startswith("## 6."))
    word = {"cell_type": "markdown", "metadata": {}, "source": "word " * 130}
    aside = {"cell_type": "markdown", "metadata": {},
             "source": "<details><summary>Why</summary>\n\n" + "aside " * 500 + "\n</details>"}
    code = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": "x = 1"}
    nb["cells"][off + 1:off + 1] = [word, code]  # in section 6: off the path
    nb["cells"][first + 1:first + 1] = [word, aside, code]
    nb_path.write_text(json.dumps(nb))
    after = course.step_time(c, step, tree)
    assert (after.words, after.folded, after.code_cells) == (before.words + 131, before.folded + 500,
                                                              before.code_cells + 1)
    assert after.minutes - before.minutes == pytest.approx(131 / 130 + 0.75)
    assert before.written_lines >= 1 and before.minutes == pytest.approx(
        (before.words + before.exercise_words) / 130 + (before.code_cells + before.exercise_cells) * 0.75
        + before.written_lines * 1.5)


def test_a_step_over_its_slot_and_slots_over_the_class_fail_the_check(tmp_path, capsys):
    text = course.MANIFEST.read_text()
    slot = re.search(r'lesson = "00"\nsections = "[^"]*"\nexercises = "[^"]*"\ntalk = \d+\nslot = (\d+)', text)
    manifest = tmp_path / "course.toml"
    manifest.write_text(text[:slot.start(1)] + "1" + text[slot.end(1):])
    found = course.problems(course.load(manifest))
    over = [p for p in found if "(00 Setup)" in p]
    assert len(over) == 1 and "over its slot of 1" in over[0] and "<details>" in over[0], found
    assert main(["course", "--check"]) == 0  # the path as committed fits
    manifest.write_text(text[:slot.start(1)] + "60" + text[slot.end(1):])
    found = course.problems(course.load(manifest))
    assert [p for p in found if "more than the taught class of 180" in p], found
    assert course.timing(course.load()).splitlines()[-1].startswith("taught: ")


def test_a_path_can_name_an_unnumbered_section_and_its_names_are_checked():
    """Issue 51: "On a real cluster" sections were dropped from the path; the manifest names them by heading, the
    path notebook holds them, and a name they take from a section off the path is found."""
    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}  # noqa: E731
    py = lambda s: {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": s}  # noqa: E731
    nb = {"cells": [md("# Title"), py("import math"), md("## 1. One"), py("x = math.pi"), md("## 2. Two"),
                    py("y = 2"), md("## On a real cluster"), py("print(x * 70)")]}
    assert paths.sections(nb) == [1, 2, "On a real cluster"]
    cut = paths.path_cells(nb, [2, "On a real cluster"])
    assert [course.source_text(c) for c in cut][-2:] == ["## On a real cluster", "print(x * 70)"]
    assert paths.undefined_names(cut) == [(5, "x")]
    assert paths.undefined_names(paths.path_cells(nb, [1, "On a real cluster"])) == []


def test_a_named_section_the_lesson_lacks_is_named(tmp_path):
    manifest = tmp_path / "course.toml"
    text = course.MANIFEST.read_text()
    sections = re.search(r'lesson = "02"\nsections = "([^"]*)"', text)[1]
    manifest.write_text(text.replace(f'sections = "{sections}"', f'sections = "{sections}, On a big cluster"', 1))
    assert [p for p in course.problems(course.load(manifest))
            if "02_kv_caching.ipynb has no section 'On a big cluster' (a '## On a big cluster' heading)" in p]


def test_a_heading_below_text_in_its_cell_fails_the_check(tree, capsys):
    """Issue 51 (F4): text above a '## ' heading in one cell went with the heading's section and off the path."""
    assert not [p for p in course.problems(course.load(), tree) if "text above it" in p]
    nb_path = tree / "notebooks" / "04_sampling.ipynb"
    nb = json.loads(nb_path.read_text())
    i = next(i for i, cell in enumerate(nb["cells"]) if course.source_text(cell).startswith("## 2."))
    nb["cells"][i]["source"] = "The takeaway of section 1.\n\n" + course.source_text(nb["cells"][i])
    nb_path.write_text(json.dumps(nb))
    assert paths.buried_headings(nb) == [(i, course.source_text(nb["cells"][i]).splitlines()[2])]
    assert main(["course", "--check", "--root", str(tree)]) == 1
    assert f"notebooks/04_sampling.ipynb, cell {i}: the heading '## 2." in capsys.readouterr().err
    hidden = {"cell_type": "markdown", "metadata": {}, "source": "<!-- a marker -->\n\n## 9. Fine"}
    assert paths.buried_headings({"cells": [hidden]}) == []


def test_each_path_lesson_carries_its_banner_in_its_first_cell_and_a_lesson_off_the_path_none(tree, tmp_path, capsys):
    """Issue 51 (F2): the path is marked where learners work.  The banner is rendered from the manifest: a hand
    edit fails the check, `llmlab course` writes it back, and a lesson taken off the path loses it."""
    c = course.load()
    for ls in c.lessons:
        first = course.source_text(json.loads((ROOT / ls.notebook).read_text())["cells"][0])
        line = course.banner(c, ls)
        assert (line is not None) == any(st.lesson == ls.number for st in c.workshop)
        assert (line in first) if line else course.BANNER.begin not in first
    b02 = course.banner(c, c.lesson("02"))
    assert b02.startswith("> **On the 3-hour path** (step ") and '"On a real cluster"' in b02 and "Exercise 4" in b02
    steps = [st.lesson for st in c.workshop if st.lesson]  # each banner links the next step, not the next number
    after = c.lesson(steps[steps.index("00") + 1])
    assert f"next on the path: [{after.number} {after.title}]({after.stem}.ipynb)." in course.banner(c, c.lesson("00"))
    assert course.banner(c, c.lesson(steps[-1])).endswith("the path ends here.")
    nb_path = tree / c.lesson("02").notebook
    nb_path.write_text(nb_path.read_text().replace("On the 3-hour path", "On the path", 1))
    assert main(["course", "--check", "--root", str(tree)]) == 1
    assert "notebooks/02_kv_caching.ipynb differs from llmlab/course.toml" in capsys.readouterr().err
    text = course.MANIFEST.read_text()
    manifest = tmp_path / "course.toml"
    manifest.write_text(re.sub(r'lesson = "04"\n', 'lesson = "05"\n', text, count=1))
    course.sync(tree, manifest=manifest)
    first = lambda n: course.source_text(json.loads((tree / n).read_text())["cells"][0])  # noqa: E731
    assert "On the 3-hour path" not in first(c.lesson("04").notebook)
    moved = course.load(manifest)
    assert course.banner(moved, c.lesson("05")) in first(c.lesson("05").notebook)
    assert course.banner(moved, c.lesson("02")) in first(c.lesson("02").notebook)  # its next step is 05 now


def test_each_lessons_closing_links_are_rendered_from_the_manifest(tree, tmp_path, capsys):
    """Issue 48, item 8: the 'Next:' cell that closes every lesson, solution and exercise notebook is rendered from
    the manifest (by hand, lesson 13's title and the next lesson of solutions 15-18 had drifted): each links the
    next lesson by its manifest title, the last one says the course ends there, a hand edit fails the check and
    `llmlab course` writes it back, and a lesson renamed in the manifest is renamed in its neighbours' cells."""
    c = course.load()
    for at, ls in enumerate(c.lessons):
        after = c.lessons[at + 1] if at + 1 < len(c.lessons) else None
        for part, path in (("notebooks", ls.notebook), ("solutions", ls.solution), ("exercises", ls.exercise)):
            last = course.source_text(json.loads((ROOT / path).read_text())["cells"][-1])
            assert last == course.course_links(c, ls, part) and last.startswith(course.LINKS)
            assert (f"[{after.number} · {after.title}]" in last) if after else "next lesson" not in last
    assert "that is the end of the course" in course.course_links(c, c.lessons[-1], "notebooks")
    nb_path = tree / c.lesson("13").notebook
    nb_path.write_text(nb_path.read_text().replace("[14 · Determinism]", "[14 · Reproducibility]", 1))
    assert main(["course", "--check", "--root", str(tree)]) == 1
    assert "notebooks/13_prefix_caching_at_scale.ipynb differs from llmlab/course.toml" in capsys.readouterr().err
    manifest = tmp_path / "course.toml"
    manifest.write_text(course.MANIFEST.read_text().replace('title = "Determinism"', 'title = "Same input"'))
    course.sync(tree, manifest=manifest)
    for path in (c.lesson("13").notebook, c.lesson("13").solution, c.lesson("13").exercise):
        assert "[14 · Same input]" in (tree / path).read_text()
