"""vLLM's ``/metrics``: fetch it with the server's key and read Prometheus' text format.

Why here: notebook 02 reads the KV-cache counters, ``llmlab metrics`` a job's figures, the version tests every
release's metric names -- all from one scrape.  The parser is our own (about 30 lines, no dependency) and
strict: a malformed line raises ``ValueError`` naming it rather than being skipped.  ``llmlab.kvcache``
re-exports these names for the lesson.  ``histogram`` reads one histogram of a scrape; two scrapes' difference is
what the server observed between them (``llmlab metrics``' quantiles, the GPU parity benchmark's server-side TTFT).
"""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from llmlab.serve.info import AuthenticationFailed, ServerError, ServerUnavailable

# --- vLLM's metric names: the one vocabulary (vLLM 0.32, vllm/v1/metrics/loggers.py; 0.26-0.32 export them all:
# tests/fixtures/vllm/ and the version tests).  Counters carry a ``_total`` suffix (prometheus_client's rule),
# histograms ``_sum``/``_count``/``_bucket``.  Lessons import these; none spells a "vllm:" name itself
# (tests/unit/test_imports.py), so a name vLLM renames is changed here once.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"   # prompt tokens looked up in the prefix cache
PREFIX_HITS = "vllm:prefix_cache_hits_total"         # of those, tokens found there (never computed again)
KV_USAGE = "vllm:kv_cache_usage_perc"                # share of KV blocks held by running requests, 0..1
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # by label source: computed, own cache, KV connector
GENERATED = "vllm:generation_tokens_total"           # output tokens of all requests
TTFT = "vllm:time_to_first_token_seconds"            # histogram, measured inside the server
ITL = "vllm:inter_token_latency_seconds"             # histogram: one observation per gap between two tokens
E2E = "vllm:e2e_request_latency_seconds"             # histogram: a request's whole time in the server
PREFILL_COMPUTED = "vllm:request_prefill_kv_computed_tokens"  # histogram: prompt tokens really computed
CACHE_CONFIG = "vllm:cache_config_info"              # a gauge = 1 whose labels are the cache config
RUNNING = "vllm:num_requests_running"                # gauge: requests in the running batch now
WAITING = "vllm:num_requests_waiting"                # gauge: requests queued, not yet in the running batch
FINISHED = "vllm:request_success_total"              # finished requests, by finish reason
PREEMPTIONS = "vllm:num_preemptions_total"           # counter: running requests pushed out when the KV cache ran out
REQUEST_PREEMPTIONS = "vllm:request_num_preemptions"  # histogram: one observation per finished request, its preemptions
STEPS = "vllm:iteration_tokens_total"  # histogram: per engine step that gave some request output, its tokens
DRAFTS = "vllm:spec_decode_num_drafts_total"                 # steps in which a draft was proposed
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"     # tokens proposed (k per draft)
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"      # of those, accepted by the model
ACCEPTED_AT = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # accepted at draft position 0, 1, ...
LORA_INFO = "vllm:lora_requests_info"  # a gauge per state of the LoRA slots (labels: running, waiting, max_lora)


