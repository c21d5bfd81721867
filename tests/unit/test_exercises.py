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
    assert found == [("Exercise 4", "516096", 2, "516096"), ("Exercise 4", "63.00", 2, "63.00")]


def test_short_numbers_and_other_figures_are_no_leak():
    # 0.66 and 500 have under 3 significant digits; 7,000 is printed nowhere else
    found = exercises.leaks(_lesson(_out("0.66 µs, 500 tokens, 1,024,000 tokens, 64.0 GiB, 7.1 steps\n")),
                            _solution(_out("0.66 µs, 500 tokens, 63.00 GiB, 1024000 tokens, 7,000 bytes, 7.04\n")))
    assert found == [("Exercise 4", "1024000", 2, "1024000")]  # 64.0 is 1.6 % off 63.00; "7.1 steps" has no unit


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
    assert exercises.leaks(_lesson(_out("524,288 tokens\n")), solution) == [("Exercise 4", "524288", 2, "524288")]


def test_urls_ports_and_paths_are_not_numbers():
    text = ("connected to http://127.0.0.1:59301/v1 (127.0.0.1:59301, localhost:59301); log "
            "/tmp/llmlab-1234/run-5678.log, benchmarks/results/h200-llama3.1-70b-tp2/rehearsal.json; 5,678 tokens")
    assert exercises.numbers(text) == {"5678"}
    lesson = _lesson(_out("serving on http://127.0.0.1:59301/v1\n"))
    assert exercises.leaks(lesson, _solution(_out("found http://127.0.0.1:59301/v1, port 59301\n"))) == []


# Issue 48: lesson 18 printed its three exercises' answers in other units or rounded, and the exact match missed them.
LESSON_18 = ("llama3.1-70b  8192 tokens  2,560.0 MiB\n"     # Ex1's 2,684,354,560 B, in MiB
             "it is 2.5 GiB on the wire\n"                   # the same, rounded, in GiB
             "InfiniBand NDR (one port)  53.7 ms\n"          # Ex2's 0.05368709 s, in ms
             "break-even 7.0 GB/s\n")                        # Ex3's 6.96e9 B/s, rounded to 2 digits


def _lesson_18_answers(text):
    return exercises.leaks(_lesson(_out(LESSON_18)), _solution(_out(text)))


@pytest.mark.parametrize("answer, shown", [("2684354560", "2.5 GiB"), ("0.05368709", "53.7 ms"),
                                           ("53.687", "53.7 ms"), ("6956000000.0", "7.0 GB/s"), ("6.956", "7.0 GB/s")])
def test_an_answer_printed_in_another_unit_or_rounded_is_a_leak(answer, shown):
    """Each of these was missed before: only the same digits counted (``git show 786d8d7:llmlab/ops/exercises.py``
    compared ``numbers()``, and 2560.0 is not 2684354560)."""
    assert [(n, where, s) for _, n, where, s in _lesson_18_answers(f"{answer}\n")] == [(answer, 2, shown)]


def test_the_old_exact_match_missed_lesson_18s_answers():
    """What the check did before, on the same pair: the lesson's numbers and the answers have no digits in common."""
    lesson_numbers = exercises.numbers(LESSON_18)
    assert not {"2684354560", "0.05368709", "6956000000.0"} & lesson_numbers
    assert "2560.0" in lesson_numbers and "53.7" in lesson_numbers


def test_a_figure_beyond_the_checks_tolerance_or_of_another_family_is_no_leak():
    assert _lesson_18_answers("2684354561\n") == []    # bytes are checked to the byte: 2.5 GiB is one short
    assert _lesson_18_answers("55.04\n") == []         # 53.7 ms is 2.4 % off
    assert _lesson_18_answers("7.213\n") == []         # 7.0 GB/s is 3 % off
    assert _lesson_18_answers("60.5\n") == []          # printed with 3 digits: too common to match loosely
    assert exercises.leaks(_lesson(_out("53.7 tokens\n")), _solution(_out("0.05368\n"))) == []  # not a time
    assert exercises.leaks(_lesson(_out("811.7 GB\n")), _solution(_out("811706777600\n"))) == []  # not exact


def test_an_answer_rounded_to_three_digits_without_a_unit_is_a_leak_but_a_count_is_not():
    """Lesson 18 printed Exercise 2's 53.687 ms as "53.7" in a table whose header held the unit; the same table
    printed gap counts such as "296.0", which a TTFT of 296.02 ms must not be taken for."""
    table = _lesson(_out("                 ms\nInfiniBand NDR (one port)  53.7\ngaps 0-10 ms  296.0\n"))
    assert [n for _, n, _, _ in exercises.leaks(table, _solution(_out("53.687091\n")))] == ["53.687091"]
    assert exercises.leaks(table, _solution(_out("296.02474\n"))) == []
    assert exercises.leaks(table, _solution(_out("53.76\n"))) == []  # within 1 %, but it rounds to 53.8


def test_an_answer_printed_by_another_part_of_the_solution_is_a_leak():
    """A cell of the solution outside the exercise (the set-up, another exercise) prints for the learner too."""
    solution = _solution(_out("2684354560\n"))
    solution["cells"][1]["outputs"] = [_out("the pool: 2.5 GiB\n")]
    assert exercises.leaks(_lesson(_out("nothing\n")), solution) == [
        ("Exercise 4", "2684354560", "solution cell 1", "2.5 GiB")]


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
                                    "solutions/01_x.ipynb Exercise 4 (516096)"]
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
