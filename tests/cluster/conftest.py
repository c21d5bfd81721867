"""The cluster tier: a real slurmctld and two slurmd on this machine (tests/slurm_testbed.py), the launcher's jobs
under them, the Open OnDemand app, a server shared with a class, a second UNIX user attacking it, and cluster mode.
The test bed starts once for the whole tier (``slurm_env``); each test is skipped with the reason where the SLURM
binaries or root are missing (``slurm_helpers.needs_slurm``)."""

import os
import sys
from pathlib import Path

import pytest
import slurm_testbed
from attacker import ATTACKER, system_user


@pytest.fixture(scope="session")
def slurm_env():
    """The test bed (started if needed) and the environment a job needs: this venv first on PATH, and the
    test session's private LLMLAB_HOME (sbatch hands the submitter's environment to the job)."""
    env = slurm_testbed.ensure()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["LLMLAB_PYTHON"] = sys.executable
    return env


@pytest.fixture(scope="session")
def attacker() -> tuple[int, int]:
    """The second UNIX user (uid, gid) of the attacks in test_security.py and test_jobs.py, created once."""
    entry = system_user(ATTACKER)
    assert entry.pw_uid != os.geteuid()
    return entry.pw_uid, entry.pw_gid
