"""What llmlab reads of a vLLM start-up log and of its /metrics, checked on the committed logs of every release
(tests/unit/test_vllm_versions.py) and on each release started live (tests/engine/test_vllm_versions.py, make
test-versions)."""

from __future__ import annotations

from pathlib import Path

from llmlab import cluster, kvcache, rehearse
from llmlab.serve.vllm import PHASES

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
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
    c = kvcache.read_counters(m)  # the lessons' one snapshot type reads this release's scrape: one request, counted
    assert c.finished >= 1 and c.generated > 0 and c.steps > 0 and c.ttft.count >= 1, c
    assert c.block_size and c.num_gpu_blocks and c.prefix_caching is not None, "no vllm:cache_config_info labels"


def fixture_text(log: str, tmp: Path) -> str:
    """The log as a fixture: this machine's temporary paths replaced, the shutdown chatter after it dropped."""
    return log.replace(str(tmp), "$TMP").replace(str(Path.home()), "~")
