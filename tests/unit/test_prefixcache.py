"""Prefix caching and chunked prefill for a room (notebook 13, ``llmlab.prefixcache``): the arithmetic of a room's
hits and blocks, and a real engine whose counters match it -- one salt for the room shares, a salt per learner
never does.  The second engine, whose token budget cuts a long prompt into chunks, is asserted by notebook 13's
cells, which `make test` runs under nbval in the same session (every decoder's 384 tokens, every gap counted once,
the long prompts' 449 tokens): starting it here again cost 51 s of CI (issue 23).

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_prefixcache.py (the tests that start the real engine).
"""

import pytest

from llmlab import loadtest, prefixcache
from llmlab.loadtest import Record


def test_room_prompts_and_salts():
    prompts = prefixcache.room_prompts("Be brief.", learners=8, questions=["Why?", "How?"])
    assert len(set(prompts)) == 8 and all(p.startswith("Be brief.\nLearner ") for p in prompts)
    shared, own = prefixcache.room_salts(5, shared=True), prefixcache.room_salts(5, shared=False)
    assert len(set(shared)) == 1 and len(set(own)) == 5 and len(shared[0]) == 43
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="give a whole number"):
            prefixcache.room_salts(bad, shared=True)
    with pytest.raises(ValueError, match="non-empty system prompt"):
        prefixcache.room_prompts("", 3)


def test_expected_hits_and_blocks_count_the_shared_blocks_once():
    lengths, salt = [410, 412, 411], ["room"] * 3
    # the first computes; the others reuse the 3 whole blocks of the 390 shared tokens
    assert prefixcache.expected_hits(lengths, 390, 128, salt) == 2 * 384
    assert prefixcache.expected_hits(lengths, 390, 128, ["a", "b", "c"]) == 0
    assert prefixcache.expected_hits(lengths, 390, 128, ["a", "b", "a"]) == 384
    # at their longest (prompt + 31 answer tokens) each holds 4 blocks; the room 12 alone, 4 + 1 + 1 together
    assert prefixcache.expected_blocks(lengths, 390, 128, salt, max_tokens=32) == 6
    assert prefixcache.expected_blocks(lengths, 390, 128, ["a", "b", "c"], max_tokens=32) == 12
    with pytest.raises(ValueError, match="one of each per learner"):
        prefixcache.expected_hits(lengths, 390, 128, salt[:2])
    with pytest.raises(ValueError, match="max_tokens=0"):
        prefixcache.expected_blocks(lengths, 390, 128, salt, max_tokens=0)


def test_gaps_are_split_by_the_prefill_windows():
    # a decoder's tokens at 10.1, 10.2, 10.5, 10.6; a long prompt prefilled from 10.25 to 10.45
    decoder = Record(id=0, status="ok", start=10.0, ttft=0.1, itl=[0.1, 0.3, 0.1])
    arrival = Record(id=1, status="ok", start=10.25, ttft=0.2)
    during, other = prefixcache.gaps_during(loadtest.LoadResult([decoder]), loadtest.LoadResult([arrival]))
    assert during == pytest.approx([0.3]) and other == pytest.approx([0.1, 0.1])
    assert prefixcache.token_times(decoder) == pytest.approx([10.1, 10.2, 10.5, 10.6])


def test_a_scrape_with_more_requests_running_than_the_room_had_in_flight_means_someone_else_was_there():
    from llmlab.prefixcache import _others_ran

    room = [Record(id=i, start=10.0, end=12.0) for i in range(3)]
    assert not _others_ran([(9.0, 9.0, 0, 0), (10.5, 10.5, 4, 3), (11.9, 11.9, 4, 2)], room)  # some finished
    assert _others_ran([(10.5, 10.5, 9, 4)], room)  # 4 running while the room had 3 in flight
    assert _others_ran([(13.0, 13.0, 2, 1)], room)  # well after the room: anything running is someone else's
    # a gauge the engine set just before the room's last requests ended, scraped just after: still the room's
    assert not _others_ran([(12.2, 12.3, 4, 3)], room)
    assert not _others_ran([(9.8, 10.1, 4, 3)], room)  # the scrape was answered once the room had sent


def _vllms_tier(worker_bytes_per_block: int, tp: int, gib: float, block_size: int) -> tuple[int, int]:
    """vLLM's own sizing of the offload tier: its CPUOffloadingSpec built as the OffloadingConnector builds it for
    ``--kv-offloading-size GiB`` (cpu_bytes_to_use = GiB x 2**30; one block per chunk by default)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=block_size, layer_names=("layer",), group_id=0),),
        worker_kv_bytes_per_block=worker_bytes_per_block, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": gib * (1 << 30)}, engine_id="test",
        model=OffloadingModelConfig(name="model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=block_size, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))
    spec = CPUOffloadingSpec(config)
    return spec.num_chunks, spec.kv_bytes_per_chunk


@pytest.mark.parametrize(("model", "tp", "gib", "block_size"), [
    ("llama3.1-70b", 4, 256, 16), ("llama3.1-70b", 8, 100, 16), ("llama3.1-8b", 1, 0.5, 16),
    ("llama3.1-405b", 8, 1000, 16), ("qwen3-8b", 2, 3, 16), ("llmlab-tiny", 1, 1, 128), ("llmlab-tiny", 1, 0.3, 16)])
def test_offload_tier_sizes_the_host_tier_as_vllms_own_spec_does(model, tp, gib, block_size):
    """Lesson 13, section 6 (KV offloading, on paper: the CPU build refuses the connector): the tier's blocks are
    what vLLM's CPUOffloadingSpec computes for the same --kv-offloading-size, rounding and all."""
    from llmlab import memory

    tier = prefixcache.offload_tier(model, gib, tp=tp, block_size=block_size)
    worker = block_size * memory.kv_bytes_per_token(model, tp=tp)
    assert (tier["blocks"], tier["bytes_per_block"]) == _vllms_tier(worker, tp, gib, block_size)
    assert tier["tokens"] == tier["blocks"] * block_size > 0


def test_offload_tier_of_a_70b_on_four_gpus_and_bad_input():
    tier = prefixcache.offload_tier("llama3.1-70b", 256, tp=4)
    assert tier == {"bytes_per_block": 16 * 327_680, "blocks": 52_428, "tokens": 838_848}  # 5 MiB per 16 tokens
    for bad in (0, -1, "256", True):
        with pytest.raises(ValueError, match="kv-offloading-size in GiB"):
            prefixcache.offload_tier("llama3.1-70b", bad, tp=4)
    with pytest.raises(ValueError, match="give a whole number"):
        prefixcache.offload_tier("llama3.1-70b", 8, tp=0)
