"""vLLM's ``/metrics``: fetch it with the server's key and read Prometheus' text format.

Why here: notebook 02 reads the KV-cache counters, ``llmlab metrics`` a job's figures, the version tests every
release's metric names -- all from one scrape.  The parser is our own (about 30 lines, no dependency) and
strict: a malformed line raises ``ValueError`` naming it rather than being skipped.  ``llmlab.kvcache``
re-exports these names for the lesson.  ``histogram`` reads one histogram of a scrape; two scrapes' difference is
what the server observed between them (``llmlab metrics``' quantiles, the GPU parity benchmark's server-side TTFT).
:class:`Counters` is the one snapshot type of the lessons: the figures they follow, read from one scrape, and
``after - before`` what happened in between.
"""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields, replace

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


# --- One snapshot type for every lesson that subtracts: vLLM's counters only grow while its process lives ---------

STARTED = "process_start_time_seconds"  # prometheus_client's own: when the server process started
EMPTY = Histogram({})


def _histogram_or_empty(metrics: Metrics, name: str) -> Histogram:
    """A histogram this server does not export reads as one without observations: a lesson's figure is then 0."""
    return histogram(metrics, name) if name + "_bucket" in metrics else EMPTY


def _grew(after: Histogram, before: Histogram) -> Histogram:
    """``after - before``, where a first scrape without the histogram counts as all zeros."""
    return after - (before if before.buckets else Histogram(dict.fromkeys(after.buckets, 0.0)))


@dataclass(frozen=True)
class Counters:
    """The figures of one ``/metrics`` scrape that the lessons follow, summed over engines.

    Why one type: what some requests did on a server is ``after - before`` of its counters, and lessons 02 (the prefix
    cache), 12 (drafts), 13 (a room), 15 (replicas), 16, 17 and 19 (engine steps, preemptions), 18 (the decoder's
    steps) and ``llmlab top`` (rates) all subtract.  ``after - before`` subtracts the counters and the histograms;
    the gauges (``running``, ``waiting``, ``kv_usage``) and the cache's configuration are the later scrape's, as they
    are *now*.
    A metric this server does not export reads 0 (or ``None`` for the configuration), so a lesson can say what the
    server does not report and go on.  Counters are whole numbers: tokens, requests, steps."""

    prompt_tokens: int = 0                # prompt tokens of finished and running requests
    generated: int = 0                    # output tokens
    finished: int = 0                     # requests finished, every finish reason
    prefix_queries: int = 0               # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0                  # of those, found there
    preemptions: int = 0                  # running requests pushed out when the KV cache ran out
    drafts: int = 0                       # speculative decoding: steps that proposed a draft
    draft_tokens: int = 0                 # tokens proposed
    accepted: int = 0                     # of those, accepted
    accepted_at: tuple[int, ...] = ()     # accepted at draft position 0, 1, ...
    by_source: dict = field(default_factory=dict)  # prompt tokens by where their KV came from (computed, cache, ...)
    ttft: Histogram = EMPTY               # time to first token, inside the server
    itl: Histogram = EMPTY                # gaps between a request's tokens, inside the engine core
    prefill_computed: Histogram = EMPTY   # per request: prompt tokens really computed
    step_sizes: Histogram = EMPTY         # per engine step that gave some request output: its tokens
    preemptions_per_request: Histogram = EMPTY  # per finished request: how often it was preempted
    running: float = 0.0                  # gauge: requests in the running batch
    waiting: float = 0.0                  # gauge: requests queued
    kv_usage: float = 0.0                 # gauge: share of KV blocks held by running requests, 0..1
    block_size: int | None = None         # the cache's configuration (vllm:cache_config_info)
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    prefix_caching: bool | None = None
    started: float | None = None          # when the server process started (None where not exported)

    GAUGES = ("running", "waiting", "kv_usage", "block_size", "num_gpu_blocks", "num_cpu_blocks", "prefix_caching",
              "started")

    @property
    def steps(self) -> int:
        """Engine steps that gave some request output (a step computing only a chunk of a prompt is not one)."""
        return int(self.step_sizes.count)

    @property
    def step_tokens(self) -> int:
        """The tokens vLLM credits those steps with: answers' tokens, and a prompt's in the step that finishes it."""
        return int(self.step_sizes.sum)

    @property
    def mixed_steps(self) -> int:
        """Steps that computed more than one token: beside one running answer, a step above 1 carried a prompt."""
        return self.steps - int(self.step_sizes.buckets.get(1.0, 0.0))

    @property
    def preempted_again(self) -> int:
        """Finished requests preempted more than once (the histogram's lowest bucket, ``le="1.0"``, cannot tell once
        from never; with ``preemptions`` it says whether preemptions fell on different requests or the same)."""
        return int(self.preemptions_per_request.count - self.preemptions_per_request.buckets.get(1.0, 0.0))

    @property
    def computed(self) -> int:
        """Prompt tokens computed here (not found in the prefix cache, not loaded through a KV connector)."""
        return int(self.by_source.get("local_compute", 0))

    def restarted_since(self, before: Counters) -> bool:
        """Whether the server restarted between two scrapes: a new process start time, or a counter that went down
        (a counter only grows while its process lives; after a restart it begins again at zero)."""
        if None not in (before.started, self.started) and self.started != before.started:
            return True
        return any(getattr(self, f.name) < getattr(before, f.name) for f in fields(self)
                   if f.name not in self.GAUGES and isinstance(getattr(self, f.name), int))

    def __sub__(self, before: Counters) -> Counters:
        changes = {}
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(before, f.name)
            if f.name in self.GAUGES:
                continue
            if isinstance(now, Histogram):
                changes[f.name] = _grew(now, then)
            elif isinstance(now, tuple):
                then = then + (0,) * (len(now) - len(then))  # a first scrape may not have every position yet
                changes[f.name] = tuple(a - b for a, b in zip(now, then, strict=False))
            elif isinstance(now, dict):
                changes[f.name] = {k: v - then.get(k, 0) for k, v in now.items()}
            else:
                changes[f.name] = now - then
        return replace(self, **changes)


