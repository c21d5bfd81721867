"""The largest room a server holds: ``llmlab room --replay TRACE_DIR --find-max --slo ...``.

Why: replaying a room's traces at 30, 100 and 300 learners gives three points; the room a server holds lies between
two of them.  :func:`find_max_room` searches for it with ``llmlab.loadtest.find_max`` (bracket, bisect, repeats with
intervals, a replay stopped as soon as it is certainly past the SLO), each level the replay of ``llmlab room
--replay`` (``roomreport.schedule``).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmlab import loadtest
from llmlab.ops.roomreport import load_traces, save_records, schedule


def find_max_room(trace_dir, slo: str, *, start: int = 30, stagger: float = 1.0, repeats: int = 2,
                  resolution: float = 0.25, highest: int | None = None, timeout: float = 300.0, client=None,
                  model: str | None = None, out=None, bracket: tuple[int, int] | None = None, progress=print) -> dict:
    """The largest room whose replay meets ``slo`` (``llmlab.loadtest.find_max`` over the number of learners).

    Each level is the replay of ``llmlab room --replay`` (``roomreport.schedule``: learner i replays recorded
    learner i mod R, ``stagger`` s after the one before, each request at its recorded offset; greedy, every answer
    its recorded length), sent open-loop by ``llmlab.loadtest.run_open`` so that a replay certainly past the SLO
    stops at once.  ``bracket``: (met, missed) of an earlier search on the same server, to bisect without running
    either again.  Writes ``find-max.json`` (every step, every run) and each run's records to ``out``."""
    slo = loadtest.parse_slo(slo)  # before anything starts: a typo costs no replay
    traces = load_traces(Path(trace_dir))
    if client is None:
        import llmlab

        client, model = llmlab.connect(quiet=True)
    folder = Path(out) if out is not None else None

    def measure(k, repeat, stop):
        plan = schedule(traces, int(k), stagger)
        progress(f"replay: {k} learners (run {repeat + 1}), {len(plan)} requests over {plan[-1][0]:.0f} s of schedule")
        res = loadtest.run_open(client, model, [job for _, job in plan], [at for at, _ in plan], stop=stop,
                                timeout=timeout, progress=False, temperature=0, ignore_eos=True)
        if folder is not None:
            save_records(folder / f"find-max-{int(k)}-run{repeat + 1}.records.jsonl.gz", res.records)
        return res

    met, missed = bracket if bracket is not None else (None, None)
    search = loadtest.find_max(measure, slo, start=start, resolution=resolution, repeats=repeats, lowest=1,
                               highest=highest, integer=True, unit="room (learners)", met=met, missed=missed,
                               progress=progress)
    report = {**search.to_dict(), "trace_dir": str(trace_dir), "recorded": list(traces), "stagger_s": stagger,
              "server": str(client.base_url), "model": model, "repeats": repeats, "resolution": resolution,
              "start": start}
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "find-max.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
