"""The largest load a server holds within a stated SLO: ``find_max``.

Why: a sweep at 30, 100 and 300 learners gives three points, not a limit.  The referees search (AIPerf's adaptive
scale climbs until an SLO filter fails; GuideLLM's sweep brackets the rate).  ``find_max`` does it with the course's
statistics:

- an **SLO** written as a learner says it, ``"ttft_p99<2s,failed=0"`` (:func:`parse_slo`): percentiles or means of
  TTFT, TPOT, ITL and latency in s or ms, and the failed requests as a count or a share;
- **bracket, then bisect**: from ``start`` the load grows by ``factor`` until a level misses the SLO (or shrinks
  until one meets it), then the gap between the highest level met and the lowest missed is halved until it is
  within ``resolution`` (a share of the level met).  A search may start from the bracket of an earlier one
  (``met``, ``missed``): a finer search then bisects it at once and runs neither end again;
- **repeats and intervals**: a level runs up to ``repeats`` times; each percentile is taken over the requests of
  all its runs, with a bootstrap interval (``loadtest.bootstrap_interval``).  A level whose interval lies wholly on
  one side of every limit is *clear* and runs no more repeats; one still unclear after ``repeats`` is decided by
  its value and says so;
- **stopping early**: a run ends as soon as its own requests make the SLO unreachable -- more failures than
  allowed, or more requests past a percentile's limit (finished, or still waiting longer than it for their first
  token) than the percentile of all the planned requests can hide.  A room of 100 that misses a 2-second TTFT p99
  is known after its first hundred slow requests, not after thousands.

Every step -- level, runs, each objective's value and interval, verdict and why -- is kept (``Search.steps``), so
that a committed search shows how it reached its answer.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from llmlab.loadtest.records import Record, percentile, series
from llmlab.loadtest.repeats import bootstrap_interval
from llmlab.loadtest.results import LoadResult

TIMES = ("ttft", "tpot", "itl", "latency")
_TERM = re.compile(r"^\s*(?P<name>[a-z0-9_]+?)(?:_(?P<stat>p\d+(?:\.\d+)?|mean))?\s*(?P<op><=|<|=)\s*"
                   r"(?P<value>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s|%)?\s*$")
EXAMPLE = "ttft_p99<2s,failed=0"


class SloError(ValueError):
    """An SLO that cannot be read; its message says what is wrong and how to write it."""


@dataclass(frozen=True)
class Objective:
    """One term of an SLO: ``metric`` (ttft, tpot, itl, latency or failed) at percentile ``q`` (None: the mean;
    failed: None) kept below ``limit`` (seconds; failed: a count, or a share of the requests when ``share``)."""

    metric: str
    q: float | None
    limit: float
    strict: bool  # "<" (True) or "<=" (False)
    share: bool = False
    text: str = ""

    def ok(self, value: float) -> bool:
        return value < self.limit if self.strict else value <= self.limit

    def value(self, records: list[Record]) -> float | None:
        """The figure over ``records``: a percentile or mean of the ok requests' timings, or the failures."""
        if self.metric == "failed":
            failed = sum(r.status != "ok" for r in records)
            return failed / len(records) if self.share and records else float(failed)
        values = series(records)[self.metric]
        if not values:
            return None
        return percentile(values, self.q) if self.q is not None else sum(values) / len(values)

    def interval(self, records: list[Record]) -> tuple[float, float] | None:
        """The 95 % bootstrap interval of a percentile over ``records`` (None for a mean or a count)."""
        if self.metric == "failed" or self.q is None:
            return None
        return bootstrap_interval(series(records)[self.metric], self.q)

    def certainly_missed(self, records: list[Record], in_flight: list[tuple[float, bool]], planned: int) -> str | None:
        """A sentence when ``records`` so far (and the requests still in flight) already make this objective
        unreachable for a run of ``planned`` requests, else None."""
        if self.metric == "failed":
            failed = sum(r.status != "ok" for r in records)
            allowed = self.limit * planned if self.share else self.limit
            if not self.ok(failed / planned if self.share else failed):
                return f"{failed} request(s) failed, more than {self.text} allows ({allowed:g} of {planned})"
            return None
        if self.q is None or self.metric in ("tpot", "itl"):
            return None  # a mean can come back; a TPOT is known only at the end of a request
        slow = sum(1 for r in records if r.status == "ok" and getattr(r, self.metric) is not None
                   and not self.ok(getattr(r, self.metric)))
        # Still waiting past the limit: its TTFT (no token yet) or latency (not finished) will be past it too.
        waiting = sum(1 for age, token in in_flight if not self.ok(age) and (self.metric == "latency" or not token))
        # numpy's linear percentile of N values lies past the limit once the value at index floor((N-1)q/100) does,
        # i.e. once N - floor((N-1)q/100) values are past it; N = planned is the most the run can have.
        need = planned - math.floor((planned - 1) * self.q / 100)
        if slow + waiting >= need:
            return (f"{slow + waiting} requests past {self.text} ({waiting} of them still waiting), and {need} of "
                    f"{planned} put the run's {self.metric} p{self.q:g} past the limit")
        return None


