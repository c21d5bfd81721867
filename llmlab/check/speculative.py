"""Checks of notebook 12, speculative decoding (``llmlab.speculative``): what drafting saved and wasted, from the
server's counters, and the tokens per step the textbook formula predicts."""

from __future__ import annotations

import math

from llmlab.check.verdict import _number, _whole, require, right


def spec_savings(saved, wasted, before, after) -> None:
    """12: from two ``speculative.scrape`` snapshots, the share of the model's passes that drafting saved against
    plain decoding, and the drafted tokens the model verified and threw away (the lesson gives the rates; this
    asks what they cost and buy)."""
    from llmlab.speculative import speculation

    saved, wasted = _number(saved, "saved"), _number(wasted, "wasted")
    d = speculation(after - before)
    require(d.drafts > 0, "the drafting server counted no drafts between your two scrapes: send the requests "
            "to spec_client after `before` and scrape `after` once they have finished.")
    generated, accepted, drafted = d.generated, d.accepted, d.draft_tokens
    require(not math.isclose(saved, d.acceptance_rate) or math.isclose(accepted / generated, d.acceptance_rate),
            "that is the acceptance rate, a share of the drafted tokens; the passes saved are a share of the passes "
            "plain decoding would run: one per generated token.")
    require(not math.isclose(saved, (generated - accepted) / generated),
            "that is the share of passes the model still ran (generated - accepted of generated); saved is the rest.")
    require(math.isclose(saved, accepted / generated, rel_tol=1e-6),
            f"plain decoding runs {generated:.0f} passes for {generated:.0f} tokens; with drafting the model ran "
            f"{generated - accepted:.0f}: each accepted draft token is a pass not run.")
    require(not math.isclose(wasted, accepted), "those are the drafted tokens the model kept; wasted ones are the "
            "others it verified.")
    require(not math.isclose(wasted, drafted), "every drafted token was verified, but the accepted ones were "
            "not wasted: subtract them.")
    require(math.isclose(wasted, drafted - accepted), f"the model verified {drafted:.0f} drafted tokens and kept "
            f"{accepted:.0f}.")
    right(f"{saved:.0%} of the passes saved, at the price of {wasted:.0f} drafted tokens verified for nothing "
          f"({wasted / (generated - accepted):.1f} per pass the model ran).")


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
