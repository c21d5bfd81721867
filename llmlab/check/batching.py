"""Checks of notebook 16, continuous batching and the scheduler (``llmlab.batching``): static batching in its best
order against continuous batching, the share of the batch each way keeps busy (Little's law in steps), the requests
an H100's KV cache holds before preemption, and the tokens a preemption makes the engine compute again."""

from __future__ import annotations

import math

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: fourteen requests' output tokens, in the order they come; batches (and places in flight) of 4.
EX1_LENGTHS = [40, 300, 25, 60, 280, 35, 50, 45, 310, 30, 55, 40, 290, 20]
EX1_N = 4

# Exercise 2: twelve requests' output tokens, in the order they come; batches (and places in flight) of 4.
EX2_LENGTHS = [40, 16, 96, 24, 64, 104, 32, 88, 56, 48, 80, 72]
EX2_N = 4

# Exercise 3: Llama 3.1 8B on one H100, the KV pool of the committed rehearsal
# (benchmarks/results/h100-llama3.1-8b-tp1/: 28,123 blocks of 16 tokens); requests of 1,030 + 100 tokens.
EX3_BLOCKS, EX3_BLOCK, EX3_PROMPT, EX3_ANSWER = 28_123, 16, 1_030, 100

# Exercise 4: a request of 1,030 prompt tokens preempted after it generated 60 tokens.
EX4_PROMPT, EX4_GENERATED = 1_030, 60


def best_static_steps(static, continuous) -> None:
    """16: the fewest steps static batching can take for Exercise 1's requests in batches of 4, in the best order
    of the client's choosing, and the fewest continuous batching takes with 4 in flight, in the order given."""
    from llmlab.batching import continuous_steps, static_steps

    static, continuous = _whole(static, "static"), _whole(continuous, "continuous")
    lengths, n = EX1_LENGTHS, EX1_N
    best = static_steps(sorted(lengths, reverse=True), n)
    want_continuous = continuous_steps(lengths, n)
    require(static != static_steps(lengths, n), f"static: {static} steps is the order given; the client may send the "
            "requests in any order it likes. Which requests should share a batch?")
    require(static != static_steps(sorted(lengths), n),
            "static: sorted, yes, but from the shortest up the last batch is a partial one of the two longest. Each "
            "batch costs its longest request: put the longest together, and the partial batch among the shortest.")
    require(static != sum(lengths), "static: that is every request's tokens one after another; a batch of 4 takes "
            "as many steps as its longest request, not the sum of its requests.")
    require(static == best, f"static: sort the {len(lengths)} lengths from the longest down and cut them into "
            f"batches of {n}: each batch takes as many steps as its first (longest) request.")
    require(continuous != math.ceil(sum(lengths) / n) or continuous == want_continuous,
            f"continuous: {continuous} is the total over {n}, as if every place were always busy; simulate it "
            "(batching.continuous_steps): the last long request starts late and runs on while places stand empty.")
    require(continuous == want_continuous, f"continuous: {n} places, each request (in the order given) takes the "
            "first place that frees up and holds it for as many steps as its tokens; the run ends when the last "
            "place frees. batching.continuous_steps does exactly that.")
    right(f"static in the best order: {best} steps, continuous in the order given: {want_continuous}, static in "
          f"the order given: {static_steps(lengths, n)}. Sorting needs every length in advance, which a client "
          "rarely has and a server never (an answer's length is known when it ends).")


