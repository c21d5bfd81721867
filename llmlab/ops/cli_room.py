"""``llmlab room``: rehearse a workshop room on this machine, or replay its traces for a larger one.

A thin shell over :func:`llmlab.ops.room.rehearse` and :func:`llmlab.ops.roomreport.replay`: arguments and
printing here, the logic there.
"""

from __future__ import annotations

import json
import sys

from llmlab.check.progress import printable


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise SystemExit(f"llmlab room: --learners {text!r}: give a number of learners (3), or for --replay a "
                         "comma-separated list (30,100,300).")
    return counts


# A replay's report and records go here unless --out says otherwise: never into the traces' folder (issue 47), which
# may be a committed result or the instructor's only copy of a room's recording.
REPLAY_OUT = "build/room-replay"
SEARCH_OPTIONS = ("slo", "repeats", "resolution", "bracket")  # --find-max's own options (None unless given)


def cmd_room(args) -> int:
    from llmlab.ops import room, roomreport

    if getattr(args, "find_max", False):
        return _find_max(args)
    searching = [f"--{name}" for name in SEARCH_OPTIONS if getattr(args, name, None) is not None]
    if searching:  # a search's option without the search would be ignored: say so rather than run something else
        print(f"llmlab room: {', '.join(searching)} belong{'s' if len(searching) == 1 else ''} to --find-max: add "
              "--find-max (with --replay TRACE_DIR and --slo), or leave them out.", file=sys.stderr)
        return 2
    counts = _counts(args.learners)
    try:
        if args.replay:
            report = roomreport.replay(args.replay, counts, stagger=args.stagger if args.stagger is not None else 1.0,
                                       out=args.out or REPLAY_OUT, progress=lambda s: print(s, flush=True))
        else:
            if len(counts) != 1:
                raise room.RoomError("a rehearsed room has one size (--learners 3); lists are for --replay.")
            report = room.rehearse(counts[0], args.out or "build/room",
                                   stagger=args.stagger if args.stagger is not None else 4.0,
                                   revoke=not args.no_revoke, restart=not args.no_restart, timeout=args.timeout)
    except (room.RoomError, FileNotFoundError) as e:
        print(f"llmlab room: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    elif not args.replay:
        print(summary(report))
    if args.replay:
        return 0 if all(r["failures"] == 0 for r in report["runs"]) else 1
    return 0 if not report["cells_failed"] and not report["left_behind"] else 1


def _find_max(args) -> int:
    """``--replay TRACE_DIR --find-max --slo ...``: the largest room whose replay meets the SLO (0: one did)."""
    from llmlab.loadtest import SloError, parse_slo
    from llmlab.ops.roomsearch import find_max_room

    if not args.replay:
        print("llmlab room: --find-max searches replayed rooms: give the traces with --replay TRACE_DIR.",
              file=sys.stderr)
        return 2
    if not args.slo:
        print("llmlab room: --find-max needs the objective it searches for: add --slo, e.g. "
              "--slo 'ttft_p99<2s,failed=0'.", file=sys.stderr)
        return 2
    counts = _counts(args.learners if args.learners != "3" else "30")
    bracket = _counts(args.bracket) if args.bracket else None
    if bracket is not None and (len(bracket) > 2 or len(bracket) == 2 and bracket[0] >= bracket[1]):
        print(f"llmlab room: --bracket {args.bracket!r}: give the room an earlier search met and the one it missed, "
              "MET,MISSED (e.g. 30,45), or the room it met alone (44).", file=sys.stderr)
        return 2
    if bracket is not None and len(bracket) == 1:
        bracket = (bracket[0], None)  # only a room that met: climb from it
    try:
        parse_slo(args.slo)
        report = find_max_room(args.replay, args.slo, start=counts[0], highest=counts[1] if len(counts) > 1 else None,
                               stagger=args.stagger if args.stagger is not None else 1.0,
                               repeats=2 if args.repeats is None else args.repeats,
                               resolution=0.25 if args.resolution is None else args.resolution,
                               out=args.out or REPLAY_OUT, bracket=bracket, progress=lambda s: print(s, flush=True))
    except SloError as e:
        print(f"llmlab room: --slo: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"llmlab room: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    return 0 if report["best"] is not None else 1


def summary(r: dict) -> str:
    """The report's key figures, a line each."""
    rev, rst = r.get("revocation") or {}, r.get("restart") or {}
    lines = [f"learners            {r['learners']} ({', '.join(r['names'])})",
             f"cells failed        {len(r['cells_failed'])}"]
    lines += [printable(f"  {c['learner']} {c['notebook']} cell {c['cell']}: {c['error']} (at: {c['raised_at']})",
                        400) for c in r["cells_failed"]]  # learners' strings: no escapes reach the terminal
    lines += ["path seconds        " + ", ".join(f"{k.rsplit('-', 1)[-1]}: {v:.0f}" for k, v in
                                                  r["path_seconds"].items()),
              f"fairness            {r['fairness']} (slowest / median path time)",
              f"latency ms          p50 {r['latency_ms']['p50']}, p99 {r['latency_ms']['p99']} "
              f"({r['latency_ms']['requests']} generation requests; first byte p50 {r['ttfb_ms']['p50']})",
              f"server peaks        {r['server']['peak_running']} running, {r['server']['peak_waiting']} waiting, "
              f"KV {r['server']['peak_kv_pct']} %",
              f"revoked             {rev.get('learner')}: {rev.get('sentence')!r}" if rev else "revoked             -",
              f"kernel restarted    {rst.get('learner')} in {rst.get('notebook')} after cell {rst.get('after_cell')}; "
              f"path completed: {rst.get('path_completed')}" if rst else "kernel restarted    -",
              f"handed in (--room)  {', '.join(map(str, r['handed_in'])) or 'nobody'}",
              f"left behind         {r['left_behind'] or 'nothing'}",
              f"wall time           {r['wall_s']:.0f} s"]
    return "\n".join(lines)


def add_commands(sub) -> None:
    p = sub.add_parser("room", help="rehearse a workshop room here (root, SLURM): N learners run the path on one "
                                    "shared server; or --replay its traces for K learners")
    p.add_argument("--learners", default="3", help="how many learners (default 3); with --replay a list, 30,100,300")
    p.add_argument("--out", help=f"report folder (default build/room; with --replay, {REPLAY_OUT})")
    p.add_argument("--stagger", type=float, help="seconds between two learners sitting down (default 4; replay 1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the learners may take in all")
    p.add_argument("--no-revoke", action="store_true", help="do not revoke the last learner mid-run")
    p.add_argument("--no-restart", action="store_true", help="do not restart a learner's kernel mid-path")
    p.add_argument("--replay", metavar="TRACE_DIR", help="replay a room's traces (its report folder) against the "
                                                         "server llmlab.connect() finds, for each K of --learners")
    p.add_argument("--find-max", action="store_true", help="with --replay: search for the largest room that meets "
                                                          "--slo, starting at --learners (START or START,HIGHEST)")
    p.add_argument("--slo", help="the objective of --find-max, e.g. 'ttft_p99<2s,failed=0' (ttft/tpot/itl/latency "
                                 "_pNN or _mean in s or ms; failed as a count or a %%)")
    p.add_argument("--repeats", type=int, help="--find-max: runs of a level at most, until its interval "
                                                          "is clear (default 2)")
    p.add_argument("--resolution", type=float,
                   help="--find-max: stop when the room that missed is within this share of the one that met (0.25)")
    p.add_argument("--bracket", metavar="MET,MISSED", help="--find-max: start from an earlier search's bracket "
                                                           "(30,45: 30 met, 45 missed) and bisect it, running neither "
                                                           "again; or from a room it met (44), climbing from there")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.set_defaults(func=cmd_room)
