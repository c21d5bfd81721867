"""``llmlab top [JOB]``: one server's running and waiting requests, KV cache, tokens/s, preemptions and prefix hits,
drawn over time in place in a terminal.

Arguments, the terminal and printing only: the scrapes, the rates (a restart included) and the drawing are
``llmlab.top``'s, which the notebook's widget uses too.  ``--once`` and ``--json`` are for scripts and graders;
``--room DIR`` puts the room's ``llmlab progress --room DIR`` table beside the server's view, for the instructor.
The server's key goes from its 0600 file to the ``Authorization`` header and nowhere else: no line printed here
holds it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from llmlab import top
from llmlab.serve.info import ServerInfo, ServerUnavailable

# A terminal that understands ANSI: the alternate screen (the shell's lines come back afterwards), no cursor, home.
ENTER, LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def server(job: str | None) -> top.Target:
    """The server to watch: the embedded one (no JOB, or ``embedded``) or a SLURM job's, as its connection file says.
    Each way it cannot be watched is one sentence (not running, still loading, ended)."""
    if job in (None, "embedded"):
        from llmlab.serve.embedded import state_file

        if not state_file().exists():
            raise ServerUnavailable("The embedded server is not running: start it with `llmlab serve --background` "
                                    "(or name a job: `llmlab top JOB`; `llmlab status` lists yours).")
        info, name = ServerInfo.read(state_file()), "the embedded server"
    else:
        from llmlab.ops import jobs

        info, name = jobs.server_info(job), f"job {job}"
    if info.status == "loading":
        follow = f"llmlab status --wait {job}" if job else "llmlab serve --status"
        raise ServerUnavailable(f"The server of {name} is still loading ({info.extra.get('phase') or 'starting'}): "
                                f"`{follow}` follows it; then `llmlab top` again.")
    return top.Target(info.base_url, info.key(), f"{name} ({info.model}) at {info.base_url}")


def room_lines(folder: str) -> list[str]:
    """``llmlab progress --room DIR`` as lines, under a title (its strings are already made printable there)."""
    from llmlab.check import progress
    from llmlab.ops import course

    return [f"the room ({folder}):", *progress.show_room(Path(folder), course.path_lessons()).splitlines()]


def beside(left: list[str], right: list[str], columns: int, gap: int = 4) -> list[str]:
    """Two blocks of lines side by side when the terminal is wide enough, else one above the other."""
    if not right:
        return left
    width = max(map(len, left), default=0)
    if width + gap + max(map(len, right), default=0) > columns:
        return [*left, "", *right]
    rows = max(len(left), len(right))
    left, right = left + [""] * (rows - len(left)), right + [""] * (rows - len(right))
    return [f"{a:<{width + gap}}{b}".rstrip() for a, b in zip(left, right, strict=True)]


def frame(view: top.Top, a) -> list[str]:
    lines = view.panel(a.samples, a.interval)
    return beside(lines, room_lines(a.room) if a.room else [], shutil.get_terminal_size().columns)


def as_json(view: top.Top, point: top.Point, room: str | None) -> dict:
    out = {"server": view.server.label, "url": view.server.url, **point.as_dict()}
    if room:
        from llmlab.check import progress

        out["room"] = progress.read_room(Path(room))[0]
    return out


def once(view: top.Top, a) -> int:
    """Two scrapes ``--interval`` apart (a rate needs two), then the view or its JSON; any failure is raised."""
    view.sample()
    time.sleep(a.interval)
    point = view.sample()
    print(json.dumps(as_json(view, point, a.room)) if a.json else "\n".join(frame(view, a)), flush=True)
    return 0


def live(view: top.Top, a, out=sys.stdout) -> int:
    """Scrape every ``--interval`` seconds and redraw until Ctrl-C.  In a terminal the view is redrawn in place on
    the alternate screen, and its last frame stays printed after; piped, each frame (or JSON line) follows the last.
    A server that stops answering is a gap and a sentence, and the view goes on: a restart shows as one."""
    tty = out.isatty() and not a.json
    view.sample()  # the first scrape says at once what is wrong (key, URL, a server that is not there)
    lines: list[str] = []
    if tty:
        out.write(ENTER)
    tick = time.monotonic()
    try:
        while True:
            point = view.history.latest
            if a.json:
                out.write(json.dumps(as_json(view, point, a.room)) + "\n")
            else:
                lines = frame(view, a)
                out.write(HOME + "".join(f"{line}{CLEAR_LINE}\n" for line in lines) + CLEAR_BELOW if tty
                          else "\n".join(lines) + "\n\n")
            out.flush()
            tick += a.interval
            time.sleep(max(0.0, tick - time.monotonic()))
            view.sample(tolerate_down=True)
    except KeyboardInterrupt:
        return 0
    finally:
        if tty:
            out.write(LEAVE + "\n".join(lines) + "\n")
            out.flush()


def cmd_top(a) -> int:
    if a.interval <= 0 or a.samples < 1:
        raise SystemExit("llmlab top: --interval must be above 0 seconds and --samples at least 1.")
    view = top.Top(server(a.job), size=a.samples)
    return once(view, a) if a.once else live(view, a)


def add_commands(sub) -> None:
    p = sub.add_parser("top", help="a live view of one server: requests, KV cache, tokens/s, preemptions, prefix "
                                   "hits over time, from its /metrics")
    p.add_argument("job", nargs="?", help="a SLURM job id (default: the embedded server)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two scrapes (default 1)")
    p.add_argument("--samples", type=int, default=40, help="how many samples the sparklines show (default 40)")
    p.add_argument("--once", action="store_true", help="two scrapes --interval apart, print once, exit")
    p.add_argument("--json", action="store_true", help="JSON: one object with --once, else one line per scrape")
    p.add_argument("--room", metavar="DIR", help="instructor: the `llmlab progress --room DIR` table beside it")
    p.set_defaults(func=cmd_top)
