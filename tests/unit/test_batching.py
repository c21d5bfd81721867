"""Continuous batching and the scheduler (notebook 16, ``llmlab.batching``): the arithmetic of static and continuous
batching and of a KV pool's fit, the counters read from a recorded ``/metrics`` text, a run's mean batch (Little's
law), and the exercise checks, each with the right answer and the wrong ones they name.

This file holds the pure tests (no engine, no SLURM, no root, no browser); tests/engine/test_batching.py sends
the two ways of batching to the real engine, and lesson 16's cells assert its small engine (the running batch against
``--max-num-seqs``, preemptions on a tiny KV pool).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from check_helpers import not_yet, right

from llmlab import batching, check
from llmlab.loadtest import LoadResult, Record
from llmlab.serve.metrics import Histogram, parse_prometheus, read_counters

RECORDED = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.32.0" / "metrics.txt").read_text()


# --- the arithmetic -----------------------------------------------------------------------------------------------

def test_static_batching_costs_the_longest_of_each_batch():
    assert batching.static_steps([10, 100, 20, 30], 2) == 100 + 30
    assert batching.static_steps([100, 30, 20, 10], 2) == 100 + 20  # the long ones together
    assert batching.static_steps([5, 7, 9], 5) == 9                 # one partial batch
    assert batching.static_steps([5, 7, 9], 1) == 21                # one at a time: the sum


def test_continuous_batching_refills_a_place_as_soon_as_it_frees():
    # 2 places: 10 and 100 start; at 10 the 20 takes the first place (ends 30), then 30 (ends 60): the 100 ends last
    assert batching.continuous_steps([10, 100, 20, 30], 2) == 100
    assert batching.continuous_steps([100, 10, 10, 10], 2) == 100
    assert batching.continuous_steps([5, 7, 9], 5) == 9
    assert batching.continuous_steps([5, 7, 9], 1) == 21
    lengths = [40, 300, 25, 60, 280, 35, 50, 45, 310, 30, 55, 40, 290, 20]
    # never fewer steps than the longest request or than the work spread over every place
    assert batching.continuous_steps(lengths, 4) >= max(max(lengths), -(-sum(lengths) // 4))
    assert batching.continuous_steps(lengths, 4) <= batching.static_steps(lengths, 4)


@pytest.mark.parametrize("bad", [[], [0], [3, -1], [2.5], [True]])
def test_lengths_must_be_whole_token_counts(bad):
    with pytest.raises(ValueError, match="whole number"):
        batching.static_steps(bad, 2)
    with pytest.raises(ValueError, match="whole number"):
        batching.continuous_steps(bad, 2)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_the_batch_must_be_a_whole_number(n):
    with pytest.raises(ValueError, match="n="):
        batching.static_steps([3], n)


def test_a_request_holds_its_prompt_and_all_but_its_last_answer_token():
    assert batching.blocks_at_longest(61, 300, 128) == 3       # 360 tokens
    assert batching.blocks_at_longest(64, 65, 128) == 1        # 128 tokens: exactly one block
    assert batching.blocks_at_longest(64, 66, 128) == 2
    with pytest.raises(ValueError, match="at least one"):
        batching.blocks_at_longest(0, 5, 16)


def test_one_block_of_the_pool_is_the_null_block():
    assert batching.fit_without_preemption(12, 128, 61, 300) == 3      # 11 usable blocks, 3 each
    assert batching.fit_without_preemption(12, 128, 61, 400) == 2      # 4 each: 12 // 4 would say 3
    assert batching.fit_without_preemption(28_123, 16, 1_030, 100) == 396
    with pytest.raises(ValueError, match="at least 2"):
        batching.fit_without_preemption(1, 16, 10, 10)


# --- the lesson's workloads ---------------------------------------------------------------------------------------

def test_the_lessons_workloads_are_the_ones_its_text_describes():
    """Notebook 16 and benchmarks/continuous_batching.py send these requests; the lesson quotes their sizes and the
    fewest steps of section 2, so a changed draw would change its figures."""
    jobs, arrivals = batching.arriving_requests()
    lengths = [j.max_tokens for j in jobs]
    assert len(jobs) == len(arrivals) == 16 and arrivals == sorted(arrivals) and 1 < arrivals[-1] < 2
    assert all(16 <= m <= 192 for m in lengths) and sum(lengths) == 1_831
    assert batching.arriving_requests() == (jobs, arrivals)  # the same requests every time
    mixed = [j.max_tokens for j in batching.short_and_long_requests()]
    assert sorted(mixed)[:18][-1] <= 32 and 160 <= sorted(mixed)[18] and max(mixed) <= 240 and len(mixed) == 24
    assert batching.static_steps(mixed, 6) == 534 and batching.continuous_steps(mixed, 6) == 283
    burst, long = batching.burst_requests(), batching.long_requests()
    assert [(j.input_len, j.max_tokens) for j in burst] == [(64, 32)] * 24
    assert [(j.input_len, j.max_tokens) for j in long] == [(60, 300)] * 6


# --- the counters, from a recorded scrape -------------------------------------------------------------------------

def test_the_counters_come_from_vllms_own_metric_names():
    """The recorded scrape (vLLM 0.32, after one request: 6 prompt and 8 generated tokens) has every metric the
    lesson reads; a renamed one would read as 0 steps."""
    now = read_counters(parse_prometheus(RECORDED))
    assert now.steps >= 1 and now.step_tokens == 6 + 8 and now.generated == 8
    assert now.finished == 1 and now.preemptions == 0 and now.preempted_again == 0
    grew = now - batching.Counters()
    assert (grew.steps, grew.step_tokens, grew.generated, grew.finished) == (now.steps, 14, 8, 1)


def test_the_requests_preempted_more_than_once_come_from_the_per_request_histogram():
    """vLLM observes each finished request's preemptions; its lowest bucket is le="1.0" (never or once), so the
    requests above it were preempted more than once: here 1 of 6, the 3 preemptions on 2 requests at most."""
    lines = [line for line in RECORDED.splitlines() if not line.startswith("vllm:request_num_preemptions")]
    edges = ("1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf")
    lines += [f'vllm:request_num_preemptions_bucket{{engine="0",le="{le}",model_name="m"}} '
              f'{5.0 if le == "1.0" else 6.0}' for le in edges]
    lines += ['vllm:request_num_preemptions_count{engine="0",model_name="m"} 6.0',
              'vllm:request_num_preemptions_sum{engine="0",model_name="m"} 3.0']
    assert read_counters(parse_prometheus("\n".join(lines) + "\n")).preempted_again == 1


# --- a run's mean batch -------------------------------------------------------------------------------------------

def records(*spans) -> LoadResult:
    return LoadResult([Record(id=i, status="ok", start=s, end=e, ttft=0.1, output_tokens=4)
                       for i, (s, e) in enumerate(spans)], concurrency=2)


def test_littles_law_is_the_time_in_the_server_over_the_wall_time():
    run = records((0.0, 2.0), (0.0, 1.0), (1.0, 2.0))
    assert batching.in_flight(run) == pytest.approx(4.0 / 2.0)
    with pytest.raises(ValueError, match="nothing was in flight"):
        batching.in_flight(LoadResult([], concurrency=1))


# --- the checks, with the right answer and the wrong ones they name ----------------------------------------------

def test_best_static_steps(capsys):
    lengths = check.batching.EX1_LENGTHS
    best, cont = batching.static_steps(sorted(lengths, reverse=True), 4), batching.continuous_steps(lengths, 4)
    assert (best, cont) == (435, 535)
    assert "static in the best order: 435 steps" in right(capsys, check.best_static_steps, best, cont)
    not_yet(check.best_static_steps, 1180, cont, hint="is the order given")
    not_yet(check.best_static_steps, 685, cont, hint="from the shortest up the last batch is a partial one")
    not_yet(check.best_static_steps, sum(lengths), cont, hint="not the sum of its requests")
    not_yet(check.best_static_steps, 440, cont, hint="sort the 14 lengths from the longest down")
    not_yet(check.best_static_steps, best, 395, hint="as if every place were always busy")
    not_yet(check.best_static_steps, best, 500, hint="batching.continuous_steps does exactly that")
    not_yet(check.best_static_steps, best, 535.5, hint="whole number")


def test_busy_share(capsys):
    """Exercise 2: 720 request-steps over 280 steps of 4 places static (batches of 4 in the order given), 208
    continuous."""
    assert batching.static_steps(check.batching.EX2_LENGTHS, 4) == 280
    assert batching.continuous_steps(check.batching.EX2_LENGTHS, 4) == 208
    out = right(capsys, check.busy_share, 720 / 280 / 4, 720 / 208 / 4)
    assert "64% of the 4 places" in out and "continuous 87%" in out
    right(capsys, check.busy_share, 0.643, 0.865)  # rounded as a learner may round
    for static, continuous, hint in (
            (720 / 280, 720 / 208 / 4, "static: that is how many places are busy on average"),
            (720 / 280 / 4, 720 / 208, "continuous: that is how many places"),
            (1.0, 720 / 208 / 4, "static: every place busy in every step"),
            (720 / 280 / 4, 1.2, "continuous: a share of the 4 places is at most 1"),
            (60 / 4, 720 / 208 / 4, "static: a share of the 4 places is at most 1"),
            (720 / 208 / 4, 720 / 280 / 4, "swapped"),
            (720 / 216 / 4, 720 / 208 / 4, "the best order"),
            ((160 / 96 + 304 / 104 + 256 / 80) / 3 / 4, 720 / 208 / 4, "each batch's own share"),
            (0.7, 720 / 208 / 4, "static: the requests take part"),
            (720 / 280 / 4, 0.8, "continuous: the same steps of work")):
        not_yet(check.busy_share, static, continuous, hint=hint)
    not_yet(check.busy_share, "0.64", 0.865, hint="should be a number")


def test_requests_before_preemption(capsys):
    assert "396 requests hold 28,116" in right(capsys, check.requests_before_preemption, 396)
    not_yet(check.requests_before_preemption, 398, hint="divides tokens by tokens")
    not_yet(check.requests_before_preemption, 400, hint="rounded down")
    not_yet(check.requests_before_preemption, 396.5, hint="whole number")


def test_recomputed_tokens(capsys):
    assert "1,089 tokens computed twice" in right(capsys, check.recomputed_tokens, 1_089)
    not_yet(check.recomputed_tokens, 1_030, hint="num_computed_tokens to 0")
    not_yet(check.recomputed_tokens, 60, hint="the prompt's blocks were freed as well")
    not_yet(check.recomputed_tokens, 1_090, hint="never fed back")
    not_yet(check.recomputed_tokens, 1_000, hint="all but the last answer token")


# --- reading a run: the table and the picture, from made-up records and scrapes ----------------------------------

def made_up_run(preemptions: int = 0, every: float | None = 0.1) -> batching.Measured:
    from llmlab import top

    result = records((10.0, 11.0), (10.2, 12.0), (10.4, 11.5))
    sampler = SimpleNamespace(points=[top.Point(t=10.0 + i / 10, running=min(i, 3), waiting=max(0, 2 - i))
                                      for i in range(20)], every=every)
    sampler.peak = lambda name: int(max(getattr(p, name) for p in sampler.points))
    steps = Histogram({1.0: 10.0, 8.0: 40.0, math.inf: 40.0}, 100.0, 40.0)  # 40 steps of 100 tokens in all
    delta = batching.Counters(step_sizes=steps, preemptions=preemptions, generated=12, finished=3)
    return batching.Measured(result, result.summary(), delta, sampler, alone=True)


def test_the_table_has_one_row_per_run_with_the_engines_steps_and_the_peaks():
    table = batching.compare_table({"a": made_up_run(), "b": made_up_run(preemptions=2)})
    assert list(table.index) == ["a", "b"]
    assert table.loc["a", "engine steps"] == 40 and table.loc["a", "tokens/step"] == 2.5
    assert table.loc["a", "peak running"] == 3 and table.loc["a", "peak waiting"] == 2
    assert table.loc["b", "preemptions"] == 2 and table.loc["a", "wall (s)"] == 2.0
    assert table["TPOT p50 (ms)"].isna().all()  # answers of one timed token each: no TPOT, a gap not a crash


def test_a_run_measured_unwatched_has_no_peaks_rather_than_the_two_edge_scrapes():
    table = batching.compare_table({"unwatched": made_up_run(every=None)})
    assert table[["peak running", "peak waiting"]].isna().all(axis=None)
    assert table.loc["unwatched", "engine steps"] == 40  # the counters, read before and after, are all there


def test_the_timeline_draws_a_bar_pair_per_request_and_the_two_gauges():
    import matplotlib

    matplotlib.use("Agg")
    bars, gauges = batching.plot_timeline(made_up_run())
    assert len(bars.patches) == 2 * 3  # waiting-and-prefill, then decoding, for each of the 3 requests
    assert [line.get_label() for line in gauges.get_lines()] == ["running", "waiting"]
    assert gauges.get_lines()[0].get_xdata()[0] == pytest.approx(0.0)  # seconds since the first request was sent