@dataclass(frozen=True)
class Slo:
    """A service-level objective: every term must hold (:func:`parse_slo` reads one)."""

    objectives: tuple[Objective, ...]
    text: str

    def stop(self, records: list[Record], in_flight: list[tuple[float, bool]], planned: int) -> str | None:
        """The early stop of a run (``run_sessions``' ``stop``): why the run cannot meet this SLO any more."""
        for o in self.objectives:
            why = o.certainly_missed(records, in_flight, planned)
            if why:
                return why
        return None

    def __str__(self) -> str:
        return self.text


def parse_slo(text: str) -> Slo:
    """Read ``"ttft_p99<2s,failed=0"``: terms joined by commas, each NAME OP LIMIT.

    NAME: ``ttft``, ``tpot``, ``itl`` or ``latency`` with ``_pNN`` (a percentile) or ``_mean``; or ``failed``.
    OP: ``<`` or ``<=`` (``failed=0`` also reads as no request failed).  LIMIT: a time in ``s`` or ``ms`` (a time
    needs its unit); for failed a count, or a share of the requests with ``%``.  Anything else is one sentence."""
    if isinstance(text, Slo):
        return text
    if not isinstance(text, str) or not text.strip():
        raise SloError(f"the SLO {text!r} is empty: write it as NAME<LIMIT terms joined by commas, e.g. {EXAMPLE}.")
    objectives = []
    for raw in text.split(","):
        term = raw.strip()
        m = _TERM.match(term.lower())
        if ">" in term:
            raise SloError(f"the SLO term {term!r} asks for more: an SLO bounds a time or a failure count from above, "
                           f"so write NAME<LIMIT, e.g. {EXAMPLE}.")
        if not m:
            raise SloError(f"the SLO term {term!r} cannot be read: write NAME<LIMIT, e.g. {EXAMPLE} (names: ttft, "
                           "tpot, itl, latency with _p50/_p90/_p99/_mean, and failed; ms or s after a time).")
        name, stat, op, value, unit = m["name"], m["stat"], m["op"], float(m["value"]), m["unit"]
        if name == "failed":
            if stat or unit in ("s", "ms"):
                raise SloError(f"the SLO term {term!r}: failed counts requests; write failed=0, failed<=3 or "
                               "failed<1%.")
            share = unit == "%"
            objectives.append(Objective("failed", None, value / 100 if share else value, strict=op == "<",
                                        share=share, text=term))
            continue
        if name not in TIMES:
            hint = " (vLLM's e2el is llmlab's latency)" if name == "e2el" else ""
            raise SloError(f"the SLO term {term!r} names {name!r}{hint}: use ttft, tpot, itl, latency or failed.")
        if stat is None:
            raise SloError(f"the SLO term {term!r} says no statistic: write {name}_p99, {name}_p50 or {name}_mean.")
        q = None if stat == "mean" else float(stat[1:])
        if q is not None and not 0 < q < 100:
            raise SloError(f"the SLO term {term!r}: a percentile lies between p0 and p100 (p50, p90, p99, p99.9).")
        if op == "=":
            raise SloError(f"the SLO term {term!r} asks a time to equal a limit: write {name}_{stat}<{m['value']}"
                           f"{unit or 's'}.")
        if unit not in ("s", "ms"):
            raise SloError(f"the SLO term {term!r} gives a time without its unit: write {m['value']}s or "
                           f"{m['value']}ms.")
        objectives.append(Objective(name, q, value / 1000 if unit == "ms" else value, strict=op == "<", text=term))
    return Slo(tuple(objectives), text.strip())


# --- one level, repeated -------------------------------------------------------------------------------------

@dataclass
class Step:
    """One level of the search: its runs' figures, and whether it met the SLO."""

    level: float
    met: bool
    clear: bool  # every figure's interval on one side of its limit (or a run stopped early, or a count)
    why: str
    runs: list[dict] = field(default_factory=list)  # per run: requests, ok, failed, stopped, wall_s
    figures: dict = field(default_factory=dict)  # objective text -> {value, low, high, ok}


