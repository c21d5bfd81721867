"""A rehearsed workshop room: one shared server, N learners running the 3-hour path at once, and a report.

Why: a room is where a course fails in ways no single-user test shows -- a cell that asserts a fact of an idle
server, a key ring that lets one revocation reach a neighbour, a path that takes one learner twice as long as the
others, a server whose queue grows while thirty kernels import pandas.  ``llmlab room --learners N`` (``make room``)
plays the room on this machine, under SLURM (the test bed: ``python tests/slurm_testbed.py up``), as root:

1. the instructor's job: ``llmlab launch llmlab-tiny-cpu --share GROUP`` (the launcher's CPU job, its key-checking
   proxy, a share directory with a key per learner), followed to READY;
2. N UNIX accounts in a group made for the run, each with a home of its own;
3. each learner, as their own user (``setpriv``), runs the path's notebooks (``llmlab course --path``), each
   lesson followed by its path exercises as solved (``write_path(exercises=True)``: the view has passes), in kernels
   of their own (``llmlab.ops.roomlearner``), a few seconds after the previous one sat down, with their own key
   from ``llmlab.connect()``, and hands their progress in (``llmlab progress --hand-in``);
4. meanwhile the instructor scrapes ``/metrics`` every half second, revokes the last learner when they open a given
   notebook (``llmlab revoke``), and one learner's kernel is restarted mid-notebook;
5. ``llmlab progress --room`` lists who handed in; then everything the run made is removed -- accounts,
   processes, keys, files, the job -- and what is still there is reported as ``left_behind``.

The report (``report.json``, ``timelines.png``, every learner's request trace, see :mod:`llmlab.ops.roomreport`)
goes to ``--out`` (default ``build/room``).  ``llmlab room --replay`` sends those traces again for K learners.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmlab.check import progress
from llmlab.ops import course, roomreport

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds llmlab/ (a checkout, or site-packages)
JOB = "llmlab-tiny-cpu"
REVOKE_AT = "03_online_inference"       # the revoked learner opens this notebook: the instructor revokes them
RESTART_AT = ("04_sampling", 4)         # a learner's kernel restarts after this cell of this notebook
TOOLS = ("useradd", "userdel", "groupadd", "groupdel", "setpriv", "sbatch")


class RoomError(RuntimeError):
    """The room cannot run here; the message names what is missing and how to get it."""


@dataclass
class Room:
    """What one run made (its names carry a random tag, so that clean-up removes only what this run made)."""

    tag: str
    group: str
    learners: list[str]
    work: Path                     # /tmp/llmlab-room-TAG: homes, share dir, hand-in folder, instructor's home
    out: Path
    uids: dict[str, int] = field(default_factory=dict)
    job_id: str | None = None
    t0: float = field(default_factory=time.time)

    def home(self, name: str) -> Path:
        return self.work / "homes" / name

    def files(self, name: str) -> Path:
        """The learner's own files the instructor reads: events, results, trace."""
        return self.home(name) / "room"

    @property
    def share_dir(self) -> Path:
        return self.work / "share"

    @property
    def hand_in_dir(self) -> Path:
        return self.work / "hand-in"

    @property
    def instructor_home(self) -> Path:
        return self.work / "instructor"


def say(room: Room | None, text: str) -> None:
    """One progress line, with the minutes and seconds since the room started."""
    s = int(time.time() - room.t0) if room else 0
    print(f"[room {s // 60:02d}:{s % 60:02d}] {text}", flush=True)


# --------------------------------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------------------------------

def check_machine() -> None:
    """Root, the account tools, setpriv and a reachable SLURM: else one sentence with the fix."""
    if os.geteuid() != 0:
        raise RoomError("llmlab room creates UNIX accounts for its learners: run it as root, on a machine of its "
                        "own (a VM or the CI machine), never on a cluster's login node.")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise RoomError(f"llmlab room needs {', '.join(missing)} on PATH (Debian: apt-get install passwd util-linux "
                        "slurm-client).")
    probe = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    if probe.returncode:
        raise RoomError(f"SLURM does not answer here ({probe.stderr.strip()}): start the test bed "
                        "(`python tests/slurm_testbed.py up`, then `export SLURM_CONF=/tmp/llmlab-slurm-testbed/"
                        "slurm.conf`) or run `make room`, which does both.")


