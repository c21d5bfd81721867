"""The room survives a relaunch (issue 47, item 2; instructor-review-3, item 7): a hand-over under the SLURM test bed.

One learner account in a group made for the run (``llmlab.ops.room``'s accounts), the instructor's job of the tiny
model shared with it (``llmlab launch llmlab-tiny-cpu --share GROUP``), then a second job on the same share folder,
and the first stopped once the second is READY -- the relaunch an instructor does to extend the server's time.  A
thread watches the room's ``server.json`` all along, and the learner runs ``llmlab.connect()`` and a completion at
each step.  Before the fix, ``llmlab launch`` wrote a "loading" ``server.json`` at submission (over the running
server's) and the first job's clean-up deleted the second job's file: the learner was cut off twice.  Then the
instructor revokes the learner and gives them back (``llmlab revoke JOB USER --undo``).

Two jobs of a CPU vLLM each: about four minutes on a 2-core machine.  Skipped (with the reason) where the test
cannot create users (not root) or SLURM's test bed cannot run.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from slurm_helpers import needs_slurm, wait_for

from llmlab import cluster
from llmlab.ops import jobs, room

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creates a UNIX account for its learner: needs root (CI is root)"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in room.TOOLS),
                       reason=f"a room needs {', '.join(room.TOOLS)}"),
    needs_slurm,
]

LEARN = """
import json, llmlab
try:
    client, model = llmlab.connect(quiet=True)
    r = client.completions.create(model=model, prompt="In the beginning", max_tokens=4, extra_body={"ignore_eos": True})
    print(json.dumps({"url": str(client.base_url).rstrip("/"), "tokens": r.usage.completion_tokens}))
except Exception as e:
    print(json.dumps({"error": str(e)}))
"""


class RoomFileWatch(threading.Thread):
    """Each (job id, status) the room's ``server.json`` goes through, ``None`` while there is none, polled every
    0.1 s: a learner who connects in a gap, however short, finds no server."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.seen, self.done = path, [], threading.Event()

    def run(self):
        while not self.done.wait(0.1):
            self.look()
        self.look()

    def look(self):
        try:
            info = json.loads(self.path.read_text())
            now = (info.get("job_id"), info.get("status"))
        except FileNotFoundError:
            now = None
        except (OSError, ValueError):
            return
        if not self.seen or self.seen[-1] != now:
            self.seen.append(now)


