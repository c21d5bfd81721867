"""Offline batch inference: ``llmlab.offline`` and ``llmlab generate``.

The checks that need no engine (model lookup, layout, sampling mapping, prompt files) run in milliseconds;
the error paths of the CLI must fail *before* anything is loaded, so they are fast too.  One test runs the
real CLI end to end with the tiny model, next to the embedded server, as CI does.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_offline.py (the
pure tests).
"""

import json
import shutil
import subprocess
import sys
import time

import pytest

from llmlab import memory, offline
from llmlab.ops import cli, engine
from llmlab.ops import generate as offline_engine
from llmlab.serve.paths import TINY_MODEL


def generate(*args, capsys):
    """Run `llmlab generate` in this process (it starts no engine before its checks pass)."""
    code = cli.main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


# --- the CLI's error paths: each exits 2 before loading anything -----------------------------------------------

def test_cli_missing_model_path(capsys, tmp_path):
    t0 = time.monotonic()
    code, out, err = generate("--prompt", "Hi", "--model", str(tmp_path / "missing"), capsys=capsys)
    assert code == 2 and out == ""
    assert "llmlab generate: No model at" in err and "that path does not exist" in err
    assert time.monotonic() - t0 < 10


def test_cli_impossible_layout_on_the_tiny_model(capsys):
    code, _, err = generate("--prompt", "Hi", "--tp-size", "3", capsys=capsys)
    assert code == 2 and "do not divide into 3 tensor-parallel shards" in err


def test_cli_layout_that_does_not_fit_names_the_planners_layout(capsys, tmp_path, monkeypatch):
    """A config-only copy of 405B FP8 (a dummy weight file): the memory check fails before vLLM starts."""
    shutil.copy(memory.config_path("llama3.1-405b-fp8"), tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, err = generate("--prompt", "Hi", "--model", str(tmp_path), "--tp-size", "8", "--gpu", "A100-40",
                            "--max-model-len", "8192", capsys=capsys)
    assert code == 2
    assert "the weights take 56.7 GiB per GPU, more than" in err and "--tp-size 8 --pp-size 2" in err
    monkeypatch.setattr(engine, "_numa_nodes", lambda: 1)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    eng = offline_engine.OfflineEngine(tmp_path, tp_size=8, gpu="none", max_model_len=128)
    with pytest.raises(engine.LayoutError, match="8 ranks"):  # --gpu none: no memory check; the CPU's still runs
        eng.prepare()


def test_cli_no_engine_installed(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees without vLLM installed
    code, _, err = generate("--prompt", "Hi", capsys=capsys)
    assert code == 2 and "vLLM is not installed" in err and "make install" in err


def test_cli_bad_sampling_value_and_bad_prompt_file(capsys, tmp_path):
    code, _, err = generate("--prompt", "Hi", "--temperature", "5", capsys=capsys)
    assert code == 2 and "temperature=5.0 is not accepted" in err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    code, _, err = generate("--prompts", str(bad), capsys=capsys)
    assert code == 2 and "line 2 is not JSON" in err


def test_engine_that_fails_is_reported_with_its_log_and_stopped():
    """vLLM refuses an unknown argument inside the engine process: the error quotes its log, no process is left."""
    eng = offline_engine.OfflineEngine(enforce_eager=True, warmup=False, extra={"no_such_engine_argument": 1})
    with pytest.raises(engine.EngineFailed, match="no_such_engine_argument") as e:
        eng.start(progress=False, timeout=300)
    assert str(eng.log_path) in str(e.value)
    assert not eng.running and offline.memory_of(eng.pid)["processes"] == 0


# --- the real engine -----------------------------------------------------------------------------------------

def test_cli_generates_offline_next_to_the_server(tmp_path, embedded, api_key):
    """`python -m llmlab generate` with the tiny model while the embedded server runs (as in CI): the report,
    the output file, greedy texts equal to the server's, the chat template applied as the server applies it,
    and both engines' memory within the CI machine's 24 GiB."""
    import openai

    prompts = [{"id": "plain", "prompt": "In the beginning"},
               {"id": "chat", "messages": [{"role": "user", "content": "Who led the people out of Egypt?"}]},
               {"id": 7, "prompt": "And the king said to"}]
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out" / "completions.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    result = subprocess.run([sys.executable, "-m", "llmlab", "generate", "--prompts", str(src), "--output", str(out),
                             "--json", "--quiet", "--enforce-eager", "--temperature", "0", "--max-tokens", "16",
                             "--ignore-eos"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["model"] == str(TINY_MODEL.resolve()) and report["dtype"] == "float32"
    assert report["prompts"] == 3 and report["output_tokens"] == 48
    assert report["load_s"] > 0 and report["warmup_s"] > 0 and 0 < report["ttft_s"] < report["generation_s"]
    assert report["output_tokens_per_s"] == pytest.approx(48 / report["generation_s"])
    assert report["kv_cache_tokens"] == memory.embedded_kv_capacity(1).blocks * memory.CPU_BLOCK_SIZE
    engine_peak = report["peak_rss_bytes"]
    server_peak = offline.memory_of(embedded.pid)["peak_rss"]
    assert 0 < engine_peak < 8 * 2**30 and engine_peak + server_peak < 16 * 2**30  # CI: 24 GiB in all
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["plain", "chat", 7]
    assert all(x["output_tokens"] == 16 and x["finish_reason"] == "length" for x in lines)

    client = openai.OpenAI(base_url=f"http://{embedded.host}:{embedded.port}/v1", api_key=api_key)
    online = client.completions.create(model=embedded.model, prompt="In the beginning", max_tokens=16,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert lines[0]["text"] == online.choices[0].text
    assert lines[0]["prompt_tokens"] == online.usage.prompt_tokens
    chat = client.chat.completions.create(model=embedded.model, messages=prompts[1]["messages"], max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert lines[1]["prompt_tokens"] == chat.usage.prompt_tokens
    assert lines[1]["text"] == chat.choices[0].message.content


def test_outputs_on_a_full_disk_keep_the_previous_file(tiny_disk):
    """Issue 26: ``write_outputs`` truncated its file first, so a full disk lost the previous outputs too, and the
    error was a bare traceback.  Now a temporary file replaces the old one only once complete, and the error says
    what was kept."""
    where = tiny_disk
    done = [offline.Completion(i, 4, 60, "word " * 60, "length", ttft=0.1, prompt="Once") for i in range(40)]
    path = offline_engine.write_outputs(where / "out.jsonl", offline.BatchResult(done[:2], seconds=1.0))
    before = path.read_bytes()
    with pytest.raises(engine.OfflineError, match=r"40 outputs.*No space left on device.*out.jsonl is kept as it "
                                                  r"was") as err:
        offline_engine.write_outputs(path, offline.BatchResult(done, seconds=2.0))
    assert "\n" not in str(err.value) and "2400 output tokens" in str(err.value)  # what the batch measured
    assert path.read_bytes() == before and [p.name for p in where.iterdir()] == ["out.jsonl"]
    path.unlink()
    with pytest.raises(engine.OfflineError, match="no file was created"):
        offline_engine.write_outputs(path, offline.BatchResult(done, seconds=2.0))
    assert list(where.iterdir()) == []