def read_counters(metrics: Metrics) -> Counters:
    """The :class:`Counters` of one parsed scrape."""
    def count(name: str, **labels) -> int:
        return int(metrics.value(name, default=0.0, **labels))

    positions: dict[int, float] = {}
    for s in metrics[ACCEPTED_AT]:
        positions[int(s.labels["position"])] = positions.get(int(s.labels["position"]), 0.0) + s.value
    sources = sorted({s.labels["source"] for s in metrics[PROMPT_BY_SOURCE] if "source" in s.labels})
    config = metrics[CACHE_CONFIG][0].labels if CACHE_CONFIG in metrics else {}

    def setting(key: str) -> int | None:
        return int(config[key]) if config.get(key, "None") not in ("None", "") else None

    started = metrics.value(STARTED, default=math.nan)
    return Counters(
        prompt_tokens=count(PROMPT_TOKENS), generated=count(GENERATED), finished=count(FINISHED),
        prefix_queries=count(PREFIX_QUERIES), prefix_hits=count(PREFIX_HITS), preemptions=count(PREEMPTIONS),
        drafts=count(DRAFTS), draft_tokens=count(DRAFT_TOKENS), accepted=count(ACCEPTED),
        accepted_at=tuple(int(positions[p]) for p in sorted(positions)),
        by_source={s: count(PROMPT_BY_SOURCE, source=s) for s in sources},
        ttft=_histogram_or_empty(metrics, TTFT), itl=_histogram_or_empty(metrics, ITL),
        prefill_computed=_histogram_or_empty(metrics, PREFILL_COMPUTED), step_sizes=_histogram_or_empty(metrics, STEPS),
        preemptions_per_request=_histogram_or_empty(metrics, REQUEST_PREEMPTIONS),
        running=metrics.value(RUNNING, default=0.0), waiting=metrics.value(WAITING, default=0.0),
        kv_usage=metrics.value(KV_USAGE, default=0.0), block_size=setting("block_size"),
        num_gpu_blocks=setting("num_gpu_blocks"), num_cpu_blocks=setting("num_cpu_blocks"),
        prefix_caching=config["enable_prefix_caching"] == "True" if "enable_prefix_caching" in config else None,
        started=None if math.isnan(started) else started)


def counters(client, timeout: float = 30.0) -> Counters:
    """The :class:`Counters` of the server a client (``llmlab.connect()``'s, or anything with ``base_url`` and
    ``api_key``) talks to, scraped now."""
    return read_counters(fetch_metrics(str(client.base_url), client.api_key, timeout))


def wait_for_request(client, before: Counters, requests: int = 1, timeout: float = 30.0) -> Counters:
    """Scrape until the server has counted ``requests`` more finished requests than ``before``; return that scrape.

    Why: vLLM records a request's statistics in its output loop, just after its answer may already have reached the
    client, so a scrape at once can miss the last request."""
    deadline = time.monotonic() + timeout
    while True:
        now = counters(client)
        if now.finished - before.finished >= requests:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"{metrics_url(str(client.base_url))} did not count {requests} more finished "
                               f"request(s) within {timeout:.0f} s: is another client using this server, or did the "
                               "request fail?")
        time.sleep(0.05)


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