def learner_connects(r: room.Room) -> dict:
    """The learner's ``connect()`` and one completion, as the learner (their uid, the room's group): the URL it
    reached and the tokens, or the error's sentence."""
    name = r.learners[0]
    done = subprocess.run(["setpriv", f"--reuid={r.uids[name]}", f"--regid={grp.getgrnam(r.group).gr_gid}",
                           "--init-groups", "--", room.learner_python(), "-c", LEARN],
                          cwd=r.home(name), env=room.learner_env(r, name), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def launch_shared(r: room.Room) -> str:
    """``llmlab launch llmlab-tiny-cpu --share GROUP --share-dir DIR`` on one node: the job id."""
    return jobs.launch(cluster.prepare(room.JOB, nodes=1, share=r.group, share_dir=str(r.share_dir))).job_id


def ready(job_id: str) -> str:
    """Wait until the job serves; its URL."""
    st = jobs.wait(job_id, timeout=900, poll=1)
    assert st.state == "READY", f"job {job_id}: {st.state} {st.detail}"
    return jobs.server_info(job_id).base_url.rstrip("/")


def loading(job_id: str) -> bool:
    """True once the job's launcher publishes "loading" (LOADING); an end before it fails the test with why."""
    st = jobs.status(job_id)
    assert st.state not in ("READY", "FAILED", "STOPPED"), f"job {job_id}: {st.state} {st.detail}"
    return st.state == "LOADING"


def undo(job_id: str, name: str) -> subprocess.CompletedProcess:
    """``llmlab revoke JOB USER --undo``, as the instructor types it."""
    return subprocess.run([sys.executable, "-m", "llmlab", "revoke", job_id, name, "--undo"], capture_output=True,
                          text=True, timeout=60)


def hand_over(r: room.Room, seen: dict) -> None:
    """Job A READY, a learner on it; job B launched and loading; B READY; A stopped; B revokes and gives back the
    learner; B stopped.  What the learner and the room's file showed at each step goes into ``seen``."""
    server_json = r.share_dir / "server.json"
    a = seen["a"] = launch_shared(r)
    seen["after_sbatch"] = server_json.exists()
    seen["url_a"] = ready(a)
    seen["learner_on_a"] = learner_connects(r)
    b = seen["b"] = launch_shared(r)
    wait_for(lambda: loading(b), 600, f"job {b}'s launcher to publish 'loading'", poll=0.5)
    seen["learner_while_b_loads"] = learner_connects(r)
    seen["b_state_then"] = jobs.status(b).state
    seen["url_b"] = ready(b)
    seen["learner_before_a_stops"] = learner_connects(r)
    seen["a_stopped"] = jobs.stop(a).state
    seen["learner_after_a_stopped"] = learner_connects(r)
    learner = seen["learner"] = r.learners[0]
    jobs.revoke(b, learner)
    seen["learner_revoked"] = learner_connects(r)
    seen["undo"], seen["undo_again"] = undo(b, learner), undo(b, learner)
    seen["learner_given_back"] = learner_connects(r)
    seen["b_stopped"] = jobs.stop(b).state


@pytest.fixture(scope="module")
def relaunch(slurm_env):
    """One hand-over for the module (two jobs take minutes); every account, job and file it made removed after."""
    r = room.new_room(1, Path(tempfile.mkdtemp(prefix="llmlab-relaunch-test-")))
    seen: dict = {}
    watch = RoomFileWatch(r.share_dir / "server.json")
    with room.scoped_env(LLMLAB_HOME=str(r.instructor_home), LLMLAB_PYTHON=sys.executable,
                         PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                         SLURM_CONF=slurm_env["SLURM_CONF"]):
        try:
            room.create_accounts(r)
            watch.start()
            hand_over(r, seen)
        finally:
            watch.done.set()
            watch.join()
            for job in (seen.get("a"), seen.get("b")):
                if job and jobs.status(job).state != "STOPPED":
                    jobs.stop(job)
            room.clean_up(r)
            shutil.rmtree(r.out, ignore_errors=True)
    print(f"\nrelaunch: the room's server.json went through {watch.seen}")
    return {**seen, "files_seen": watch.seen}


def test_the_room_file_is_written_only_by_a_ready_job(relaunch):
    """Not when SLURM accepts the job, and never "loading" over the running server's file: before, `llmlab launch`
    wrote the room's file at submission, status "loading", and cut the learners off a server that worked."""
    s = relaunch
    assert s["after_sbatch"] is False
    assert all(state is None or state[1] == "ready" for state in s["files_seen"]), s["files_seen"]


def test_a_learner_stays_on_the_running_server_while_the_new_job_loads(relaunch):
    s = relaunch
    assert s["learner_on_a"] == {"url": s["url_a"], "tokens": 4}
    assert s["b_state_then"] == "LOADING", s["b_state_then"]  # the new job ran, its launcher publishing "loading"
    assert s["learner_while_b_loads"] == {"url": s["url_a"], "tokens": 4}


def test_the_new_job_takes_the_room_over_at_ready_and_the_old_ones_clean_up_leaves_it(relaunch):
    """The hand-over: B READY takes the file over; stopping A (its clean-up in slurm/llmlab-serve.sh) leaves B's
    file, so a learner's connect() works throughout.  Before, A's clean-up deleted B's file: no server for anyone."""
    s = relaunch
    assert s["files_seen"] == [None, (s["a"], "ready"), (s["b"], "ready"), None], s["files_seen"]
    assert s["learner_before_a_stops"] == {"url": s["url_b"], "tokens": 4}
    assert s["a_stopped"] == "STOPPED"
    assert s["learner_after_a_stopped"] == {"url": s["url_b"], "tokens": 4}


def test_the_last_jobs_clean_up_removes_its_own_room_file(relaunch):
    s = relaunch
    assert s["b_stopped"] == "STOPPED" and s["files_seen"][-1] is None


def test_a_learner_revoked_by_mistake_is_given_back(relaunch):
    """`llmlab revoke JOB USER --undo`: the learner's next connect() works again; undone twice, one sentence."""
    s = relaunch
    assert "revoked" in s["learner_revoked"]["error"], s["learner_revoked"]
    name = s["learner"]
    assert s["undo"].returncode == 0 and s["undo"].stdout.strip() == (
        f"{name} may use job {s['b']}'s server again: their next llmlab.connect() registers their key")
    assert s["learner_given_back"] == {"url": s["url_b"], "tokens": 4}
    assert s["undo_again"].returncode == 2
    assert s["undo_again"].stderr.startswith(f"llmlab: {name} is not revoked in ")
    assert "nothing to undo" in s["undo_again"].stderr and s["undo_again"].stderr.count("\n") == 1