def learner_python() -> str:
    """An interpreter a learner can run with this environment's packages: this one, unless it lives in a folder
    other users cannot enter (pyenv under root's 0700 home); then the system Python of the same minor version."""
    exe = Path(os.path.realpath(sys.executable))
    if all(os.stat(p).st_mode & stat.S_IXOTH for p in [exe, *exe.parents]):
        return sys.executable
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not os.access(system, os.X_OK):
        raise RoomError(f"learners cannot run {exe} (a parent folder is closed to other users) and there is no "
                        f"{system}: install python{sys.version_info.major}.{sys.version_info.minor} or use a "
                        "virtual environment in a folder every user can enter.")
    return str(system)


def learner_env(room: Room, name: str) -> dict[str, str]:
    """What a learner's session has: their home, the room's connection file, llmlab and its packages."""
    home = room.home(name)
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "USER": name, "LOGNAME": name,
            "LANG": "C.UTF-8", "TMPDIR": str(home / "tmp"), "LLMLAB_HOME": str(home / ".llmlab"),
            "LLMLAB_CONNECTION_FILE": str(room.share_dir / "server.json"), "MPLBACKEND": "Agg",
            "PYTHONPATH": f"{PACKAGE_ROOT}:{sysconfig.get_paths()['purelib']}"}


@contextlib.contextmanager
def scoped_env(**values: str):
    """Set environment variables for the instructor's side of the run (sbatch hands them to the job), then put
    back what was there."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------------------
# Accounts, folders, the server
# --------------------------------------------------------------------------------------------------

def new_room(n: int, out: Path) -> Room:
    tag = secrets.token_hex(3)
    work = Path(tempfile.mkdtemp(prefix=f"llmlab-room-{tag}-"))
    os.chmod(work, 0o755)  # learners enter it to reach their homes and the share dir; each part is closed below
    return Room(tag, f"llmlab-room-{tag}", [f"llmroom-{tag}-{i + 1}" for i in range(n)], work, out)


def create_accounts(room: Room) -> None:
    """The room's group and one account per learner (no password, no login shell), each with a 0700 home."""
    subprocess.run(["groupadd", room.group], check=True, capture_output=True)
    gid = grp.getgrnam(room.group).gr_gid
    for name in room.learners:
        home = room.home(name)
        subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/usr/sbin/nologin",
                        "--no-user-group", "--gid", room.group, name], check=True, capture_output=True)
        room.uids[name] = pwd.getpwnam(name).pw_uid
        for sub in ("", "tmp", "room"):
            (home / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chown(home / sub, room.uids[name], gid)
    os.chmod(room.work / "homes", 0o755)
    room.hand_in_dir.mkdir()
    os.chown(room.hand_in_dir, 0, gid)
    os.chmod(room.hand_in_dir, 0o3770)  # sticky group folder: each learner adds and replaces only their own file


def start_server(room: Room, timeout: float = 900) -> dict:
    """``llmlab launch llmlab-tiny-cpu --share GROUP``, followed until READY; returns the instructor's view of it."""
    from llmlab import cluster
    from llmlab.ops import jobs

    plan = cluster.prepare(JOB, nodes=1, share=room.group, share_dir=str(room.share_dir))
    room.job_id = jobs.launch(plan).job_id
    say(room, f"job {room.job_id} ({JOB}, shared with {room.group}) submitted; waiting until it serves")
    st = jobs.wait(room.job_id, timeout=timeout, poll=2,
                   on_change=lambda s: say(room, f"  job: {s.state} - {s.detail}"))
    if st.state != "READY":
        raise RoomError(f"job {room.job_id} ended {st.state} before serving ({st.detail}): `llmlab logs {room.job_id}`"
                        f" (LLMLAB_HOME={room.instructor_home}) shows why.")
    info = jobs.server_info(room.job_id)
    return {"url": info.base_url, "key": info.key(), "model": info.model}


# --------------------------------------------------------------------------------------------------
# The learners
# --------------------------------------------------------------------------------------------------

def learner_spec(room: Room, name: str, notebooks: list[Path], restart: tuple[str, int] | None) -> Path:
    files = room.files(name)
    spec = {"name": name, "notebooks": [str(p) for p in notebooks], "workdir": str(room.home(name)),
            "trace": str(files / "trace.jsonl"), "events": str(files / "events.jsonl"),
            "results": str(files / "results.json"), "hand_in": str(room.hand_in_dir),
            "restart": {"notebook": restart[0], "after_cell": restart[1]} if restart else None}
    path = files / "spec.json"
    path.write_text(json.dumps(spec, indent=1))
    os.chmod(path, 0o644)
    return path


def start_learner(room: Room, name: str, spec: Path, python: str) -> subprocess.Popen:
    """The driver, as the learner (their uid, the room's group), in a session of its own (killed as one)."""
    uid, gid = room.uids[name], grp.getgrnam(room.group).gr_gid
    log = open(room.out / "learners" / f"{name}.log", "w")  # noqa: SIM115 -- closed by the caller's clean-up
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--",
                             python, "-m", "llmlab.ops.roomlearner", str(spec)],
                            cwd=room.home(name), env=learner_env(room, name), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def last_line_of(room: Room, name: str) -> str:
    """The last line of a learner's driver log: what a driver that died says about why."""
    with contextlib.suppress(OSError):
        lines = (room.out / "learners" / f"{name}.log").read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(its log is empty)"
    return "(no log)"


