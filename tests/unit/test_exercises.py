"""The exercises mechanism: solutions/ is the source, exercises/ is generated and must not drift."""

import json
from pathlib import Path

import pytest

from llmlab.ops import exercises

ROOT = Path(__file__).resolve().parents[2]


def test_solution_block_becomes_placeholder_with_its_indentation():
    src = "x = 1\nif x:\n    # BEGIN SOLUTION\n    y = 2\n    # END SOLUTION\nprint(y)"
    assert exercises.strip_solution(src) == (
        "x = 1\nif x:\n    # YOUR CODE HERE\n    raise NotImplementedError()\nprint(y)")


@pytest.mark.parametrize("src", ["# BEGIN SOLUTION\nx = 1", "x = 1\n# END SOLUTION",
                                 "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION"])
def test_unbalanced_markers_are_errors(src):
    with pytest.raises(ValueError, match="SOLUTION"):
        exercises.strip_solution(src)


def test_notebook_without_solution_block_is_refused():
    nb = {"cells": [{"cell_type": "code", "source": "print(1)", "outputs": [], "metadata": {}}]}
    with pytest.raises(ValueError, match="not an exercise"):
        exercises.to_exercise(nb, "x.ipynb")


def test_committed_exercises_match_solutions(tmp_path):
    assert exercises.generate(ROOT / "solutions", ROOT / "exercises", check=True) == []


def test_generate_writes_and_removes_stale(tmp_path):
    out = tmp_path / "ex"
    out.mkdir()
    (out / "99_orphan.ipynb").write_text("{}")
    written = exercises.generate(ROOT / "solutions", out)
    assert "99_orphan.ipynb (no solution)" in written and not (out / "99_orphan.ipynb").exists()
    assert exercises.generate(ROOT / "solutions", out, check=True) == []


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.name)
def test_every_exercise_has_a_check_cell_and_a_lesson(path):
    nb = json.loads(path.read_text())
    assert exercises.check_calls(nb) >= 1, f"{path.name} has no llmlab.check.* cell"
    assert (ROOT / "notebooks" / path.name).exists(), f"{path.name} has no lesson in notebooks/"


@pytest.mark.parametrize("path", sorted(ROOT.glob("[nse]*/*.ipynb")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebooks_are_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    code = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    dirty = [i for i, c in code if c["outputs"] or c["execution_count"]]
    assert not dirty, f"{path} has outputs in cells {dirty}: clear them before committing"