@dataclass(frozen=True)
class Sample:
    """One line of a Prometheus exposition: a metric name, its labels and a value."""

    name: str
    labels: dict = field(default_factory=dict)
    value: float = 0.0


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^(?P<name>{_NAME})(?:\{{(?P<labels>.*)\}})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(rf'\s*(?P<key>{_NAME})\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


def _labels(text: str, line: str) -> dict:
    labels, pos = {}, 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise ValueError(f"cannot read the labels of this metrics line: {line!r}")
        labels[m["key"]] = _unescape(m["value"])
        pos = m.end()
    return labels


def parse_prometheus(text: str) -> Metrics:
    """Parse Prometheus' text exposition format (version 0.0.4) into :class:`Metrics`.

    Why a parser of our own: about 30 lines, no dependency, and it shows what the format is: one
    ``name{label="value",...} number [timestamp]`` per line, ``#`` comments (``# HELP``, ``# TYPE``), and
    label values with ``\\\\``, ``\\"`` and ``\\n`` escaped.  ``NaN`` and ``+Inf``/``-Inf`` are numbers too.
    A malformed line raises ``ValueError`` naming it, rather than being skipped silently.
    """
    samples, types = [], {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"not a Prometheus sample line: {raw!r}")
        try:
            value = float(m["value"])
        except ValueError:
            raise ValueError(f"the value of this metrics line is not a number: {raw!r}") from None
        samples.append(Sample(m["name"], _labels(m["labels"] or "", raw), value))
    return Metrics(samples, types)


class Metrics:
    """Parsed samples with the few look-ups a lesson needs: ``m.value(name, **labels)`` sums all samples
    of ``name`` whose labels include the given ones (e.g. over engines), ``m[name]`` lists the samples."""

    def __init__(self, samples: list[Sample], types: dict[str, str] | None = None):
        self.samples, self.types = list(samples), dict(types or {})

    def __getitem__(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)

    @property
    def names(self) -> list[str]:
        return sorted({s.name for s in self.samples})

    def value(self, name: str, default: float | None = None, **labels) -> float:
        """Sum of the matching samples; a metric that is absent is an error unless a default is given."""
        found = [s.value for s in self[name] if all(s.labels.get(k) == str(v) for k, v in labels.items())]
        if not found:
            if default is not None:
                return default
            close = [n for n in self.names if name.split(":")[-1].split("_")[0] in n][:5]
            raise KeyError(f"no metric {name!r}{' with ' + str(labels) if labels else ''} in this scrape"
                           f"{'; similar: ' + ', '.join(close) if close else ''}")
        return sum(found)

    def labels(self, name: str) -> dict:
        """The labels of a single-sample metric, e.g. vLLM's ``vllm:cache_config_info``."""
        found = self[name]
        if len(found) != 1:
            raise KeyError(f"expected one sample of {name!r}, found {len(found)}")
        return dict(found[0].labels)


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram of a scrape, its series summed (e.g. over engines): ``buckets`` maps each upper
    edge (``le``, ``math.inf`` for ``+Inf``) to the cumulative count of observations at or below it.

    Why a type: a histogram's counters only grow, so what happened between two scrapes is ``after - before``
    (the same edges, every count and the sum subtracted) -- e.g. the server's TTFT of one client's run.  Its mean
    (``sum / count``) is exact; a quantile is interpolated inside its bucket, so it is only as fine as the bucket
    it falls in (``bucket_of`` says which)."""

    buckets: dict[float, float]
    sum: float = 0.0
    count: float = 0.0

    def __sub__(self, before: Histogram) -> Histogram:
        if set(before.buckets) != set(self.buckets):
            raise ValueError("the two histograms have different bucket edges: they are not two scrapes of one "
                             "metric of one server")
        return Histogram({le: n - before.buckets[le] for le, n in self.buckets.items()}, self.sum - before.sum,
                         self.count - before.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def bucket_of(self, q: float) -> tuple[float, float] | None:
        """(lower, upper) edge of the bucket holding the ``q`` quantile; None without observations."""
        edges = sorted(self.buckets)
        if not edges or self.buckets[edges[-1]] <= 0:
            return None
        rank, lower = q * self.buckets[edges[-1]], 0.0
        for le in edges:
            if self.buckets[le] >= rank:
                return lower, le
            lower = le
        return lower, edges[-1]

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated linearly inside its bucket as Prometheus' ``histogram_quantile``
        does (the lower edge if it falls in ``+Inf``'s); None without observations."""
        bucket = self.bucket_of(q)
        if bucket is None:
            return None
        lower, upper = bucket
        if upper == math.inf:
            return lower
        total = self.buckets[max(self.buckets)]
        below = self.buckets.get(lower, 0.0)
        return lower + (upper - lower) * (q * total - below) / max(self.buckets[upper] - below, 1e-12)


def histogram(metrics: Metrics, name: str, **labels) -> Histogram:
    """The histogram ``name`` (without ``_bucket``) of a scrape, its series whose labels include ``labels`` summed;
    a scrape without it is an error that names the histograms it has."""
    buckets: dict[float, float] = {}
    for s in metrics[name + "_bucket"]:
        if all(s.labels.get(k) == str(v) for k, v in labels.items()):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    if not buckets:
        have = sorted(n.removesuffix("_bucket") for n in metrics.names if n.endswith("_bucket"))
        raise KeyError(f"no histogram {name!r} in this scrape (it has {', '.join(have) or 'none'})")
    return Histogram(buckets, metrics.value(name + "_sum", default=0.0, **labels),
                     metrics.value(name + "_count", default=0.0, **labels))


def metrics_url(base_url: str) -> str:
    """``/metrics`` lives at the server's root, not under the OpenAI ``/v1`` prefix."""
    url = str(base_url).rstrip("/")
    return url.removesuffix("/v1") + "/metrics"


def fetch_metrics(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> Metrics:
    """Scrape a vLLM server's ``/metrics`` and parse it.  The key goes along as a Bearer token: vLLM
    itself guards only ``/v1``, but a proxy in front of a shared server may guard every route."""
    url = metrics_url(str(base_url))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            text = r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise AuthenticationFailed(f"{url} refused the API key ({e.code}): pass the key the server was "
                                       "started with (client.api_key after llmlab.connect()).") from None
        if e.code in (502, 503):  # llmlab's proxy answers, the vLLM behind it does not (loading, restarting, gone)
            raise ServerUnavailable(f"{url} answered {e.code}: the proxy is up but the vLLM server behind it does "
                                    "not answer (still loading, restarting or stopped); `llmlab status` or "
                                    "`llmlab serve --status` says which.") from None
        raise ServerError(f"{url} answered {e.code}: the server does not export Prometheus metrics there "
                          "(vLLM does unless started with --disable-log-stats).") from None
    except (urllib.error.URLError, OSError) as e:
        raise ServerUnavailable(f"No server answers at {url} ({getattr(e, 'reason', e)}): is it running? "
                                "`llmlab serve --status` says.") from None
    return parse_prometheus(text)
