"""The unit tier (``make unit``): no engine, no SLURM, no root, no browser -- the whole folder runs in seconds.

A test here that starts one of those fails at once with a sentence naming what it started and the folder it
belongs in (``tests/engine``: the real vLLM engine, JupyterLab, a browser, root; ``tests/cluster``: the SLURM
test bed, OnDemand, sharing, a second UNIX user).  The guard watches this process's own ``subprocess.Popen``
calls, which is where every such start begins (``llmlab`` commands run as ``python -m llmlab ...`` included).

A unit test leaves no connection file in the session's ``LLMLAB_HOME`` either: the notebooks that run after it in
the same pytest session (``make test``'s lanes) would ``connect()`` to the newest one, a server that never was.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# A word of the command line -> what it starts, and the tier it belongs to.
STARTS = {"vllm.entrypoints": ("a vLLM engine", "tests/engine"), "sbatch": ("a SLURM job", "tests/cluster"),
          "srun": ("a SLURM step", "tests/cluster"), "slurmctld": ("the SLURM test bed", "tests/cluster"),
          "slurmd": ("the SLURM test bed", "tests/cluster"), "munged": ("the SLURM test bed", "tests/cluster"),
          "chromium": ("a browser", "tests/engine"), "useradd": ("a second UNIX user", "tests/cluster"),
          "setpriv": ("a second UNIX user", "tests/cluster"), "mount": ("a mount (root)", "tests/engine"),
          "jupyter": ("JupyterLab", "tests/engine")}
LLMLAB_STARTS = {"serve": "a vLLM engine", "lab": "JupyterLab and an engine", "generate": "an offline engine"}


def _what_it_starts(argv: list[str]) -> tuple[str, str] | None:
    words = [os.path.basename(str(a)) for a in argv]
    if words[:1] == ["ray"] and "start" in words:  # `ray status` of a stand-in is no cluster
        return "a Ray cluster", "tests/cluster"
    for word in words:
        for key, found in STARTS.items():
            if word == key or word.startswith(key + "."):
                return found
    if "llmlab" in words and len(words) > words.index("llmlab") + 1:
        cmd = words[words.index("llmlab") + 1]
        if cmd in LLMLAB_STARTS and "--help" not in words and "--status" not in words:
            return LLMLAB_STARTS[cmd], "tests/engine"
    return None


@pytest.fixture(autouse=True)
def no_engine_no_slurm_no_root_no_browser(monkeypatch):
    real = subprocess.Popen.__init__

    def guarded(self, args, *a, **k):
        argv = [args] if isinstance(args, (str, bytes)) else list(args)
        found = _what_it_starts(argv)
        if found:
            what, tier = found
            raise RuntimeError(f"a unit test started {what} ({' '.join(map(str, argv[:4]))} ...): move it to {tier}.")
        return real(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


def _published(servers: Path, state: Path) -> set[Path]:
    return {*servers.glob("*.json"), *[state][:state.exists()]}


@pytest.fixture(autouse=True)
def publishes_no_server():
    """Fail (and clean up after) a test that published a connection file in the session's home (a test that moves
    LLMLAB_HOME to a folder of its own may publish there)."""
    from llmlab.serve.embedded import state_file
    from llmlab.serve.info import servers_dir

    where = servers_dir(), state_file()  # the session's, as this test starts
    before = _published(*where)
    yield
    left = sorted(_published(*where) - before)
    for path in left:
        path.unlink()
    assert not left, (f"the test left the connection file(s) {', '.join(map(str, left))} in the session's "
                      "LLMLAB_HOME, where a later notebook's connect() would find them: give it a home of its own "
                      "(monkeypatch.setenv('LLMLAB_HOME', str(tmp_path))).")
