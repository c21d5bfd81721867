"""A rehearsed room, end to end (``llmlab room``, llmlab.ops.room): three learners, one shared job, one report.

One SLURM job (the launcher's CPU job of the tiny model, shared with a group made for the run) serves three UNIX
accounts made for the run; each runs the workshop path's notebooks in kernels of their own, the last is revoked when
they open lesson 03, the second's kernel restarts in lesson 04; all hand in.  The report must say: no cell failed,
all three handed in and ``llmlab progress --room`` lists them, the revoked learner was refused with a sentence (and
nobody else was) after ``llmlab revoke`` said so, ``llmlab status`` counts two keys registered and one revoked, the
restarted learner walked the whole path, and nothing of the run is left.  Skipped (with the
reason) where the test cannot create users (not root) or SLURM's test bed cannot run.

About two minutes on a 2-core machine: the room took 122.7 s on a clean clone of 2026-11-28, 203 s on CI before the
CPU engine kept its worker inside the engine core (one process less to start, serve.vllm.unbound_cpu_env).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from slurm_helpers import needs_slurm

from llmlab.ops import room

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creates UNIX accounts for its learners: needs root (CI is root)"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in room.TOOLS),
                       reason=f"a room needs {', '.join(room.TOOLS)}"),
    needs_slurm,
]


@pytest.fixture(scope="module")
def report(slurm_env):
    """One room for the module.  Its report goes to a folder of its own, not pytest's tmp_path: pytest prunes the
    numbered folders of older sessions, and another session on the machine could take this one mid-run."""
    parent = Path(tempfile.mkdtemp(prefix="llmlab-room-test-"))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = slurm_env["SLURM_CONF"]
    try:
        yield room.rehearse(3, parent / "report", stagger=3.0, timeout=1500), parent / "report"
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        shutil.rmtree(parent, ignore_errors=True)


def test_room_of_three_runs_the_path_with_nothing_failed(report):
    r, out = report
    assert r["learners"] == 3 and len(r["names"]) == 3
    assert r["cells_failed"] == [], "\n".join(f"{c['learner']} {c['notebook']} cell {c['cell']}: {c['error']} "
                                              f"(raised at: {c['raised_at']})" for c in r["cells_failed"])
    assert set(r["path_seconds"]) == set(r["names"]) and r["fairness"] >= 1.0
    assert r["latency_ms"]["requests"] > 0 and r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert r["server"]["peak_running"] >= 1 and r["server"]["samples"] > 0


def test_room_everyone_handed_in_and_the_room_lists_them(report):
    r, _ = report
    assert sorted(r["handed_in"]) == sorted(r["names"])
    assert all(name in r["progress_room"] for name in r["names"])


def test_room_learners_pass_the_paths_exercises_and_the_room_view_shows_it(report):
    """Issue 47: the room ran the lessons' sections only, and its progress view said 0 passed; now each lesson is
    followed by its path exercises as solved, and the first learner (neither revoked nor restarted) passed every
    check they call."""
    r, out = report
    checks = sum(len(set(re.findall(r"llmlab\.check\.(\w+)\(", p.read_text())))
                 for p in (out / "path").glob("*.exercises.ipynb"))
    first = next(line for line in r["progress_room"].splitlines() if line.startswith(r["names"][0]))
    assert checks >= 6 and int(first.split()[1]) == checks, r["progress_room"]


def test_room_revoked_learner_gets_one_sentence_and_nobody_else_notices(report):
    r, _ = report
    rev = r["revocation"]
    assert rev["learner"] == r["names"][-1] and rev["refused"], rev
    assert "revoked" in rev["sentence"] and "\n" not in rev["sentence"]
    assert rev["others_refused"] == []
    said = f"{rev['learner']} can no longer use job {r['job']}'s server (their key stops working within a second)"
    assert rev["instructor"] == said  # what `llmlab revoke JOB USER` printed
    assert r["job_status"].endswith(f"shared with group {r['group']}: 2 learner(s) registered, 1 revoked"), \
        r["job_status"]  # `llmlab status JOB` counts the room's keys


def test_room_restarted_kernel_learner_completes_the_path(report):
    r, _ = report
    rst = r["restart"]
    assert rst["learner"] == r["names"][1] and rst["notebook"] == room.RESTART_AT[0]
    assert rst["notebook_completed"] and rst["path_completed"], rst


def test_room_leaves_nothing_behind_and_keeps_its_report(report):
    r, out = report
    assert r["left_behind"] == []
    assert json.loads((out / "report.json").read_text())["learners"] == 3
    assert (out / "timelines.png").stat().st_size > 10_000
    for name in r["names"]:
        assert (out / "traces" / f"{name}.trace.jsonl").stat().st_size > 0
