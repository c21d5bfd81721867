"""``llmlab top``'s logic on recorded ``/metrics`` texts: readings, rates from counter differences, a restart that is
not a negative rate, sparklines, the text panel, the JSON of ``--once``, the widget's picture.  The live engine's
lines moving under a load are tests/engine/test_top.py."""

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmlab import top
from llmlab.ops import cli_top
from llmlab.serve.info import AuthenticationFailed, ServerUnavailable
from llmlab.serve.metrics import parse_prometheus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
RECORDED = (FIXTURES / "0.32.0" / "metrics.txt").read_text()  # after one request: 6 prompt, 8 generated tokens


def edited(text: str = RECORDED, **values: float) -> str:
    """The recorded scrape with some samples set to new values (``vllm_generation_tokens_total=208`` sets
    ``vllm:generation_tokens_total{...}``; a metric with several label sets gets the value on its first line)."""
    for name, value in values.items():
        metric = name.replace("vllm_", "vllm:", 1)
        text, n = re.subn(rf"^({re.escape(metric)}(?:\{{[^}}]*\}})?) \S+$", rf"\g<1> {value}", text, count=1,
                          flags=re.M)
        assert n == 1, metric
    return text


def reading(t: float, text: str = RECORDED) -> top.Reading:
    return top.read(parse_prometheus(text), t)


@pytest.mark.parametrize("version", sorted(p.name for p in FIXTURES.iterdir() if (p / "metrics.txt").exists()))
def test_every_followed_metric_is_exported_by_every_tested_vllm(version):
    """A renamed metric would otherwise be a flat zero line (``read`` defaults a missing one to 0)."""
    m = parse_prometheus((FIXTURES / version / "metrics.txt").read_text())
    missing = [name for name in [*top.GAUGES.values(), *top.COUNTERS.values(), top.STARTED] if name not in m]
    assert not missing, f"vLLM {version} lacks {missing}"


def test_a_reading_holds_the_recorded_gauges_and_counters():
    c = reading(100.0).counters
    assert (c.running, c.waiting, c.kv_usage) == (0.0, 0.0, 0.0)
    assert {name: getattr(c, f) for name, f in top.FIELDS.items()} == {
        "prompt_tokens": 6, "generation_tokens": 8, "preemptions": 0, "prefix_queries": 6, "prefix_hits": 0,
        "finished": 1}
    assert c.started == pytest.approx(1795435559.72)


def test_rates_are_counter_differences_over_the_time_between_the_scrapes():
    busy = edited(vllm_generation_tokens_total=208, vllm_prompt_tokens_total=66, vllm_prefix_cache_queries_total=66,
                  vllm_prefix_cache_hits_total=45, vllm_num_preemptions_total=1, vllm_num_requests_running=4,
                  vllm_num_requests_waiting=2, vllm_kv_cache_usage_perc=0.25)
    first = top.step(None, reading(100.0))
    assert first.generation_tokens_per_s is None and first.prefix_hit_rate is None  # a rate needs two readings
    p = top.step(reading(100.0), reading(102.0, busy))
    assert (p.running, p.waiting, p.kv_usage) == (4, 2, 0.25)
    assert p.generation_tokens_per_s == 100.0 and p.prompt_tokens_per_s == 30.0 and p.preemptions_per_s == 0.5
    assert p.prefix_hit_rate == 0.75 and not p.restarted      # 45 of the 60 tokens looked up in these 2 s
    idle = top.step(reading(102.0, busy), reading(104.0, busy))
    assert idle.generation_tokens_per_s == 0 and idle.prefix_hit_rate is None  # nothing looked up: no rate


def test_a_restart_is_never_a_negative_rate():
    """The server restarted between two scrapes: its counters began again at zero.  The increase is the new value
    (Prometheus' rule), seen from a counter that went down, or from a new process start time alone."""
    before = reading(100.0, edited(vllm_generation_tokens_total=5000, vllm_prompt_tokens_total=900))
    after = reading(110.0)  # the recorded scrape: 8 generated, 6 prompt tokens
    p = top.step(before, after)
    assert p.restarted and p.generation_tokens_per_s == 0.8 and p.prompt_tokens_per_s == 0.6
    # counters higher than before, but a new process: still a restart, and still only the new process's tokens
    reborn = reading(110.0, edited(vllm_generation_tokens_total=9000, process_start_time_seconds=1795436000.0))
    p = top.step(reading(100.0, edited(vllm_generation_tokens_total=5000)), reborn)
    assert p.restarted and p.generation_tokens_per_s == 900.0


