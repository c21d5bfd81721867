"""Repeats and intervals: a load test's figures with the uncertainty they carry.

Why: one run of 100 requests puts its p99 on its single slowest request, and the next run moves it (``vllm bench
serve`` measured TTFT p99 from 54 to 407 ms across the repeats of one run on two shared cores).  The referees repeat:
AIPerf runs ``--num-profile-runs`` and reports confidence intervals, GuideLLM stops once a t-distribution margin of
error is small enough.  So ``loadtest.repeat()`` runs one level N times, and a :class:`Repeated` gives each figure
as

- the **median of the runs** (one bad run moves it little),
- an **interval**: for a percentile, a bootstrap over the requests of all runs pooled (resample them with
  replacement, take the percentile, keep the central 95 % of those); for a per-run figure (throughput), the
  runs' range;
- the **tail** it rests on: the requests of all runs beyond the percentile; under :data:`MIN_TAIL` the figure says
  so, and how many requests would give it ten.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures); read them in the order records,
results, request, repeats, driver.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from llmlab.loadtest.records import PERCENTILES, Record, series, summarize
from llmlab.loadtest.results import LoadResult

MIN_TAIL = 10          # samples beyond a percentile below which it is called thin
LEVEL = 0.95           # the interval's coverage
RESAMPLES = 2000       # bootstrap draws
PER_RUN = ("output_tokens_per_s", "requests_per_s")


def tail_samples(n: int, q: float) -> int:
    """How many of ``n`` samples lie beyond the ``q``-th percentile: what it really rests on (p99 of 100: one)."""
    return int(n * (100 - q) / 100 + 1e-9)


def needed_for_tail(q: float, tail: int = MIN_TAIL) -> int:
    """The samples it takes to put ``tail`` of them beyond the ``q``-th percentile (p99: 1,000 for ten)."""
    return math.ceil(tail * 100 / (100 - q) - 1e-9)


def bootstrap_interval(values: Iterable[float], q: float, *, level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the ``q``-th percentile of ``values`` (None under two values): draw
    ``resamples`` samples of the same size with replacement, take each one's percentile, keep the central
    ``level`` share.  Seeded, so that a notebook prints the same interval twice."""
    import numpy as np

    v = np.asarray(list(values), dtype=float)
    if len(v) < 2:
        return None
    rng = np.random.default_rng(seed)
    chunk = max(1, 2_000_000 // len(v))  # at most ~16 MB of draws at a time
    stats = np.concatenate([np.percentile(rng.choice(v, size=(min(chunk, resamples - i), len(v))), q, axis=1)
                            for i in range(0, resamples, chunk)])
    lo, hi = np.percentile(stats, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)


@dataclass
class Figure:
    """One figure over the repeats: the median of the runs' values, its interval, and what it rests on."""

    name: str                     # e.g. "ttft_p99" (seconds) or "output_tokens_per_s"
    median: float | None          # the median of the runs' values
    runs: list[float | None]      # each run's value
    low: float | None             # the interval (see the module docstring)
    high: float | None
    samples: int                  # pooled samples (a per-run figure: the runs)
    tail: int | None = None       # pooled samples beyond the percentile (percentiles only)

    @property
    def note(self) -> str:
        """Empty, or one sentence: the percentile rests on too few samples, and how many requests would do."""
        if self.tail is None or self.tail >= MIN_TAIL:
            return ""
        if self.samples == 0:
            return f"{self.name}: no sample (no request succeeded)."
        q = float(self.name.rsplit("_p", 1)[1])
        return (f"{self.name} rests on {self.tail} sample(s) beyond it: send at least "
                f"{needed_for_tail(q):,} samples in all for {MIN_TAIL}.")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Repeated:
    """The runs of one level repeated (:func:`repeat`), and their figures."""

    results: list[LoadResult]
    concurrency: int | None = None

    @property
    def records(self) -> list[Record]:
        """Every run's records, pooled."""
        return [r for res in self.results for r in res.records]

    def figures(self) -> dict[str, Figure]:
        """Each percentile of TTFT, TPOT, ITL and latency, and the throughputs, each a :class:`Figure`."""
        summaries = [res.summary() for res in self.results]
        out = {}
        for name, pooled in series(self.records).items():
            for q in PERCENTILES:
                key = f"{name}_p{q}"
                interval = bootstrap_interval(pooled, q) or (None, None)
                out[key] = Figure(key, _median([s[key] for s in summaries]), [s[key] for s in summaries],
                                  *interval, samples=len(pooled), tail=tail_samples(len(pooled), q))
        for key in PER_RUN:
            runs = [s[key] for s in summaries]
            out[key] = Figure(key, _median(runs), runs, min(runs), max(runs), samples=len(runs))
        return out

    def summary(self, slo: dict | None = None) -> dict:
        """The pooled :func:`summarize` (counts, errors, concurrency seen, goodput with ``slo``), each figure replaced
        by the median of the runs and joined by ``<figure>_low`` / ``<figure>_high``; ``repeats`` and the thin
        figures' ``notes``."""
        s = summarize(self.records, self.concurrency, slo)
        figures = self.figures()
        for key, f in figures.items():
            s[key], s[f"{key}_low"], s[f"{key}_high"] = f.median, f.low, f.high
        s["repeats"] = len(self.results)
        s["notes"] = [f.note for f in figures.values() if f.note]
        return s

    def to_frame(self):
        """One row per figure: median, interval, each run, samples and tail, in milliseconds for times."""
        import pandas as pd

        def scale(v, factor):
            return None if v is None else round(v * factor, 3)

        rows = []
        for f in self.figures().values():
            k = 1 if f.name in PER_RUN else 1000
            rows.append({"figure": f.name if k == 1 else f"{f.name} (ms)", "median": scale(f.median, k),
                         "low": scale(f.low, k), "high": scale(f.high, k), "runs": [scale(v, k) for v in f.runs],
                         "samples": f.samples, "tail": f.tail, "note": f.note})
        return pd.DataFrame(rows).set_index("figure")

    def __repr__(self) -> str:
        n = sum(len(res) for res in self.results)
        return f"Repeated({len(self.results)} runs, {n} requests, concurrency {self.concurrency})"
