"""llmlab rehearse: the log parser on lines quoted from real GPU runs, the KV and roofline arithmetic, the
dummy model directory, the serve line, and one real rehearsal end to end on vLLM's CPU engine.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_rehearse.py
(the pure tests).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmlab import memory, rehearse
from llmlab.ops import rehearsal

# --- the serve line and the layout ----------------------------------------------------------------------------


def test_without_a_gpu_the_cli_says_so_in_one_sentence():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "llmlab", "rehearse", "llama3.1-8b"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("llmlab rehearse: No GPU on this machine") and out.stderr.count("\n") == 1
    assert "Traceback" not in out.stderr


# --- end to end on the CPU engine -------------------------------------------------------------------------------

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
def test_a_cpu_rehearsal_runs_end_to_end_and_stops_its_server(tmp_path):
    r = rehearsal.rehearse(memory.TINY_NAME, engine="cpu", concurrency=(1, 4), input_len=8, output_len=16,
                          batch1_requests=3, out=tmp_path, progress=False, say=lambda *a: None, ready_timeout=600)
    assert r["kv_tokens_logged"] == r["kv_tokens_predicted"] == r["kv_tokens_predicted_before_start"] == 524_288
    issue_keys = ("gpu", "gpu_count", "model", "tp", "pp", "vllm_version", "startup_s", "weights_gib",
                  "activation_peak_gib", "kv_tokens_logged", "kv_tokens_predicted", "kv_tokens_predicted_before_start",
                  "bandwidth_tb_s", "roofline_tok_s", "decode_tok_s_batch1", "sweep")
    saved = json.loads((tmp_path / "rehearsal.json").read_text())
    assert all(k in saved for k in issue_keys) and saved == json.loads(json.dumps(r))
    assert [s["concurrency"] for s in r["sweep"]] == [1, 4]
    assert all(s["ok"] == s["requests"] and s["output_tokens_per_s"] > 0 for s in r["sweep"])
    # sent 4 at once (unless a thread starved of CPU started late); how many the server answered at once depends
    # on the machine's load: a 16-token answer of the tiny model can finish before the next request arrives
    assert r["sweep"][1]["max_outstanding"] >= 2 and r["sweep"][1]["max_concurrency_seen"] >= 1
    assert r["decode_tok_s_batch1"] > 0 and r["bandwidth_tb_s"] > 0 and rehearse.check_math(r) == []
    assert r["vllm_version"] and r["serve_line"].endswith("--load-format dummy")
    assert (tmp_path / "rehearsal.png").stat().st_size > 10_000
    assert "CPU KV cache size: 524,288 tokens" in (tmp_path / rehearse.LOG_EXCERPT).read_text()
    assert r["server_stopped"] and _engine_processes(str(tmp_path / "model")) == []


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
