"""Offline batch inference: ``llmlab.offline`` and ``llmlab generate``.

The checks that need no engine (model lookup, layout, sampling mapping, prompt files) run in milliseconds;
the error paths of the CLI must fail *before* anything is loaded, so they are fast too.  One test runs the
real CLI end to end with the tiny model, next to the embedded server, as CI does.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_offline.py (the tests that start the real engine).
"""

import os
import subprocess
import sys
import time

import pytest
from slurm_helpers import wait_for

from llmlab import offline, sampling
from llmlab.ops import engine
from llmlab.ops import generate as offline_engine
from llmlab.serve.paths import TINY_MODEL
from llmlab.serve.proc import terminate

TINY = str(TINY_MODEL)


# --- sampling parameters: online and offline are the same fields -----------------------------------------------

PARAMS = [sampling.SamplingParams(),
          sampling.SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512, frequency_penalty=0.1),
          sampling.SamplingParams(temperature=0.5, top_k=5, min_p=0.05, repetition_penalty=1.2, min_tokens=3,
                                  max_tokens=20, seed=7, stop=["."], stop_token_ids=[1], ignore_eos=True,
                                  logit_bias={5: -3.0}, presence_penalty=0.5)]


@pytest.mark.parametrize("params", PARAMS)
def test_offline_kwargs_carry_the_online_values(params):
    online = params.openai_kwargs()
    online.update(online.pop("extra_body"))
    offline_kw = offline.vllm_sampling_kwargs(params)
    for name, value in online.items():
        if name == "logit_bias":
            value = {int(k): v for k, v in value.items()}
        assert offline_kw[name] == value, name
    table = offline.parameter_table(params)
    sent = table[table["online value"].notna()]
    assert len(sent) == len(online)


@pytest.mark.parametrize("params", PARAMS)
def test_vllm_accepts_the_kwargs_field_by_field(params):
    vllm = pytest.importorskip("vllm")
    kwargs = offline.vllm_sampling_kwargs(params)
    sp = vllm.SamplingParams(**kwargs)
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                 "min_tokens", "max_tokens", "seed", "ignore_eos"):
        assert getattr(sp, name) == kwargs[name], name
    assert sp.top_k in (kwargs["top_k"], -1 if kwargs["top_k"] == 0 else kwargs["top_k"])


def test_wrong_sampling_value_fails_with_llmlabs_message():
    with pytest.raises(ValueError, match="temperature=5.0 is not accepted"):
        offline.vllm_sampling_kwargs(temperature=5.0)
    assert offline.vllm_sampling_kwargs(max_tokens=64)["max_tokens"] == 64


# --- finding the model ---------------------------------------------------------------------------------------

def test_tiny_model_is_the_default():
    for name in (None, "llmlab-tiny", TINY):
        found = engine.resolve_model(name)
        assert found.local and found.config.is_file() and found.name == str(TINY_MODEL.resolve())


def test_missing_model_is_one_clear_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(engine.ModelNotFound, match="that path does not exist"):
        engine.resolve_model(tmp_path / "nope")
    with pytest.raises(engine.ModelNotFound, match="no config.json"):
        engine.resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(engine.ModelNotFound, match="no weights"):
        engine.resolve_model(tmp_path)
    with pytest.raises(engine.ModelNotFound, match="not in the Hugging Face cache.*hf download"):
        engine.resolve_model("meta-llama/Llama-3.1-70B-Instruct")
    with pytest.raises(engine.ModelNotFound, match="stands for meta-llama/Llama-3.1-405B-Instruct-FP8"):
        engine.resolve_model("llama3.1-405b-fp8")


# --- the layout, from the config alone --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(tp_size=3), "8 attention heads do not divide into 3.*1, 2, 4, 8"),
    (dict(pp_size=5), "4 layers, so it splits into at most 4 pipeline stages"),
    (dict(max_model_len=1024), "exceeds the 512 positions"),
    (dict(tp_size=0), "whole number >= 1"),
])
def test_impossible_layout_of_the_tiny_model(kwargs, message):
    with pytest.raises(engine.LayoutError, match=message):
        engine.check_layout("llmlab-tiny", build="cpu", **kwargs)


