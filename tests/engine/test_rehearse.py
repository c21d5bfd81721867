"""llmlab rehearse with the real engine: the CLI without a GPU, and a SIGTERM during start-up stopping the server.

A whole rehearsal on vLLM's CPU engine runs once, inside a SLURM allocation (``llmlab launch --rehearse``,
tests/cluster/test_jobs.py), where its rehearsal.json, plot, log excerpt and stopped server are checked; the pure
tests (the log parser on lines quoted from real GPU runs, the KV and roofline arithmetic, the dummy model directory,
the serve line) are in tests/unit/test_rehearse.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# --- the serve line and the layout ----------------------------------------------------------------------------


def test_without_a_gpu_the_cli_says_so_in_one_sentence():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "llmlab", "rehearse", "llama3.1-8b"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("llmlab rehearse: No GPU on this machine") and out.stderr.count("\n") == 1
    assert "Traceback" not in out.stderr


# --- a rehearsal stopped while its server starts ---------------------------------------------------------------

def _engine_processes(marker: str) -> list[int]:
    """PIDs whose command line mentions ``marker`` (the rehearsal's model folder)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in p.joinpath("cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(p.name))
            except OSError:
                continue
    return pids


@pytest.mark.server
def test_sigterm_during_start_up_stops_the_server(tmp_path):
    code = ("from llmlab import memory\nfrom llmlab.ops import rehearsal\n"
            f"rehearsal.rehearse(memory.TINY_NAME, engine='cpu', out={str(tmp_path)!r}, progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "server.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.is_file() and "non-default args" in log.read_text()):
        time.sleep(0.5)
    assert _engine_processes(str(tmp_path / "model")), "the server should be starting"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0
    time.sleep(1)
    assert _engine_processes(str(tmp_path / "model")) == [], err[-2000:]
    assert not (tmp_path / "rehearsal.json").exists()
