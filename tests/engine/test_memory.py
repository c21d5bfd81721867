"""Memory arithmetic (llmlab.memory): exact against published totals, vLLM's KV log, and bad input.

Pure tests run in a second.  The two tests marked ``server`` start the real embedded vLLM server
(``-m "not server"`` leaves them out).
"""

from pathlib import Path

import pytest

from llmlab import memory as m

# --- parameter counts -------------------------------------------------------------------------------


# --- bytes --------------------------------------------------------------------------------------------


# --- vLLM's KV block arithmetic ---------------------------------------------------------------------


# --- parallelism --------------------------------------------------------------------------------------


# --- one layout: layout_fit ---------------------------------------------------------------------------


# --- bad input ----------------------------------------------------------------------------------------


# --- the CLI ------------------------------------------------------------------------------------------


# --- live: the real embedded server -----------------------------------------------------------------

@pytest.mark.server
def test_live_embedded_server_kv_log_matches_the_arithmetic(embedded):
    """The session's embedded server (VLLM_CPU_KVCACHE_SPACE=1) logs what llmlab.memory predicts."""

    logged = m.parse_kv_log(Path(embedded["log"]).read_text(errors="replace"))
    predicted = m.embedded_kv_capacity(1, "llmlab-tiny")
    assert logged["device"] == "CPU"
    assert logged["max_model_len"] == predicted.max_model_len
    assert logged["tokens"] == predicted.tokens == 524_288
    assert logged["line"] == predicted.log_line("CPU")


@pytest.mark.server
def test_live_second_budget_and_odd_context_match_the_arithmetic(tmp_path):
    """A second server with 2 GiB of KV and a context (500) that is not a multiple of the 128-token block."""
    from llmlab.serve.embedded import EmbeddedServer

    with EmbeddedServer(kv_cache_gib=2, max_model_len=500, log_path=tmp_path / "kv.log") as srv:
        logged = m.parse_kv_log(srv.log_path.read_text(errors="replace"))
    predicted = m.embedded_kv_capacity(2, "llmlab-tiny", max_model_len=500)
    assert logged["line"] == predicted.log_line("CPU")
    assert logged["tokens"] == 1_024_000


# --- every family: transformers referees the parameters, the engine referees the KV cache ------------