def test_cpu_engine_needs_a_numa_node_per_rank(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(engine, "_numa_nodes", lambda: 1)
    with pytest.raises(engine.LayoutError, match="2 ranks.*has 1"):
        engine.check_layout("llmlab-tiny", tp_size=2, build="cpu")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert engine.check_layout("llmlab-tiny", tp_size=2, build="cpu").tp == 2


def test_cpu_kv_space_must_hold_one_request():
    with pytest.raises(engine.LayoutError, match="more than the CPU engine's 1 GiB"):
        engine.check_layout("llama3.1-8b", build="cpu", max_model_len=131_072)
    assert engine.check_layout("llama3.1-8b", build="cpu", max_model_len=4096).kv_tokens_per_gpu == 8192


def test_the_seed_scripts_405b_layout_fits_and_half_of_it_does_not():
    """The blog's 405B FP8 run: TP=8 x PP=2 on 16 A100-40s, 8,192 tokens.  PP=1 cannot hold the weights, and
    the message names the planner's layout."""
    ok = engine.check_layout("llama3.1-405b-fp8", 8, 2, gpu="A100-40", max_model_len=8192)
    assert ok.weight_bytes_per_gpu < ok.usable_bytes_per_gpu and ok.kv_tokens_per_gpu >= 8192
    with pytest.raises(engine.LayoutError, match=r"more than the.*--tp-size 8 --pp-size 2 \(16 GPUs on 2 node"):
        engine.check_layout("llama3.1-405b-fp8", 8, 1, gpu="A100-40", max_model_len=8192)


def test_70b_on_four_gpus_depends_on_the_gpu():
    assert engine.check_layout("llama3.1-70b", 4, gpu="H100-80", max_model_len=8192).tp == 4
    with pytest.raises(engine.LayoutError, match="--tp-size 8 --pp-size 1"):
        engine.check_layout("llama3.1-70b", 4, gpu="A100-40", max_model_len=8192)


# --- prompts -----------------------------------------------------------------------------------------------

def test_prompt_file_forms_and_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n\n{"id": "x", "prompt": "text"}\n{"prompt": [0, 5, 6]}\n'
                    '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    prompts, ids = offline_engine.read_prompts(path)
    assert ids == [0, "x", 2, 3]
    assert prompts == ["plain", "text", {"prompt_token_ids": [0, 5, 6]},
                       {"messages": [{"role": "user", "content": "Hi"}]}]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a"}\n{oops\n', "line 2 is not JSON"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "share an id"),
    ('{"messages": []}\n', "non-empty list"),
    ('{"text": "a"}\n', "line 1: a prompt is"),
    ("\n", "holds no prompts"),
])
def test_bad_prompt_files_name_the_line(tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        offline_engine.read_prompts(path)


def test_chat_template_through_the_tokenizer_has_one_bos():
    """Token ids from apply_chat_template start with one <s>; the same template as *text*, tokenized again
    (what vLLM does to a text prompt), starts with two."""
    tok = offline.load_tokenizer()
    messages = [{"role": "user", "content": "Who led the people out of Egypt?"}]
    ids = offline.chat_token_ids(tok, messages)
    assert ids[0] == tok.bos_token_id != ids[1]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("Assistant:") and "Who led" in text
    assert tok(text)["input_ids"][:2] == [tok.bos_token_id] * 2
    assert offline.as_chat("Hi", "Be brief.")["messages"][0] == {"role": "system", "content": "Be brief."}


def test_batch_summary_has_the_load_test_keys():
    c = [offline.Completion(i, 4, 10, "x", "length", ttft=0.1 * (i + 1), decode_s=0.9) for i in range(3)]
    s = offline.BatchResult(c, seconds=2.0).summary()
    assert s["output_tokens"] == 30 and s["output_tokens_per_s"] == 15 and s["requests_per_s"] == 1.5
    assert s["ttft_p50"] == pytest.approx(0.2) and s["tpot_p50"] == pytest.approx(0.1)
    loadtest = pytest.importorskip("llmlab.loadtest")
    assert {"output_tokens_per_s", "requests_per_s", "duration_s", "ttft_p50"} <= set(s) & set(loadtest.summarize([]))


def test_memory_of_a_process_tree_and_after_it_ends():
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        # once sh has forked its sleep (a loaded machine takes its time)
        m = wait_for(lambda: (m := offline.memory_of(proc.pid))["processes"] >= 2 and m, 30, "sh's sleep", poll=0.1)
        assert m["processes"] == 2 and 0 < m["pss"] <= m["rss"] <= m["peak_rss"]
    finally:
        terminate(proc.pid, 1)
        proc.kill()
        proc.wait()
    assert offline.memory_of(proc.pid)["processes"] == 0


def test_a_child_that_exited_but_was_not_reaped_is_not_counted_alive():
    """A kernel may leave vLLM's engine core a zombie for a while after offline.shutdown: it holds no memory, and
    the check after shutdown (CI saw one) must not call the engine still running."""
    live = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["true"])  # never waited for: a zombie once it exits
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        tree = offline.process_tree(os.getpid())
        assert live.pid in tree and zombie.pid not in tree
    finally:
        live.kill()
        live.wait()
        zombie.wait()


# --- the CLI's error paths: each exits 2 before loading anything -----------------------------------------------


def test_cli_no_engine_installed_exit_status():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from llmlab.ops.cli import main; sys.exit(main(['generate', '--prompt', 'Hi']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "vLLM is not installed" in result.stderr, result.stderr
