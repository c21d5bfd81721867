"""Checks of notebook 13, prefix caching at the scale of a room (``llmlab.prefixcache``): the room's hit rate from
its requests' own usage, and the KV blocks a GPU room holds with a shared system prompt and without."""

from __future__ import annotations

import math

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 2's room: Llama 3.1 8B on one H100 (blocks of 16 tokens), 24 learners, a system prompt of 1,500 tokens
# (its start token included), then a question of 56 tokens each, answers of 300 tokens.  Not the lesson's room
# (30 learners, 2,010 + 40 + 200, whose blocks the lesson prints): the learner takes the steps again.
LEARNERS, SYSTEM, QUESTION, ANSWER, BLOCK = 24, 1_500, 56, 300, 16
LESSON_ROOM = (30, 2_010, 40, 200)


def room_hit_rate(hit_rate, computed, room) -> None:
    """13: the share of the room's prompt tokens found in the prefix cache, and the prompt tokens computed, from
    the room's own requests (``run_room``'s records: ``prompt_tokens`` and ``cached_tokens`` each)."""
    hit_rate, computed = _number(hit_rate, "hit_rate"), _number(computed, "computed")
    records = room.result.records
    queries = sum(r.prompt_tokens or 0 for r in records)
    hits = sum(r.cached_tokens or 0 for r in records)
    require(queries > 0, "the room's records hold no prompt tokens: pass the Room that run_room returned.")
    require(not (hits and math.isclose(hit_rate, queries / hits, rel_tol=1e-6)),
            "that is looked-up / found: the rate divides the tokens found by the tokens looked up, so it lies "
            "between 0 and 1.")
    require(not math.isclose(hit_rate, 100 * hits / queries, rel_tol=1e-6) or hits == 0,
            "give the rate as a share between 0 and 1, not a percentage.")
    require(math.isclose(hit_rate, hits / queries, rel_tol=1e-6),
            f"the room's {len(records)} requests sent {queries} prompt tokens and found {hits} in the cache: "
            "hit_rate = found / sent, each summed over the records.")
    require(not math.isclose(computed, hits) or math.isclose(hits, queries - hits),
            "those are the tokens found in the cache; the server computed the others.")
    require(math.isclose(computed, queries - hits),
            f"of the {queries} prompt tokens sent, the {hits} found were not computed again.")
    right(f"{hit_rate:.1%} of the room's prompt tokens came from the cache; the server computed {computed:.0f}.")


def _blocks(learners: int, system: int, question: int, answer: int) -> tuple[int, int]:
    """(shared, salted): a room's KV blocks of 16 tokens at their longest, one salt for the room and one each."""
    from llmlab.kvcache import blocks_for, prefix_cache_hit_tokens

    own = blocks_for(system + question + answer - 1, BLOCK)
    found = prefix_cache_hit_tokens(system + question, system, BLOCK) // BLOCK
    return learners * own - (learners - 1) * found, learners * own


def room_blocks(shared, salted) -> None:
    """13: KV blocks (of 16 tokens) the room's requests hold at their longest, with one salt for the room and with a
    salt per learner."""
    from llmlab import memory
    from llmlab.kvcache import blocks_for, prefix_cache_hit_tokens

    shared, salted = _whole(shared, "shared"), _whole(salted, "salted")
    require((shared, salted) != _blocks(*LESSON_ROOM), "those are the lesson's room's blocks (30 learners, "
            f"2,010 + 40 tokens, answers of 200); this room has {LEARNERS} learners, {SYSTEM:,} + {QUESTION} tokens "
            f"and answers of {ANSWER}.")
    prompt = SYSTEM + QUESTION
    own = blocks_for(prompt + ANSWER - 1, BLOCK)                       # one request's blocks at its longest
    found = prefix_cache_hit_tokens(prompt, SYSTEM, BLOCK) // BLOCK    # whole blocks of the system prompt
    want_salted, want_shared = LEARNERS * own, LEARNERS * own - (LEARNERS - 1) * found
    require(salted != math.ceil(LEARNERS * (prompt + ANSWER - 1) / BLOCK),
            f"salted: each request holds whole blocks of its own, so round up per request, then multiply by "
            f"{LEARNERS}.")
    require(salted == want_salted, f"salted: each request holds blocks_for({prompt} + {ANSWER} - 1, 16) = {own} "
            "blocks at its longest (the last answer token is sampled, never fed back), and with a salt each "
            f"nobody shares: {LEARNERS} times that.")
    require(shared != want_salted, f"shared: with one salt the system prompt's blocks are held once, not {LEARNERS} "
            "times.")
    require(shared != LEARNERS * own - LEARNERS * found,
            "shared: the first learner's request computes the system prompt and holds its blocks; only the other "
            f"{LEARNERS - 1} find them instead of allocating their own.")
    require(shared != LEARNERS * own - (LEARNERS - 1) * math.ceil(SYSTEM / BLOCK),
            f"shared: only *full* blocks are shared. {SYSTEM} tokens fill {SYSTEM // BLOCK} blocks; the last "
            f"{SYSTEM % BLOCK} share a block with each learner's question, which differs per learner.")
    require(shared == want_shared, f"shared: {LEARNERS} x {own} blocks, less the {found} whole system-prompt blocks "
            f"that each of the {LEARNERS - 1} later requests finds in the cache.")
    gib = memory.kv_bytes_per_token("llama3.1-8b") * BLOCK / 2**30  # one block of Llama 3.1 8B's KV (notebook 01)
    right(f"{shared} blocks ({shared * gib:.2f} GiB) with one salt for the room, {salted} ({salted * gib:.2f} GiB) "
          f"with a salt per learner: {salted / shared:.1f}x the KV memory.")
