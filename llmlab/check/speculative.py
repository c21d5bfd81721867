"""Checks of notebook 12, speculative decoding (``llmlab.speculative``): rates from the server's counters, and
the tokens per step the textbook formula predicts."""

from __future__ import annotations

import math

from llmlab.check.verdict import _number, _whole, require, right


def spec_rates(acceptance, per_step, before: dict, after: dict) -> None:
    """12: acceptance rate and tokens per model step, computed from two ``speculative.scrape`` snapshots."""
    from llmlab.speculative import spec_delta

    acceptance, per_step = _number(acceptance, "acceptance"), _number(per_step, "per_step")
    d = spec_delta(before, after)
    require(d["drafts"] > 0, "the drafting server counted no drafts between your two scrapes: send the requests "
            "to spec_client after `before` and scrape `after` once they have finished.")
    require(not math.isclose(acceptance, d["mean_accepted"]) or math.isclose(d["mean_accepted"], d["acceptance_rate"]),
            "that is the accepted tokens per draft (0 to k); the rate divides the accepted tokens by the drafted "
            "tokens (k per draft).")
    require(math.isclose(acceptance, d["acceptance_rate"], rel_tol=1e-6),
            f"acceptance should be accepted / draft_tokens = {d['accepted']:.0f} / {d['draft_tokens']:.0f}.")
    require(not math.isclose(per_step, 1 + d["mean_accepted"]) or math.isclose(per_step, d["tokens_per_step"]),
            "1 + accepted per draft counts only the steps that drafted; count every pass of the model: each "
            "yields one token of its own, so there were generated - accepted of them.")
    require(math.isclose(per_step, d["tokens_per_step"], rel_tol=1e-6),
            "tokens per step is generated / (generated - accepted): every pass yields one token of the model's "
            "own plus the draft tokens it accepted.")
    right(f"{acceptance:.2f} of the drafted tokens accepted, {per_step:.2f} tokens per pass of the model.")


def draft_length(per_step, enough_k) -> None:
    """12: tokens per step for k = 1..8 at alpha = 0.6, and the smallest k within 5 % of k = 8."""
    from llmlab.speculative import expected_tokens_per_step

    alpha = 0.6
    want = [expected_tokens_per_step(alpha, k) for k in range(1, 9)]
    require(isinstance(per_step, list | tuple) and len(per_step) == 8,
            "per_step should be a list of 8 numbers, for k = 1, 2, ..., 8.")
    got = [_number(v, "each entry of per_step") for v in per_step]
    require(not all(math.isclose(g, alpha ** k) for g, k in zip(got, range(1, 9), strict=True)),
            "alpha ** k is the chance that the whole draft is accepted; a step yields 1 + alpha + ... + alpha ** k "
            "tokens on average.")
    require(not all(math.isclose(g, w - 1) for g, w in zip(got, want, strict=True)),
            "that counts the accepted draft tokens only: every step also yields one token of the model's own.")
    wrong = next((k for k, (g, w) in enumerate(zip(got, want, strict=True), 1) if not math.isclose(g, w, rel_tol=1e-4)),
                 None)
    require(wrong is None, f"for k = {wrong} expect 1 + 0.6 + ... + 0.6 ** {wrong} = (1 - 0.6 ** {(wrong or 0) + 1}) / "
            "(1 - 0.6).")
    best = next(k for k, w in enumerate(want, 1) if w >= 0.95 * want[-1])
    enough_k = _whole(enough_k, "enough_k")
    require(1 <= enough_k <= 8, "enough_k is a draft length, one of 1 to 8.")
    require(enough_k >= best, f"k = {enough_k} gives {want[enough_k - 1]:.3f}, less than 0.95 x {want[-1]:.3f}: "
            "a longer draft is needed.")
    require(enough_k == best, f"k = {best} already gives at least 0.95 x {want[-1]:.3f}: the smallest such k.")
    right(f"k = {best} already gives {want[best - 1]:.2f} of the {want[-1]:.2f} tokens per step that k = 8 would: "
          "longer drafts add rejected tokens, not speed.")
