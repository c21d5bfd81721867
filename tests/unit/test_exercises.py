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


# --- leaks: no lesson cell prints an exercise's answer -----------------------------------------------------------

def _md(text):
    return {"cell_type": "markdown", "source": text, "metadata": {}}


def _code(source, *outputs):
    return {"cell_type": "code", "source": source, "metadata": {}, "outputs": list(outputs), "execution_count": 1}


def _out(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def _result(text):
    return {"output_type": "execute_result", "data": {"text/plain": text}, "metadata": {}, "execution_count": 1}


def _solution(*answer_outputs, givens="Compute the KV bytes of one token."):
    return {"cells": [_md("# 01 · exercises"), _code("spec = 1", _out("131,072 tokens of context\n")),
                      _md(f"### Exercise 4: the KV cache\n\n{givens}"),
                      _code("# BEGIN SOLUTION\nx = 2\n# END SOLUTION\nprint(x)", *answer_outputs),
                      _code("llmlab.check.kv(x)", _out("Right: 516,096 bytes per token\n"))]}


def _lesson(*outputs):
    return {"cells": [_md("# 01 · lesson, 516,096 in the prose"), _code("print(1)", _out("nothing here\n")),
                      _code("print(per_token)", *outputs)]}


def test_a_leak_is_found_with_its_exercise_number_and_lesson_cell():
    found = exercises.leaks(_lesson(_result("llama3.1-405b    516096    63.00\n")),
                            _solution(_out("516,096 bytes per token, 63.00 GiB\n")))
    assert found == [("Exercise 4", "516096", 2), ("Exercise 4", "63.00", 2)]


def test_short_numbers_and_other_figures_are_no_leak():
    # 0.66 and 2048 x 2 have under 4 significant digits (1,024,000 has 4); 63.0 is not 63.00
    found = exercises.leaks(_lesson(_out("0.66 µs, 500 tokens, 63.0 GiB, 1,024,000 tokens\n")),
                            _solution(_out("0.66 µs, 500 tokens, 63.00 GiB, 1024000 tokens, 7,000 bytes\n")))
    assert found == [("Exercise 4", "1024000", 2)]


def test_a_given_of_the_exercise_is_no_leak():
    lesson = _lesson(_out("131,072 tokens; 123.05 GB published; 8,192 in flight\n"))
    solution = _solution(_out("123.05 GB vs 131072 tokens, 8192 in flight\n"),
                         givens="Compare with the published 123.05 GB for 131,072 tokens.")
    solution["cells"][3]["source"] = "# BEGIN SOLUTION\nx = 8_192\n# END SOLUTION\nprint(x)"
    assert exercises.leaks(lesson, solution) == []


def test_stderr_and_engine_log_records_are_not_read():
    log = "\x1b[32mINFO\x1b[0m 11-27 00:21:17 [model.py:2152] Using max model len 2152\n"
    lesson = _lesson(_out("CPU KV cache size: 524,288 tokens\n", name="stderr"), _out(log))
    solution = _solution(_out("524,288 tokens\n", name="stderr"), _out("2152 tokens\n524288 again\n"))
    assert exercises.leaks(lesson, solution) == []
    assert exercises.leaks(_lesson(_out("524,288 tokens\n")), solution) == [("Exercise 4", "524288", 2)]


def test_urls_ports_and_paths_are_not_numbers():
    text = ("connected to http://127.0.0.1:59301/v1 (127.0.0.1:59301, localhost:59301); log "
            "/tmp/llmlab-1234/run-5678.log, benchmarks/results/h200-llama3.1-70b-tp2/rehearsal.json; 5,678 tokens")
    assert exercises.numbers(text) == {"5678"}
    lesson = _lesson(_out("serving on http://127.0.0.1:59301/v1\n"))
    assert exercises.leaks(lesson, _solution(_out("found http://127.0.0.1:59301/v1, port 59301\n"))) == []


def test_significant_digits():
    assert [exercises.significant(n) for n in ("1024000", "63.00", "0.66", "2000", "32768", "0.0012")] == \
        [4, 4, 2, 1, 5, 2]


def test_find_leaks_reads_the_executed_copies_side_by_side(tmp_path):
    for folder, nb in (("notebooks", _lesson(_out("516,096\n"))), ("solutions", _solution(_out("516096\n")))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "01_x.ipynb").write_text(json.dumps(nb))
    (tmp_path / "solutions" / "02_no_lesson.ipynb").write_text(json.dumps(_solution(_out("516096\n"))))
    pairs, lines = exercises.find_leaks(tmp_path)
    assert pairs == 1 and lines == ["notebooks/01_x.ipynb cell 2 prints 516096, the answer of "
                                    "solutions/01_x.ipynb Exercise 4"]
    assert exercises.find_leaks(tmp_path / "nothing") == (0, [])


def test_the_leaks_command_fails_on_a_leak_and_on_nothing_to_read(tmp_path, capsys):
    from llmlab.ops.cli import main

    assert main(["exercises", "--leaks", str(tmp_path)]) == 1 and "make executed" in capsys.readouterr().out
    for folder in ("notebooks", "solutions"):
        (tmp_path / folder).mkdir()
    (tmp_path / "notebooks" / "01_x.ipynb").write_text(json.dumps(_lesson(_out("516,096\n"))))
    (tmp_path / "solutions" / "01_x.ipynb").write_text(json.dumps(_solution(_out("1,234,567\n"))))
    assert main(["exercises", "--leaks", str(tmp_path)]) == 0 and "no lesson prints" in capsys.readouterr().out
    (tmp_path / "solutions" / "01_x.ipynb").write_text(json.dumps(_solution(_out("516,096\n"))))
    assert main(["exercises", "--leaks", str(tmp_path)]) == 1
    assert "notebooks/01_x.ipynb cell 2 prints 516096" in capsys.readouterr().out