def judge(slo: Slo, results: list[LoadResult]) -> tuple[bool, bool, str, dict]:
    """(met, clear, why, figures) of a level from its runs, their requests pooled.  A run stopped early missed."""
    records = [r for res in results for r in res.records]
    figures, missed, unclear = {}, [], []
    stopped = [res.stopped for res in results if res.stopped]
    for o in slo.objectives:
        if o.metric == "failed":  # a count: each run on its own (a share: pooled)
            values = [o.value(res.records) for res in results]
            value = (o.value(records) if o.share else max(values)) if results else None
        else:
            value = o.value(records)
        interval = o.interval(records)
        ok = value is not None and o.ok(value)
        figures[o.text] = {"value": value, "low": interval[0] if interval else None,
                           "high": interval[1] if interval else None, "ok": ok}
        if not ok:
            missed.append(o.text if value is None else f"{o.text} ({_show(o, value)})")
        if interval and o.ok(interval[0]) != o.ok(interval[1]):
            unclear.append(o.text)
    if stopped:  # its figures are over the requests that finished before the stop, and read better than the run
        for f in figures.values():
            f["partial"] = True
        return False, True, f"stopped early: {stopped[0]}", figures
    if missed:
        return False, not unclear, "missed " + ", ".join(missed), figures
    if unclear:
        return True, False, "met, but the interval of " + ", ".join(unclear) + " reaches past its limit", figures
    return True, True, "met", figures


def _show(o: Objective, value: float) -> str:
    if o.metric == "failed":
        return f"{value:.1%}" if o.share else f"{value:g} failed"
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


# --- the search ----------------------------------------------------------------------------------------------

@dataclass
class Search:
    """A finished search: ``best`` (the highest level that met the SLO, None if none did), ``past`` (the lowest
    that missed, None if none did), and every step in the order it ran."""

    slo: str
    best: float | None
    past: float | None
    steps: list[Step]
    unit: str = "load"
    known: dict = field(default_factory=dict)  # {"met": 30, "missed": 45}: the earlier search's bracket it began at

    def sentence(self) -> str:
        if self.best is None:
            return (f"no {self.unit} tried met {self.slo}: the lowest, {_level(self.past)}, missed "
                    f"({self._why(self.past)}).")
        beyond = f"; {_level(self.past)} missed ({self._why(self.past)})" if self.past is not None else (
            "; no level tried missed it (raise the highest level)")
        earlier = "" if any(s.level == self.best for s in self.steps) else " (in the earlier search)"
        return f"the largest {self.unit} that met {self.slo}: {_level(self.best)}{earlier}{beyond}."

    def _why(self, level) -> str:
        """Why the last step at ``level`` went as it did (a level only the earlier search ran: says so)."""
        step = next((s for s in reversed(self.steps) if s.level == level), None)
        return step.why if step else "in the earlier search"

    def to_dict(self) -> dict:
        return {"slo": self.slo, "unit": self.unit, "best": self.best, "past": self.past,
                "sentence": self.sentence(), "known": self.known, "steps": [asdict(s) for s in self.steps]}

    def to_frame(self):
        """One row per step: level, verdict, each objective's value with its interval, runs, why."""
        import pandas as pd

        rows = []
        for i, s in enumerate(self.steps, 1):
            row = {"step": i, self.unit: s.level, "met": s.met, "clear": s.clear, "runs": len(s.runs)}
            for text, f in s.figures.items():
                row[text] = f["value"]
                if f["low"] is not None:
                    row[f"{text} interval"] = (round(f["low"], 4), round(f["high"], 4))
            row["why"] = s.why
            rows.append(row)
        return pd.DataFrame(rows).set_index("step")


def _level(x):
    return f"{x:g}" if isinstance(x, float) else str(x)


def next_level(best: float | None, past: float | None, start: float, *, factor: float = 2.0,
               resolution: float = 0.1, lowest: float = 1, highest: float | None = None,
               integer: bool = True) -> float | None:
    """The level to try next, or None when the search is done.  Pure: bracket by ``factor`` from ``start`` until a
    level met and one missed, then bisect until ``past - best`` is within ``resolution`` x ``best`` (at least one
    step of an integer level).  Stops at ``lowest`` (nothing met) and ``highest`` (nothing missed)."""
    def snap(x: float) -> float:
        return max(lowest, int(round(x))) if integer else max(lowest, x)

    if best is None and past is None:
        return snap(start)
    if past is None:  # everything tried met: climb
        if highest is not None and best >= highest:
            return None
        up = snap(best * factor)
        up = up if up > best else best + 1
        return min(up, highest) if highest is not None else up
    if best is None:  # everything tried missed: come down
        if past <= lowest:
            return None
        down = snap(past / factor)
        return down if down < past else None
    gap = past - best
    if gap <= max(resolution * best, 1 if integer else 0):
        return None
    mid = snap((best + past) / 2)
    return mid if best < mid < past else None


