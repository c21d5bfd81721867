"""Memory arithmetic (llmlab.memory): exact against published totals, vLLM's KV log, and bad input.

The session's embedded server's KV line against the arithmetic; a second server with another budget and an odd
context is started by ``make test-versions`` (marked ``versions``), whose log ``make test`` checks.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_memory.py (the
pure tests).
"""

from pathlib import Path

import pytest

from llmlab import memory as m

SECOND_BUDGET_LOG = Path(__file__).parents[1] / "fixtures" / "kv" / "llmlab-tiny-2gib-500.log"

# --- live: the real embedded server -----------------------------------------------------------------

@pytest.mark.server
def test_live_embedded_server_kv_log_matches_the_arithmetic(embedded):
    """The session's embedded server (VLLM_CPU_KVCACHE_SPACE=1) logs what llmlab.memory predicts."""

    logged = m.parse_kv_log(Path(embedded.log).read_text(errors="replace"))
    predicted = m.embedded_kv_capacity(1, "llmlab-tiny")
    assert logged["device"] == "CPU"
    assert logged["max_model_len"] == predicted.max_model_len
    assert logged["tokens"] == predicted.tokens == 524_288
    assert logged["line"] == predicted.log_line("CPU")


@pytest.mark.versions
def test_live_second_budget_and_odd_context_match_the_arithmetic(tmp_path):
    """A second server with 2 GiB of KV and a context (500) that is not a multiple of the 128-token block.  ``make
    test`` checks its committed log (tests/unit/test_memory.py); ``make test-versions`` starts it, and rewrites the
    log with LLMLAB_UPDATE_FIXTURES=1."""
    import os

    from llmlab.serve.embedded import EmbeddedServer

    with EmbeddedServer(kv_cache_gib=2, max_model_len=500, log_path=tmp_path / "kv.log") as srv:
        log = srv.log_path.read_text(errors="replace")
    assert m.parse_kv_log(log)["line"] == m.embedded_kv_capacity(2, "llmlab-tiny", max_model_len=500).log_line("CPU")
    if os.environ.get("LLMLAB_UPDATE_FIXTURES") == "1":
        SECOND_BUDGET_LOG.write_text(log.replace(str(tmp_path), "$TMP"))
