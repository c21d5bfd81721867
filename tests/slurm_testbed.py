"""A real SLURM cluster of two nodes on this one machine, for the CPU-mode tests of ``slurm/``.

Why: the launcher's hard parts (``srun`` steps on several nodes, Ray joining across them, ``scancel``
reaching every process) only show up under a real slurmctld/slurmd.  Debian's slurmd can run several
daemons on one host when each node has its own port, so ``node1`` and ``node2`` are two slurmd processes
on 127.0.0.1 and a 2-node job really runs one task per "node".

Everything listens on loopback, and the configuration lives in a private directory named by
``SLURM_CONF`` (never ``/etc/slurm``): on a machine that is itself part of a real cluster nothing of its
SLURM set-up is touched.  Non-default ports (controller 16817, nodes 17001-17002) avoid a local slurmctld.

Use from tests: ``env = slurm_testbed.ensure()`` (idempotent: starts only what is not running, waits until
both nodes are idle, returns the environment that ``sbatch``/``squeue`` need), or ``slurm_testbed.skip_reason()``
to skip without the binaries.  From a shell (CI, or by hand)::

    python tests/slurm_testbed.py up | status | down
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

DIR = Path(os.environ.get("LLMLAB_SLURM_TESTBED", "/tmp/llmlab-slurm-testbed"))
CONF = DIR / "slurm.conf"
NODES = ("node1", "node2")
NODE_PORTS = {"node1": 17001, "node2": 17002}
CTLD_PORT = 16817
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
MARKER = "# llmlab SLURM test bed"

# CPUs=1 per node: the CI machine has 2 cores, and the tests need one task per node, not more.
# KillWait=15: scancel sends SIGTERM, then SIGKILL after this many seconds; the launcher's clean-up
# must fit in it (real clusters use 30 or more).
SLURM_CONF = """{marker} (tests/slurm_testbed.py writes this file; do not edit)
ClusterName=llmlabtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=15
InactiveLimit=0
MinJobAge=600
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = ("NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=4000 "
             "State=UNKNOWN")


def skip_reason() -> str | None:
    """Why the test bed cannot run here, or None.  Only missing binaries or privileges are reasons."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"SLURM test bed needs {', '.join(missing)} (Debian: apt-get install slurmd slurmctld "
                "slurm-client munge; .ci/run installs them)")
    if os.geteuid() != 0 and not _running():
        return ("SLURM test bed is not running and starting slurmd needs root (CI runs as root): "
                "`sudo .venv/bin/python tests/slurm_testbed.py up`")
    return None


def _running() -> bool:
    """Both nodes answer (the test bed was started earlier, e.g. by root); then any user can submit."""
    return CONF.exists() and all(s.rstrip("*") in ("idle", "mixed", "allocated") for s in
                                 (_node_states().get(n, "") for n in NODES))


def env(base: dict | None = None) -> dict[str, str]:
    """The environment SLURM's client commands need to talk to this test bed."""
    out = dict(os.environ if base is None else base)
    out["SLURM_CONF"] = str(CONF)
    return out


def _run(*cmd: str, check: bool = False, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, check=check)


def _write_conf() -> None:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(NODE_LINE.format(name=n, host=host, port=NODE_PORTS[n]) for n in NODES)
    text = SLURM_CONF.format(marker=MARKER, host=host, ctld_port=CTLD_PORT, dir=DIR, nodes=nodes,
                             node_list=",".join(NODES))
    DIR.mkdir(parents=True, exist_ok=True)
    (DIR / "state").mkdir(exist_ok=True)
    for n in NODES:
        (DIR / f"spool-{n}").mkdir(exist_ok=True)
    if not CONF.exists() or CONF.read_text() != text:
        CONF.write_text(text)
    # srun/sbatch look for plugstack.conf next to slurm.conf; an empty one keeps them quiet.
    (DIR / "plugstack.conf").touch()


def _munge_ok() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        return cred.returncode == 0 and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                                                       timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _pid_running(pidfile: Path) -> bool:
    try:
        pid = int(pidfile.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    try:  # a recycled pid belongs to some other program
        return "slurm" in Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return False


def _node_states() -> dict[str, str]:
    out = _run("sinfo", "-h", "-N", "-o", "%N %T")
    if out.returncode:
        return {}
    return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)


def ensure(timeout: float = 60) -> dict[str, str]:
    """Start munged, slurmctld and the two slurmd unless running; wait until both nodes are idle."""
    reason = skip_reason()
    if reason:
        raise RuntimeError(reason)
    if os.geteuid() != 0:  # not ours to start or change: use it as it runs
        return env()
    _write_conf()
    if not _munge_ok():
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force"], check=True, capture_output=True, timeout=20)
    if not _pid_running(DIR / "slurmctld.pid"):
        subprocess.run(["slurmctld", "-f", str(CONF)], check=True, capture_output=True, env=env(), timeout=30)
    for n in NODES:
        if not _pid_running(DIR / f"slurmd-{n}.pid"):
            subprocess.run(["slurmd", "-f", str(CONF), "-N", n], check=True, capture_output=True, env=env(),
                           timeout=30)
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = _node_states()
        if all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated") for n in NODES):
            return env()
        for n, s in states.items():  # a node left "down" by an earlier, killed slurmd comes back
            if s.rstrip("*").startswith(("down", "drain")):
                _run("scontrol", "update", f"nodename={n}", "state=resume")
        time.sleep(1)
    raise RuntimeError(f"SLURM test bed: nodes not idle after {timeout:.0f} s ({states or 'sinfo failed'}); "
                       f"read {DIR}/slurmctld.log and {DIR}/slurmd-node1.log")


def down() -> None:
    """Stop the test bed's slurmd and slurmctld (munged is left: other software may use it)."""
    for name in [f"slurmd-{n}" for n in NODES] + ["slurmctld"]:
        pidfile = DIR / f"{name}.pid"
        if _pid_running(pidfile):
            os.kill(int(pidfile.read_text().split()[0]), 15)


def main(argv: list[str]) -> int:
    action = argv[0] if argv else "up"
    if action == "up":
        ensure()
        print(f"SLURM test bed up: export SLURM_CONF={CONF}")
        print(_run("sinfo").stdout, end="")
    elif action == "status":
        states = _node_states()
        print(states or "SLURM test bed is not running")
        return 0 if states else 1
    elif action == "down":
        down()
    else:
        print("usage: python tests/slurm_testbed.py up|status|down", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
