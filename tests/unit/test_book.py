"""Each notebook executed once: the course's pytest plugin (llmlab.ops.testing) keeps what nbval executed, and
``make book`` (llmlab/ops/book.py) renders those copies, refusing a missing, failed, stale or key-holding one.
CI builds the whole book from the copies ``make test`` wrote (.ci/run)."""

import json
import os
import stat
import subprocess
import sys

import pytest

from llmlab import replicas
from llmlab.ops import book
from llmlab.ops.testing import CLUSTER_ONLY
from llmlab.serve import embedded
from llmlab.serve.info import key_digest, new_key_file, noted_keys


def notebook(*cells: str, tags: dict | None = None) -> dict:
    return {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# a lesson"}] +
                     [{"cell_type": "code", "execution_count": None, "metadata": {"tags": (tags or {}).get(i, [])},
                       "outputs": [], "source": src} for i, src in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


def execute(tmp_path, nb: dict, home=None):
    """Run one notebook under nbval with the course's plugin, as `make test` does; returns the run and its copy."""
    path = tmp_path / "lesson.ipynb"
    path.write_text(json.dumps(nb))
    env = {**os.environ, "LLMLAB_EXECUTED_DIR": str(tmp_path / "executed"), "LLMLAB_TEST_SERVER": "embedded"}
    if home:
        env["LLMLAB_TEST_HOME"] = str(home)
    run = subprocess.run([sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tmp_path),
                          "-p", "llmlab.ops.testing", "--nbval-lax", "--nbval-current-env", "-q",
                          "-p", "no:cacheprovider", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    copy = tmp_path / "executed" / "lesson.ipynb"
    return run, (json.loads(copy.read_text()) if copy.exists() else None)


def test_an_executed_copy_keeps_outputs_counts_timings_and_shows_a_cluster_cell_unrun(tmp_path):
    nb = notebook("x = 6 * 7\nprint('x is', x)", "x", "raise SystemExit('needs a GPU')", "from IPython.display import "
                  "display, HTML\ndisplay(HTML('<b>bold</b>'))", tags={2: [CLUSTER_ONLY]})
    run, copy = execute(tmp_path, nb)
    assert run.returncode == 0, run.stdout[-2000:]
    code = [c for c in copy["cells"] if c["cell_type"] == "code"]
    assert code[0]["outputs"] == [{"output_type": "stream", "name": "stdout", "text": "x is 42\n"}]
    assert code[1]["outputs"][0]["data"]["text/plain"] == "42" and code[1]["outputs"][0]["execution_count"] == 2
    assert code[2]["outputs"] == [] and code[2]["execution_count"] is None  # the cluster-only cell, unrun
    assert code[3]["outputs"][0]["data"]["text/html"] == "<b>bold</b>" and code[3]["execution_count"] == 3
    meta = copy["metadata"]["llmlab"]
    assert [c["outcome"] for c in meta["cells"]] == ["passed", "passed", "skipped", "passed"]
    assert meta["failed"] == [] and not meta["key_found"] and meta["server"] == "embedded"
    assert all(c["seconds"] >= 0 for c in meta["cells"])


def test_a_failing_cell_fails_the_run_and_its_copy_says_which(tmp_path):
    run, copy = execute(tmp_path, notebook("print('before')", "1 / 0", "print('after')"))
    assert run.returncode == 1 and "ZeroDivisionError" in run.stdout
    meta = copy["metadata"]["llmlab"]
    assert meta["failed"] == [1]
    assert copy["cells"][2]["outputs"][0]["ename"] == "ZeroDivisionError"


def test_a_key_printed_by_a_cell_fails_the_session_even_after_its_file_is_gone(tmp_path):
    """An engine's key file lives as long as its engine; the plugin reads it while it exists."""
    home = tmp_path / "home"
    (home / "keys").mkdir(parents=True)
    key_file = home / "keys" / "embedded-1.key"
    key_file.write_text("k3y-" + "x" * 39 + "\n")
    cells = (f"import time\nkey = open({str(key_file)!r}).read().strip()\ntime.sleep(1)",
             f"import os\nos.unlink({str(key_file)!r})  # the engine stops: its key is gone", "print(key)")
    run, copy = execute(tmp_path, notebook(*cells), home=home)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "an engine's API key appears in the outputs of" in run.stdout
    assert copy["metadata"]["llmlab"]["key_found"] is True


@pytest.fixture
def copies(tmp_path):
    """Executed copies of every lesson and solution, as a run writes them (outputs left as they are)."""
    for part in ("notebooks", "solutions"):
        for nb in (book.ROOT / part).glob("*.ipynb"):
            done = json.loads(nb.read_text())
            code = [c for c in done["cells"] if c["cell_type"] == "code"]
            done["metadata"]["llmlab"] = {"server": "embedded", "failed": [], "key_found": False,
                                          "cells": [{"cell": i, "outcome": "passed"} for i in range(len(code))]}
            (tmp_path / part).mkdir(exist_ok=True)
            (tmp_path / part / nb.name).write_text(json.dumps(done))
    (tmp_path / book.KEY_DIGESTS).touch()  # the run's record of its engines' keys (none here)
    return tmp_path


@pytest.mark.parametrize("spoil,message", [
    (None, None),
    (lambda nb: nb["metadata"]["llmlab"].update(failed=[3]), r"cells \[3\] failed"),
    (lambda nb: nb["metadata"]["llmlab"].update(key_found=True), "an API key appears"),
    (lambda nb: nb["metadata"]["llmlab"].update(server="cluster"), "not executed against the embedded server"),
    (lambda nb: nb["cells"][-1].update(source="print('edited since')"), "changed since it was executed"),
    (lambda nb: nb["metadata"]["llmlab"]["cells"][0].update(outcome="not run"), r"cells \[0\] .* were not run"),
    ("missing", "has no executed copy"),
])
def test_the_book_takes_only_a_complete_passing_current_copy(copies, spoil, message):
    nb = next((book.ROOT / "notebooks").glob("09_*.ipynb"))
    copy = copies / "notebooks" / nb.name
    if spoil == "missing":
        copy.unlink()
    elif spoil:
        done = json.loads(copy.read_text())
        spoil(done)
        copy.write_text(json.dumps(done))
    if message is None:
        assert book.executed_copy(nb, book.ROOT, copies)["metadata"]["llmlab"]["failed"] == []
        return
    with pytest.raises(book.StaleCopy, match=message) as e:
        book.executed_copy(nb, book.ROOT, copies)
    assert "notebooks/09_real_gpus.ipynb" in str(e.value) and "make test" in str(e.value)


def test_the_book_executes_nothing_and_stages_the_copies_and_the_exercises_as_learners_get_them(tmp_path, copies):
    assert 'nb_execution_mode = "off"' in (book.ROOT / "docs" / "book" / "conf.py").read_text()
    src = book.stage(tmp_path / "src", executed=copies)
    assert (src / "conf.py").is_file() and "notebooks/*" in (src / "index.md").read_text()
    for part in book.PARTS:
        assert sorted(p.name for p in (src / part).glob("*.ipynb")) == \
            sorted(p.name for p in (book.ROOT / part).glob("*.ipynb"))
    ex = next((book.ROOT / "exercises").glob("03_*.ipynb"))
    staged_ex = json.loads((src / "exercises" / ex.name).read_text())
    assert staged_ex["cells"] == json.loads(ex.read_text())["cells"]  # as learners get them: not run
    assert staged_ex["metadata"]["language_info"]["pygments_lexer"] == "ipython3"  # `!` lines are IPython's
    staged = json.loads((src / "notebooks" / "09_real_gpus.ipynb").read_text())
    assert staged["metadata"]["llmlab"]["failed"] == []  # the executed copy, not the repository's notebook
    (tmp_path / "src" / "notebooks" / "renamed_lesson.ipynb").write_text("{}")  # a lesson since renamed
    book.stage(tmp_path / "src", executed=copies)  # staging again starts from an empty folder
    assert not (src / "notebooks" / "renamed_lesson.ipynb").exists()


class _Stop(Exception):
    """Raised where the engine's processes would start: the key is made by then, and nothing runs."""


@pytest.mark.parametrize("engine", ["engine of lessons 11-13 (engines.start)", "router of lesson 15"])
def test_every_engine_a_lesson_starts_notes_its_keys_digest_never_the_key(engine, tmp_path, monkeypatch):
    """The router keeps its key in a run folder of its own, outside LLMLAB_HOME, where the run's watcher of key
    files never looked: its key could reach the book."""
    log = tmp_path / "keys.sha256"
    monkeypatch.setenv("LLMLAB_KEY_DIGESTS", str(log))

    def stop(*args, **kwargs):
        raise _Stop

    if engine.startswith("router"):
        monkeypatch.setattr(replicas, "proxy_command", stop)
        server = replicas.Router([tmp_path / "replica.sock"])
    else:
        monkeypatch.setattr(embedded, "engine_command", stop)
        server = embedded.EmbeddedServer(extra_args=["--kv-cache-dtype", "fp8"])
    with pytest.raises(_Stop):
        server.start()
    key = server.key_file.read_text().strip()
    server.stop()
    assert noted_keys(log) == {len(key): {key_digest(key)}}
    assert key not in log.read_text() and stat.S_IMODE(log.stat().st_mode) == 0o600


def test_a_book_page_holding_a_stopped_secondary_engines_key_fails_the_build_naming_the_file(copies, tmp_path,
                                                                                            monkeypatch, capsys):
    """Lesson 15's router: its key file sat outside LLMLAB_HOME and is gone once the router stops, so the run's
    verdict in the copy's metadata says no key; the book checks the page against the run's record of digests."""
    monkeypatch.setenv("LLMLAB_KEY_DIGESTS", str(copies / book.KEY_DIGESTS))
    key_file = tmp_path / "llmlab-router-x" / "router.key"
    key = new_key_file(key_file)
    key_file.unlink()  # the router stopped
    copy = copies / "notebooks" / "15_replicas_and_routing.ipynb"
    done = json.loads(copy.read_text())
    cell = next(c for c in done["cells"] if c["cell_type"] == "code")
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"curl -H 'Authorization: Bearer {key}'\n"}]
    copy.write_text(json.dumps(done))
    assert done["metadata"]["llmlab"]["key_found"] is False

    assert book.build(tmp_path / "out", tmp_path / "src", executed=copies) == 2
    said = capsys.readouterr()
    assert "the executed copy of notebooks/15_replicas_and_routing.ipynb cannot go into the book" in said.err
    assert "API key of an engine the run started" in said.err and key not in said.err + said.out
    assert not (tmp_path / "out").exists()


def test_the_book_refuses_copies_without_the_runs_record_of_its_keys(copies):
    (copies / book.KEY_DIGESTS).unlink()
    nb = next((book.ROOT / "notebooks").glob("09_*.ipynb"))
    with pytest.raises(book.StaleCopy, match="keys.sha256 is missing.*make test"):
        book.executed_copy(nb, book.ROOT, copies)


def test_a_key_glued_to_other_characters_is_found_by_its_digest():
    key = "Zq3" + "x" * 40
    digests = {len(key): {key_digest(key)}}
    assert book.holds_key(f"url?key={key}abc", digests) and book.holds_key(f'"{key}"', digests)
    assert not book.holds_key(f"{key[:-1]}", digests) and not book.holds_key("no key here", digests)