def test_a_clock_that_did_not_move_gives_no_rate():
    p = top.step(reading(100.0), reading(100.0, edited(vllm_generation_tokens_total=99)))
    assert p.generation_tokens_per_s is None


@pytest.mark.parametrize("values, kw, line", [
    ([0, 1, 2, 4, 8], {}, "▁▂▃▅█"),
    ([0, 0.001, 8], {}, "▁▂█"),                 # a trickle is not idle
    ([0.5, 1.0, None, 0.0], {"top": 1.0}, "▅█ ▁"),  # a share on a fixed scale; None (down, no rate) is a gap
    ([3, 3], {"width": 5}, "   ██"),          # the newest at the right edge
    ([1, 2, 3, 4, 5, 6], {"width": 3}, "▆▇█"),  # only the last width values, scaled to those shown
    ([0, 0], {}, "▁▁"), ([], {"width": 2}, "  "),
])
def test_sparkline(values, kw, line):
    assert top.sparkline(values, **kw) == line


class Recorded:
    """A server that answers with the given scrapes in turn (an exception is raised instead of answered)."""

    url, key, label = "http://127.0.0.1:9/v1", "s3cret-key", "a recorded server"

    def __init__(self, *answers):
        self.answers = list(answers)

    def scrape(self, timeout):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return parse_prometheus(answer)


def clock(*times):
    it = iter(times)
    return lambda: next(it)


def test_a_server_that_goes_down_is_a_gap_with_its_sentence_and_its_return_a_restart():
    down = ServerUnavailable("No server answers at http://127.0.0.1:9/metrics (refused): is it running?")
    view = top.Top(Recorded(edited(vllm_generation_tokens_total=500), down, RECORDED), size=5,
                   clock=clock(100.0, 101.0, 102.0))
    view.sample()
    gap = view.sample(tolerate_down=True)
    assert gap.down.startswith("No server answers") and gap.running is None
    assert "server down: No server answers" in "\n".join(view.panel())
    back = view.sample(tolerate_down=True)
    assert back.restarted and back.generation_tokens_per_s == 4.0  # 8 tokens over the 2 s since the last reading
    text = "\n".join(view.panel(width=3))
    assert "the server restarted" in text and "s3cret" not in text
    assert top.sparkline(view.history.series("running"), 3) == "▁ ▁"


def test_down_is_raised_unless_tolerated_and_a_wrong_key_always():
    with pytest.raises(ServerUnavailable):
        top.Top(Recorded(ServerUnavailable("down"))).sample()
    with pytest.raises(AuthenticationFailed):
        top.Top(Recorded(AuthenticationFailed("refused the API key"))).sample(tolerate_down=True)


def test_the_history_keeps_the_last_samples():
    h = top.History(size=3)
    for t in range(5):
        h.add(reading(float(t)))
    assert [p.t for p in h.points] == [2.0, 3.0, 4.0] and h.latest.t == 4.0


def test_the_panel_shows_every_series_now_and_over_time():
    h = top.History(10)
    h.add(reading(100.0))
    h.add(reading(102.0, edited(vllm_generation_tokens_total=208, vllm_num_requests_running=3,
                                vllm_kv_cache_usage_perc=0.125)))
    lines = top.panel(h, "llmlab top: test", width=4, interval=2)
    text = "\n".join(lines)
    assert lines[0].startswith("llmlab top: test") and "every 2 s" in lines[0]
    row = {line.split()[0]: line for line in lines[2:]}
    assert row["running"].split()[1] == "3" and row["running"].endswith("  ▁█")
    assert "12.5 %" in row["KV"] and "100.0 tok/s" in row["generation"] and row["prefix"].split()[2] == "-"
    assert "1 requests, 6 prompt and 208 generated tokens, 0 preemptions" in text


