"""The workshop room's progress folder (``llmlab progress --hand-in DIR`` and ``--room DIR``) against a fellow
learner: two UNIX users of one group, the folder made as docs/workshop.md says (``install -d -m 3770 -g GROUP``),
and the instructor (the test's own user) reading it.  Findings 1 and 4 of security-review-2; each test failed
before the fix (the hand-in wrote through a planted ``.<user>.json.tmp`` and chmod-ed its target; the room showed a
file under the name it claimed)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from attacker import ATTACKER, as_attacker, llmlab_as, needs_attacker, system_user

pytestmark = needs_attacker

VICTIM = "llmlab-victim"
PRECIOUS = "PRECIOUS\n"


@pytest.fixture(scope="module")
def victim(attacker) -> tuple[int, int]:
    """A second learner of the attacker's group: the one whose hand-in the attacker goes after."""
    return system_user(VICTIM).pw_uid, attacker[1]


@pytest.fixture
def room(attacker, victim):
    """(the room's folder, the victim's LLMLAB_HOME, a 0600 file of the victim's that the attacker can name)."""
    parent = Path(tempfile.mkdtemp(prefix="llmlab-progress-"))  # not under pytest's 0700 folder: learners enter
    parent.chmod(0o755)
    folder = parent / "progress"
    folder.mkdir()
    os.chown(folder, -1, attacker[1])
    folder.chmod(0o3770)  # docs/workshop.md's recipe
    mine = parent / "victim-files"
    home, precious = mine / "home", mine / "precious"
    home.mkdir(parents=True)
    precious.write_text(PRECIOUS)
    for path in (mine, home, precious):
        os.chown(path, victim[0], victim[1])
    mine.chmod(0o755)
    home.chmod(0o700)
    precious.chmod(0o600)
    yield folder, home, precious
    shutil.rmtree(parent, ignore_errors=True)


def untouched(precious: Path) -> bool:
    st = precious.lstat()
    return precious.read_text() == PRECIOUS and stat.S_IMODE(st.st_mode) == 0o600 and stat.S_ISREG(st.st_mode)


def test_a_hand_in_follows_no_link_a_fellow_learner_planted(attacker, victim, room):
    """Finding 1: the other learner plants every predictable name of the victim's hand-in as a symlink to a 0600
    file of the victim's; the victim hands in.  The victim's file keeps its text and its mode, the hand-in is a
    regular file of the victim's, 0640, and the attacker can neither replace nor move it (the sticky folder)."""
    folder, home, precious = room
    planted = [f".{VICTIM}.json.tmp", f".{VICTIM}.json", f"{VICTIM}.json.tmp", f".{VICTIM}.tmp", f"{ATTACKER}.json"]
    for name in planted:
        assert as_attacker(attacker, "ln", "-s", str(precious), str(folder / name)).returncode == 0
    done = llmlab_as(victim, home, "progress", "--hand-in", str(folder))
    assert untouched(precious)
    assert done.returncode == 0, done.stderr.decode()
    handed = folder / f"{VICTIM}.json"
    st = handed.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == victim[0] and stat.S_IMODE(st.st_mode) == 0o640
    assert json.loads(handed.read_text())["user"] == VICTIM
    assert sorted(p.name for p in folder.iterdir()) == sorted([*planted, f"{VICTIM}.json"])  # no temp file left
    assert as_attacker(attacker, "sh", "-c", 'echo "{}" > "$0"', str(folder / "mine.json")).returncode == 0
    for cmd in (["mv", "-f", str(folder / "mine.json"), str(handed)], ["ln", "-sfn", str(precious), str(handed)],
                ["rm", "-f", str(handed)]):
        assert as_attacker(attacker, *cmd).returncode != 0, cmd
    assert handed.lstat().st_ino == st.st_ino and untouched(precious)


def test_a_name_taken_before_the_learner_came_is_refused_in_one_sentence(attacker, victim, room):
    """The sticky folder keeps a file the other learner made under the victim's name: the hand-in says whose it is
    and who can remove it (not a bare EPERM), and the room does not show it as the victim's."""
    from llmlab.check import progress

    folder, home, precious = room
    fake = {"user": VICTIM, "handed in": "-", "lessons": [{"lesson": "06_threaded_requests", "passed": 5, "total": 5}]}
    squat = as_attacker(attacker, "sh", "-c", 'printf "%s" "$1" > "$0"', str(folder / f"{VICTIM}.json"),
                        json.dumps(fake))
    assert squat.returncode == 0
    done = llmlab_as(victim, home, "progress", "--hand-in", str(folder))
    assert done.returncode == 2 and done.stderr.decode() == (
        f"llmlab: {folder}/{VICTIM}.json is there already and belongs to {ATTACKER}, not to you: ask your instructor "
        "to remove it, then hand in again.\n")
    rows, notes = progress.read_room(folder)
    assert rows == [] and notes == [f"skipped {VICTIM}.json: it belongs to {ATTACKER}, and only {ATTACKER}.json "
                                    "can be theirs"]
    assert untouched(precious)


def test_the_room_shows_each_hand_in_under_its_owner_only(attacker, victim, room, capsys):
    """Finding 4: the victim hands in with $USER set to the attacker's name (which must not matter); the other
    learner hands in a file claiming to be the victim, a second one under another name, and escape sequences for
    the instructor's terminal.  The room shows the victim's own table under the victim's name, the attacker's
    file under the attacker's name, and skips the rest with a line each."""
    from llmlab.check import progress
    from llmlab.ops.cli import main

    folder, home, _ = room
    done = llmlab_as(victim, home, "progress", "--hand-in", str(folder), env={"USER": ATTACKER, "LOGNAME": ATTACKER})
    assert done.returncode == 0 and [p.name for p in folder.iterdir()] == [f"{VICTIM}.json"], done.stderr.decode()
    claim = {"user": VICTIM + "\x1b[2J", "handed in": "\x1b[31mnow",
             "lessons": [{"lesson": "06_threaded_requests", "passed": 5, "total": 5}]}
    for name in (f"{ATTACKER}.json", "zz.json"):
        made = as_attacker(attacker, "sh", "-c", 'printf "%s" "$1" > "$0"', str(folder / name), json.dumps(claim))
        assert made.returncode == 0
    rows = {r["user"]: r for r in progress.room(folder)}
    assert set(rows) == {ATTACKER, VICTIM}
    assert rows[ATTACKER]["06_threaded_requests"] == "5/5" and rows[ATTACKER]["handed in"] == "?[31mnow"
    assert rows[VICTIM]["06_threaded_requests"] == "0/5" and rows[VICTIM]["passed"] == 0
    capsys.readouterr()
    assert main(["progress", "--room", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert out.splitlines()[-1] == f"skipped zz.json: it belongs to {ATTACKER}, and only {ATTACKER}.json can be theirs"