def find_max(measure: Callable[[float, int, Callable], LoadResult], slo, *, start: float, factor: float = 2.0,
             resolution: float = 0.1, lowest: float = 1, highest: float | None = None, repeats: int = 3,
             integer: bool = True, unit: str = "load", max_steps: int = 20, met: float | None = None,
             missed: float | None = None, progress: Callable[[str], None] | None = print) -> Search:
    """Find the largest level that meets ``slo`` (a string for :func:`parse_slo`, or an :class:`Slo`).

    ``measure(level, repeat, stop)`` runs the load once at ``level`` (``repeat`` counts from 0: use it for a new
    seed) and returns its ``LoadResult``; it should pass ``stop`` to ``run_sessions``/``run_rate``/``run_open`` so
    that a run certainly past the SLO ends at once.  See the module docstring for the search itself.  After
    ``max_steps`` levels the search ends where it is (a load that never misses climbs without end otherwise).
    ``met`` and ``missed``: levels an earlier search decided (a committed one, say); this one starts from them as
    if it had run them (with both, ``start`` is unused), runs neither again, and a finer search costs only new levels.
    """
    slo = parse_slo(slo)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give a whole number of runs per level, at least 1.")
    if not factor > 1:
        raise ValueError(f"factor={factor!r}: the load must grow between levels: give a number > 1, e.g. 2.")
    if met is not None and missed is not None and not met < missed:
        raise ValueError(f"met={met!r}, missed={missed!r}: an earlier search's bracket has the level that met below "
                         "the one that missed, e.g. met=30, missed=45.")
    say = progress or (lambda _: None)
    best, past = met, missed
    known = {k: v for k, v in (("met", met), ("missed", missed)) if v is not None}
    steps: list[Step] = []
    while len(steps) < max_steps and (level := next_level(
            best, past, start, factor=factor, resolution=resolution, lowest=lowest, highest=highest,
            integer=integer)) is not None:
        results, runs = [], []
        for i in range(repeats):
            t0 = time.time()
            res = measure(level, i, slo.stop)
            results.append(res)
            s = res.summary()
            runs.append({"requests": s["requests"], "ok": s["ok"], "failed": s["errors"],
                         "planned": res.planned, "stopped": res.stopped, "wall_s": round(time.time() - t0, 1),
                         **{k: s.get(k) for k in ("ttft_p50", "ttft_p99", "latency_p99", "sent_late_p99_s")}})
            met, clear, why, figures = judge(slo, results)
            say(f"  {unit} {_level(level)}, run {i + 1}: {why} ({s['requests']} requests, "
                f"{runs[-1]['wall_s']:.0f} s)")
            if clear:
                break
        if not clear:
            why += f" (unclear after {repeats} run{'s' * (repeats > 1)}: decided by the value)"
        steps.append(Step(level, met, clear, why, runs, figures))
        if met:
            best = level if best is None else max(best, level)
        else:
            past = level if past is None else min(past, level)
    search = Search(slo.text, best, past, steps, unit, known)
    say(search.sentence())
    return search


def find_max_rate(client, model: str, prompts, slo, *, duration: float = 20.0, start: float = 1.0, seed: int = 0,
                  resolution: float = 0.1, repeats: int = 3, highest: float | None = None, progress=print,
                  **kwargs) -> Search:
    """The largest Poisson rate (requests/s) at which the prompts, sent open-loop (:func:`run_rate`) for ``duration``
    seconds, meet ``slo``.

    Why a duration and not a fixed set of requests: N requests at an ever higher rate are, in the end, a burst of N
    that a server holds however high the rate goes; a rate is sustained only if the server keeps up for a while.  So a
    level at rate R sends rate x duration requests, the prompts taken in turn (a prompt sent twice finds its prefix
    in the cache: give at least as many prompts as the highest rate x duration to avoid it).  Each repeat draws new
    arrival times (``seed + repeat``); ``kwargs`` go to :func:`run_rate` (``max_tokens``, ``chat``, sampling
    parameters such as ``ignore_eos=True``)."""
    from dataclasses import replace

    from llmlab.loadtest.openloop import run_rate
    from llmlab.loadtest.records import as_jobs

    jobs = as_jobs(prompts)
    if not jobs:
        raise ValueError("find_max_rate needs prompts to send: give at least one.")
    if not duration > 0:
        raise ValueError(f"duration={duration!r}: give the seconds each level sends for, > 0 (e.g. 20).")

    def measure(rate, repeat, stop):
        n = max(1, round(rate * duration))
        sent = [replace(jobs[i % len(jobs)], id=i) for i in range(n)]
        return run_rate(client, model, sent, rate, seed=seed + repeat, stop=stop, progress=False, **kwargs)

    return find_max(measure, slo, start=start, resolution=resolution, repeats=repeats, highest=highest,
                    lowest=min(start, 0.1), integer=False, unit="rate (requests/s)", progress=progress)