def test_once_prints_json_with_rates_and_never_the_key(capsys):
    view = top.Top(Recorded(RECORDED, edited(vllm_generation_tokens_total=58)), clock=clock(100.0, 101.0))
    args = SimpleNamespace(interval=0.01, json=True, room=None, samples=10)
    assert cli_top.once(view, args) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["generation_tokens_per_s"] == 50.0 and data["running"] == 0 and data["server"] == "a recorded server"
    assert data["totals"]["generation_tokens"] == 58 and "s3cret" not in out
    assert "s3cret" not in repr(top.Target("http://x/v1", "s3cret-key", "x"))


def test_live_redraws_in_place_until_ctrl_c(monkeypatch):
    """In a terminal: the alternate screen, each frame from the top-left corner, the last frame left printed."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    view = top.Top(Recorded(RECORDED, RECORDED, RECORDED))
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli_top.time, "sleep", sleep)
    out = Tty()
    assert cli_top.live(view, SimpleNamespace(interval=0.5, json=False, room=None, samples=8), out) == 0
    text = out.getvalue()
    assert text.startswith(cli_top.ENTER) and text.count(cli_top.HOME) == 2 and cli_top.LEAVE in text
    assert text.rstrip().endswith("generated tokens, 0 preemptions")


def test_the_room_goes_beside_the_server_when_the_terminal_is_wide_enough():
    left, right = ["server a", "server bb"], ["room 1", "room 2", "room 3"]
    assert cli_top.beside(left, right, 80) == ["server a     room 1", "server bb    room 2", "             room 3"]
    assert cli_top.beside(left, right, 15) == [*left, "", *right]
    assert cli_top.beside(left, [], 80) == left


def test_no_embedded_server_is_one_sentence():
    with pytest.raises(ServerUnavailable, match="embedded server is not running.*llmlab serve --background"):
        cli_top.server(None)


def test_a_loading_embedded_server_is_one_sentence_with_its_phase():
    from llmlab.serve.embedded import state_file
    from llmlab.serve.info import ServerInfo

    ServerInfo(kind="embedded", host="127.0.0.1", port=1, model="m", api_key_file="/nonexistent", status="loading",
               extra={"phase": "loading weights"}).write(state_file())
    try:
        with pytest.raises(ServerUnavailable, match=r"still loading \(loading weights\).*llmlab serve --status"):
            cli_top.server(None)
    finally:
        state_file().unlink()


def test_the_widget_draws_the_history_without_pyplot():
    view = top.Widget(top.Top(Recorded(RECORDED, edited(vllm_generation_tokens_total=108)), clock=clock(1.0, 2.0)))
    view.refresh()
    point = view.refresh()
    assert bytes(view.image.value).startswith(b"\x89PNG") and point.generation_tokens_per_s == 100.0
    assert "100.0 generated tokens/s" in view.status.value
    assert len(top.plot(view.top.history).axes) == 5


def test_room_puts_the_progress_table_beside_the_view_and_in_the_json(tmp_path, capsys):
    args = SimpleNamespace(interval=0.01, json=False, room=str(tmp_path), samples=10)
    view = top.Top(Recorded(RECORDED, RECORDED), clock=clock(1.0, 2.0))
    assert cli_top.once(view, args) == 0
    text = capsys.readouterr().out
    assert f"the room ({tmp_path}):" in text and "nobody has handed in yet" in text and "running" in text
    view = top.Top(Recorded(RECORDED, RECORDED), clock=clock(1.0, 2.0))
    assert cli_top.once(view, SimpleNamespace(**{**vars(args), "json": True})) == 0
    assert json.loads(capsys.readouterr().out)["room"] == []


def test_the_widget_refreshes_from_a_thread_and_a_wrong_key_stops_it_with_its_sentence():
    refused = AuthenticationFailed("http://127.0.0.1:9/metrics refused the API key (401)")
    view = top.Widget(top.Top(Recorded(RECORDED, RECORDED, RECORDED, refused)), interval=0.02)
    view.refresh(tolerate_down=False)
    view.start()
    view._thread.join(timeout=10)
    assert not view._thread.is_alive() and view.button.value is False and view.button.icon == "play"
    assert view.status.value.startswith("<b>stopped</b>") and "refused the API key" in view.status.value
    assert len(view.top.history.points) == 3