# A learner's file the room (root) reads: at most this many bytes (a path's trace is tens of KB).
MAX_LEARNER_FILE = 16 * 2**20


def learner_file(room: Room, name: str, part: str) -> bytes | None:
    """The bytes of the learner's ``part`` (events, results, trace), or None: opened without following a link and
    without blocking on a FIFO, and read only if it is a regular file of that learner's own uid, at most
    ``MAX_LEARNER_FILE`` bytes.  Why: the room runs as root over files its learners control; a trace made a link
    to a root-only file was copied into the 0644 report (security-review-3, F8)."""
    try:
        fd = os.open(room.files(name) / part, progress.OPEN_UNTRUSTED)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != room.uids.get(name, -1):
            return None
        chunks, left = [], MAX_LEARNER_FILE
        while left > 0 and (chunk := os.read(fd, min(left, 2**20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def events_of(room: Room, name: str) -> list[dict]:
    """The learner's events, each a JSON object; lines that are not one (cut by a killed process, or junk) left out."""
    out = []
    for line in (learner_file(room, name, "events.jsonl") or b"").decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(event := json.loads(line), dict):
                out.append(event)
    return out


def where(room: Room, name: str) -> str:
    """Where a learner is, in a few words, from their events; printable (a learner's strings may hold escapes)."""
    ev = events_of(room, name)
    notebooks = [e for e in ev if e.get("kind") == "notebook" and isinstance(e.get("notebook"), str)]
    if not ev:
        return "starting"
    if ev[-1].get("kind") == "done":
        return "done"
    cells = [e for e in ev if e.get("kind") == "cell" and notebooks and e.get("notebook") == notebooks[-1]["notebook"]]
    here = f"{notebooks[-1]['notebook'][:2]} cell {cells[-1].get('cell') if cells else 0}" if notebooks else "starting"
    return progress.printable(here, 40)


class Scraper(threading.Thread):
    """``/metrics`` with the instructor's key every ``every`` seconds: running and waiting requests, KV use."""

    def __init__(self, url: str, key: str, every: float = 0.5):
        super().__init__(name="llmlab-room-metrics", daemon=True)
        self.url, self.key, self.every = url, key, every
        self.samples: list[dict] = []
        self.errors = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        from llmlab.serve import metrics as vm  # vLLM's metric names: the one vocabulary

        while not self.stopped.wait(self.every):
            try:
                m = vm.fetch_metrics(self.url, self.key, timeout=5)
            except Exception:  # noqa: BLE001 -- a missed scrape is a gap in the curve, not a failed room
                self.errors += 1
                continue
            self.samples.append({"t": time.time(),
                                 "running": m.value(vm.RUNNING, default=0.0),
                                 "waiting": m.value(vm.WAITING, default=0.0),
                                 "kv_pct": 100 * m.value(vm.KV_USAGE, default=0.0)})


def run_learners(room: Room, notebooks: list[Path], server: dict, *, stagger: float, revoke: bool, restart: bool,
                 timeout: float) -> dict:
    """Seat the learners ``stagger`` seconds apart, revoke and restart as planned, wait for all to finish."""
    python = learner_python()
    n = len(room.learners)
    revoked = room.learners[-1] if revoke and n >= 2 else None
    restarted = room.learners[1 if n >= 3 else 0] if restart else None
    plan = {"path": [p.stem for p in notebooks], "revoked": revoked, "revoke_at": REVOKE_AT if revoked else None,
            "restarted": restarted,
            "restart_at": list(RESTART_AT) if restarted else None, "revocation": None}
    scraper = Scraper(server["url"], server["key"])
    scraper.start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        for i, name in enumerate(room.learners):
            if i:
                time.sleep(stagger)
            spec = learner_spec(room, name, notebooks, RESTART_AT if name == restarted else None)
            procs[name] = start_learner(room, name, spec, python)
            say(room, f"{name} sat down (pid {procs[name].pid})")
        deadline, last_line, ended = time.monotonic() + timeout, 0.0, set()
        while any(p.poll() is None for p in procs.values()):
            for name in [n for n, p in procs.items() if p.poll() is not None and n not in ended]:
                ended.add(name)
                say(room, f"{name} is done" if procs[name].returncode == 0 else
                    f"{name}'s driver failed (exit {procs[name].returncode}): {last_line_of(room, name)}")
            if revoked and plan["revocation"] is None and any(
                    e.get("kind") == "notebook" and e.get("notebook") == REVOKE_AT for e in events_of(room, revoked)):
                plan["revocation"] = {"t": time.time(), "said": instructor_revokes(room, revoked)}
                say(room, f"instructor: {plan['revocation']['said']}")
            if time.monotonic() - last_line > 15:
                say(room, "  " + "; ".join(f"{nm.rsplit('-', 1)[-1]}: {where(room, nm)}" for nm in room.learners)
                    + (f"; server {scraper.samples[-1]['running']:.0f} running, "
                       f"{scraper.samples[-1]['waiting']:.0f} waiting" if scraper.samples else ""))
                last_line = time.monotonic()
            if time.monotonic() > deadline:
                raise RoomError(f"the learners were not done after {timeout:.0f} s: their logs are in "
                                f"{room.out / 'learners'}; raise --timeout for a slower machine.")
            time.sleep(0.5)
    finally:
        scraper.stopped.set()
        scraper.join(timeout=10)
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            if p.stdout:
                p.stdout.close()
    plan["exit_codes"] = {name: p.returncode for name, p in procs.items()}
    plan["metrics"] = scraper.samples
    plan["metrics_errors"] = scraper.errors
    return plan


def instructor_revokes(room: Room, name: str) -> str:
    """``llmlab revoke JOB USER``, as the instructor types it: what it printed (or why it failed)."""
    done = subprocess.run([sys.executable, "-m", "llmlab", "revoke", room.job_id, name], capture_output=True,
                          text=True, timeout=120)
    return (done.stdout + done.stderr).strip()


def job_status(room: Room) -> str:
    """What ``llmlab status JOB`` says of the room's job: READY, and the learners registered and revoked."""
    from llmlab.ops import jobs

    return jobs.status(room.job_id).detail


def room_listing(room: Room) -> tuple[list[dict], str]:
    """``llmlab progress --room DIR``, as the instructor runs it: the JSON rows and the text."""
    cmd = [sys.executable, "-m", "llmlab", "progress", "--room", str(room.hand_in_dir)]
    rows = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    try:
        parsed = json.loads(rows.stdout)
    except ValueError:
        parsed = []
    return parsed, (text.stdout + text.stderr).strip()


def collect(room: Room) -> None:
    """Copy each learner's trace, events and results into the report folder, before their homes go."""
    for name in room.learners:
        for part in ("trace.jsonl", "events.jsonl", "results.json"):
            data = learner_file(room, name, part)  # their own regular file only (learner_file says why)
            if data is not None:
                (room.out / ("traces" if part == "trace.jsonl" else "learners") / f"{name}.{part}").write_bytes(data)


# --------------------------------------------------------------------------------------------------
# Clean-up, and what it left
# --------------------------------------------------------------------------------------------------

def processes_of(uids: set[int]) -> list[int]:
    """Pids whose real uid is one of ``uids`` (the learners': nothing else runs under them)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        if uid_line and int(uid_line.split()[1]) in uids:
            found.append(int(pid))
    return found


def job_processes(job_id: str) -> list[int]:
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
    return found


def stop_processes(uids: set[int], wait: float = 10) -> None:
    """TERM, then KILL, every process of the learners (a kernel a driver could not shut down)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_of(uids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while processes_of(uids) and time.monotonic() < deadline:
            time.sleep(0.3)


def stop_job(room: Room) -> None:
    from llmlab.ops import jobs

    if not room.job_id:
        return
    say(room, f"stopping job {room.job_id}")
    try:
        jobs.stop(room.job_id)
    except Exception as e:  # noqa: BLE001 -- clean-up goes on; left_behind says what stayed
        say(room, f"  stopping job {room.job_id}: {e}")
        subprocess.run(["scancel", room.job_id], capture_output=True, timeout=30)
    with contextlib.suppress(OSError):  # the job's output, for the report, before its home goes
        for log in (room.instructor_home / "logs").glob(f"llmlab-{room.job_id}.out"):
            shutil.copyfile(log, room.out / "job.out")


def clean_up(room: Room) -> None:
    """Remove what the run made: the job, the learners' processes, their accounts and group, every file."""
    stop_job(room)
    uids = set(room.uids.values())
    stop_processes(uids)
    for name in room.learners:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            subprocess.run(["userdel", name], capture_output=True, timeout=30)
    with contextlib.suppress(KeyError):
        grp.getgrnam(room.group)
        subprocess.run(["groupdel", room.group], capture_output=True, timeout=30)
    shutil.rmtree(room.work, ignore_errors=True)


def files_of(uids: set[int], roots=("/tmp", "/var/tmp", "/dev/shm", "/var/mail", "/run/user")) -> list[str]:
    """Files anywhere under ``roots`` owned by one of the learners' uids (numbers now: the accounts are gone)."""
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: None):
            for entry in dirnames + filenames:
                path = os.path.join(dirpath, entry)
                with contextlib.suppress(OSError):
                    if os.lstat(path).st_uid in uids:
                        found.append(path)
    return found


def left_behind(room: Room) -> list[str]:
    """Everything of the run that still exists after the clean-up: the goal is an empty list."""
    out = []
    for name in room.learners:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            out.append(f"account {name}")
    with contextlib.suppress(KeyError):
        grp.getgrnam(room.group)
        out.append(f"group {room.group}")
    uids = set(room.uids.values())
    out += [f"process {pid} of a learner's uid" for pid in processes_of(uids)]
    if room.job_id:
        out += [f"process {pid} of job {room.job_id}" for pid in job_processes(room.job_id)]
        state = subprocess.run(["squeue", "-h", "-j", room.job_id, "-o", "%T"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        if state:
            out.append(f"job {room.job_id} ({state})")
    if room.work.exists():
        out.append(f"folder {room.work}")
    out += [f"file {p}" for p in files_of(uids)]
    return out


# --------------------------------------------------------------------------------------------------
# The whole room
# --------------------------------------------------------------------------------------------------

def _interrupted(signum, frame):
    """SIGTERM (a CI time-out, ``kill``) ends the room like Ctrl-C: through the clean-up."""
    raise KeyboardInterrupt


def prepare_out(out: Path) -> Path:
    """The report folder, emptied -- only if it is empty or an earlier room's report (never another folder)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not (out / "report.json").exists() and not (out / "traces").is_dir():
            raise RoomError(f"{out} holds files that are not a room's report: choose an empty or new folder (--out).")
        shutil.rmtree(out)
    for sub in ("", "traces", "learners", "path"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    return out


def rehearse(learners: int = 3, out: str | Path = "build/room", *, stagger: float = 4.0, revoke: bool = True,
             restart: bool = True, timeout: float = 3600) -> dict:
    """Play a room of ``learners`` on this machine (see the module docstring); return the report (also written as
    ``OUT/report.json``).  Everything the run made is removed in a ``finally``, on Ctrl-C too."""
    if learners < 1:
        raise RoomError("a room needs at least one learner (--learners N).")
    check_machine()
    out = prepare_out(Path(out).resolve())
    room = new_room(learners, out)
    course.write_path(course.load(), out / "path", exercises=True)  # the record of what was run
    # what the learners open (a folder they reach): each lesson's sections, then its path exercises as solved
    notebooks = course.write_path(course.load(), room.work / "path", exercises=True)
    for nb in notebooks:
        os.chmod(nb, 0o644)
    os.chmod(room.work / "path", 0o755)
    names = [p.stem for p in notebooks]
    for wanted in (REVOKE_AT, RESTART_AT[0]):
        if wanted not in names:
            raise RoomError(f"the workshop path has no {wanted}; update REVOKE_AT/RESTART_AT in llmlab/ops/room.py.")
    say(room, f"{learners} learner(s) in group {room.group}; the path: {', '.join(names)}; report in {out}")
    plan, listing, server = {}, ([], ""), {}
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        with scoped_env(LLMLAB_HOME=str(room.instructor_home), LLMLAB_PYTHON=sys.executable,
                        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"):
            create_accounts(room)
            server = start_server(room)
            say(room, f"server ready at {server['url']} ({server['model']}); seating the learners {stagger:g} s apart")
            plan = run_learners(room, notebooks, server, stagger=stagger, revoke=revoke, restart=restart,
                                timeout=timeout)
            listing = room_listing(room)
            plan["job_status"] = job_status(room)
            say(room, "instructor: llmlab progress --room\n" + listing[1])
    finally:
        signal.signal(signal.SIGTERM, previous)
        collect(room)
        with scoped_env(LLMLAB_HOME=str(room.instructor_home)):
            clean_up(room)
        behind = left_behind(room)
        say(room, f"cleaned up; left behind: {behind or 'nothing'}")
    report = roomreport.build(room, plan, listing, behind, wall_s=time.time() - room.t0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    roomreport.plot_timelines(out, report)
    return report