def busy_share(static, continuous) -> None:
    """16: the share of the 4 places in the running batch that Exercise 2's twelve requests keep busy on average
    over the run, in static batches of 4 and with 4 in flight, counted in steps (Little's law without a clock)."""
    from llmlab.batching import continuous_steps, static_steps

    static, continuous = _number(static, "static"), _number(continuous, "continuous")
    lengths, n = EX2_LENGTHS, EX2_N
    work = sum(lengths)  # request-steps: a request of m tokens takes part in m steps
    mean_s, mean_c = work / static_steps(lengths, n), work / continuous_steps(lengths, n)
    want_s, want_c = mean_s / n, mean_c / n
    batches = [lengths[i:i + n] for i in range(0, len(lengths), n)]

    def near(value, target):
        return math.isclose(value, target, rel_tol=5e-3)

    for name, value, mean in (("static", static, mean_s), ("continuous", continuous, mean_c)):
        require(not near(value, mean), f"{name}: that is how many places are busy on average; the question asks "
                f"for their share of the {n} places.")
        require(not near(value, 1.0), f"{name}: every place busy in every step is the most "
                "it can be; places stand empty while the last requests of a batch (or of the run) finish.")
        require(value <= 1.0, f"{name}: a share of the {n} places is at most 1 (every place busy).")
    require(not (near(static, want_c) and near(continuous, want_s)), "the two are swapped: which way leaves places "
            "empty until the longest request of a batch ends?")
    require(not near(static, work / static_steps(sorted(lengths, reverse=True), n) / n),
            "static: that is the best order (the longest together); the client sends them in the order given.")
    require(not near(static, sum(sum(b) / max(b) for b in batches) / len(batches) / n),
            "static: each batch's own share counts there as much as the others, but a batch lasts as long as its "
            "longest request: add up the steps the requests took part in, then divide by all the run's steps.")
    require(near(static, want_s), f"static: the requests take part in as many steps as their tokens, together; the "
            f"run takes as many steps as static batching needs for them in this order (batching.static_steps), "
            f"with {n} places in each.")
    require(near(continuous, want_c), "continuous: the same steps of work, over the steps continuous batching takes "
            "with 4 in flight in this order (batching.continuous_steps), 4 places in each.")
    right(f"static batching kept {want_s:.0%} of the {n} places busy ({work} request-steps over "
          f"{static_steps(lengths, n)} steps of {n}), continuous {want_c:.0%} ({continuous_steps(lengths, n)} "
          "steps). Little's law: the mean in the system is the work over the time it takes; the same work in "
          "fewer steps is a fuller batch, and everyone is served sooner.")


def requests_before_preemption(n) -> None:
    """16: how many requests of 1,030 prompt + 100 answer tokens Llama 3.1 8B's KV pool on one H100 (28,123 blocks
    of 16) holds at their longest, all at once."""
    from llmlab.batching import blocks_at_longest, fit_without_preemption

    n = _whole(n, "n")
    held = blocks_at_longest(EX3_PROMPT, EX3_ANSWER, EX3_BLOCK)
    want = fit_without_preemption(EX3_BLOCKS, EX3_BLOCK, EX3_PROMPT, EX3_ANSWER)
    tokens = EX3_PROMPT + EX3_ANSWER
    require(n != EX3_BLOCKS * EX3_BLOCK // tokens and n != EX3_BLOCKS * EX3_BLOCK // (tokens - 1),
            f"that divides tokens by tokens; the pool is handed out in whole blocks of {EX3_BLOCK}: how many blocks "
            "does one request hold at its longest?")
    require(n != EX3_BLOCKS // held or n == want, "one block of the pool is vLLM's null block, never handed out.")
    require(n == want, f"one request holds blocks_for({EX3_PROMPT} + {EX3_ANSWER} - 1, {EX3_BLOCK}) = {held} blocks "
            f"at its longest (its last answer token is never fed back); {EX3_BLOCKS:,} - 1 blocks hold that many "
            "such requests, rounded down.")
    right(f"{want} requests hold {want * held:,} of the {EX3_BLOCKS - 1:,} usable blocks; a {want + 1}th running at "
          "once means a preemption before they all end (the server's cap on an H100 is 1,024).")


def recomputed_tokens(n) -> None:
    """16: the tokens a request preempted after 60 answer tokens (prompt 1,030) had computed before and computes
    again when it resumes, none of its blocks left in the prefix cache."""
    n = _whole(n, "n")
    before = EX4_PROMPT + EX4_GENERATED - 1
    require(n != EX4_PROMPT, "its prompt, yes, and the answer tokens' keys and values were in the freed blocks too: "
            "vLLM sets num_computed_tokens to 0.")
    require(n != EX4_GENERATED, "the answer tokens, yes, but the prompt's blocks were freed as well.")
    require(n != EX4_PROMPT + EX4_GENERATED,
            "nearly: the last of the 60 answer tokens was sampled but never fed back, so its keys and values were "
            "never computed; the resumed prefill computes it for the first time.")
    require(n == before, "everything the request had computed: the prompt and all but the last answer token.")
    right(f"{before:,} tokens computed twice (the resumed prefill schedules {before + 1:,}: the last answer token's "
          "for the first time); with an 8B model about 2 x 8e9 x that FLOP thrown away, each time.")
