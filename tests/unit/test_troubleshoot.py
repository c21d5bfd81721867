"""llmlab.troubleshoot without an engine: every sentence it matches is written where it says, in the installed vLLM
(and huggingface_hub, and llmlab's proxy), so a release that rewords one fails here; diagnose() names the committed
GPU failure; the start-up refusal's arithmetic.  Notebook 19 produces the faults on the real engine."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from llmlab import memory, troubleshoot


@pytest.mark.parametrize("s", troubleshoot.SIGNS, ids=lambda s: s.name)
def test_every_sign_is_written_where_it_says(s):
    line = troubleshoot.source_line(s)
    assert s.quote in line, f"{s.where} no longer writes {s.quote!r}: it reads {line.strip()!r}"


@pytest.mark.parametrize("s", troubleshoot.SIGNS, ids=lambda s: s.name)
def test_every_sign_names_a_cause_and_a_fix(s):
    assert s.side in ("start", "request", "running")
    assert s.cause and s.fix and s.cause != s.fix


def test_diagnose_names_the_committed_h100_failure():
    """The launcher's H100 job that could not start (--gpu-memory-utilization 0.1 after 0.9: the last one counts)."""
    status = troubleshoot.committed("h100-llama3.1-8b-launch/launch-oom.json")
    found = troubleshoot.diagnose(status.replace("\\n", "\n"))
    assert list(found.index) == ["no-kv-memory"]
    assert "No available memory for the cache blocks" in found.loc["no-kv-memory", "line"]
    assert troubleshoot.diagnose("INFO all is well").empty


def test_diagnose_reads_the_sentences_as_vllm_fills_them_in():
    said = {"wrong-model": "The model `llama3.1-8b` does not exist. Valid aliases: llmlab-tiny.",
            "prompt-too-long": "This model's maximum context length is 1024 tokens. However, your prompt contains "
                               "1100 input tokens, which exceeds this limit even without any output tokens.",
            "preemption": "Engine 000: Avg prompt throughput: 1.0 tokens/s, Preemptions: 3, KV cache usage: 90.0%"}
    for name, text in said.items():
        assert list(troubleshoot.diagnose(text).index) == [name], name
    assert troubleshoot.diagnose("Running: 1 reqs, Preemptions: 0, Prefix cache hit rate: 0.0%").empty


def test_the_error_line_of_a_refused_start():
    log = ("(APIServer pid=1) Traceback (most recent call last):\n"
           "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
           "  Value error, Total number of attention heads (8) must be divisible by tensor parallel size (3). "
           "[type=value_error]\n")
    a = troubleshoot.Attempt("vllm serve x", 1, 1.0, log)
    assert a.refused and a.error.startswith("Value error, Total number of attention heads (8)")
    assert troubleshoot.Attempt("vllm serve x", None, 9.0, "").refused is False


def test_the_refusal_of_a_million_token_context_on_one_gib():
    """The tiny model in float32: 4 layers x 2 (K, V) x 2 KV heads x 32 x 4 bytes = 2,048 bytes a token."""
    r = troubleshoot.refusal("llmlab-tiny", 2**30, 1_048_576)
    assert r["bytes_per_token"] == memory.kv_bytes_per_token("llmlab-tiny") == 2048
    assert r["blocks"] == 4096 and r["needed_bytes"] == 2 * 2**30 and not r["fits"]
    assert r["available_bytes"] == 2**30 - 128 * 2048 and r["estimated_max_len"] == 4095 * 128
    assert troubleshoot.refusal_sentence(r, 1_048_576) == (
        "To serve at least one request with the model's max seq len (1048576), (2.0 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (1.0 GiB). Based on the available memory, the estimated maximum "
        "model length is 524160.")
    small = troubleshoot.refusal("llmlab-tiny", 12 * 128 * 2048, 1024)  # lesson 16's pool of 12 blocks
    assert small["fits"] and small["estimated_max_len"] == 1024
    assert not troubleshoot.refusal("llmlab-tiny", 12 * 128 * 2048, 1500)["fits"]


def test_a_sign_by_name():
    assert troubleshoot.sign("tp-heads").where == "vllm/config/model.py:1549"
    with pytest.raises(KeyError, match="the signs are tp-heads"):
        troubleshoot.sign("nope")


def test_llmlab_status_names_the_start_failures_the_lesson_shows():
    """`llmlab status` reads a failed job's vLLM log with its own reason table (llmlab.ops.jobs.FAILURES): each start
    the lesson makes vLLM refuse is named there too, not only "vLLM exited while starting"."""
    from llmlab.ops import jobs

    r = troubleshoot.refusal("llmlab-tiny", 2**30, 1_048_576)
    said = {"tp-heads": ("Value error, Total number of attention heads (8) must be divisible by tensor parallel size "
                         "(3).", "the tensor-parallel size"),
            "no-model": ("HFValidationError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                         "'/models/llmlab-tinny'.", "the model path does not exist"),
            "kv-at-start": ("ValueError: " + troubleshoot.refusal_sentence(r, 1_048_576), "out of memory"),
            "no-kv-memory": ("ValueError: No available memory for the cache blocks.", "out of memory")}
    for name, (line, reason) in said.items():
        assert troubleshoot.sign(name).matches(line), name
        found = jobs.failure("[llmlab 10:00:00] FAILED: vLLM exited while starting.\n", line + "\n")
        assert found[0].startswith(reason), (name, found[0])


def test_a_learner_registered_then_revoked_as_the_proxy_reads_the_room(tmp_path):
    """troubleshoot.register_learner and revoke_learner write a room's keys/ as connect() and `llmlab revoke` do: the
    proxy's KeyRing accepts the key, then refuses it as revoked (its own sentence), and share.learners says so."""
    from llmlab.serve.proxy.keys import KeyRing

    room = troubleshoot.room()
    key = troubleshoot.register_learner(room)
    owner = tmp_path / "owner.key"
    owner.write_text("owner-key-0123456789abcdef\n")
    ring = KeyRing(owner, room / "keys", recheck=0)
    assert ring.accepts(f"Bearer {key}") and set(troubleshoot.learners(room).values()) == {"registered"}
    assert key not in "".join(p.read_text() for p in (room / "keys").iterdir())  # only its digest is written
    troubleshoot.revoke_learner(room)
    ring.refresh(force=True)
    assert not ring.accepts(f"Bearer {key}") and ring.revoked(f"Bearer {key}")
    assert set(troubleshoot.learners(room).values()) == {"revoked"}
    shutil.rmtree(room)


def test_a_rooms_folder_goes_when_the_kernel_that_made_it_ends():
    """Lesson 19 makes a room's folder in /tmp on each run; it is removed when the process that made it exits."""
    import subprocess
    import sys

    made = subprocess.run([sys.executable, "-c", "from llmlab import troubleshoot; print(troubleshoot.room())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert made.startswith(tempfile.gettempdir()) and "llmlab-room-" in made and not Path(made).exists()
