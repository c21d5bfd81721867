"""Checks of notebook 08, distributed serving (``llmlab.cluster``): TP and PP traffic, link times, load time."""

from __future__ import annotations

from llmlab.check.verdict import _is_number, _number, _whole, require, right


def tp8_allreduce_bytes(nbytes) -> None:
    """08: bytes one GPU sends in the TP all-reduces of one decode step (one token) of 405B at TP=8 x PP=1 (every
    GPU holds all 126 layers), bf16."""
    from llmlab import cluster

    expected = cluster.tp_vs_pp("llama3.1-405b", [(8, 1)])[0]["tp_bytes_per_gpu"]
    if _is_number(nbytes) and nbytes < 1000:  # far too few bytes: a size in MiB or MB?
        require(abs(nbytes - expected / 2**20) > 0.5 and abs(nbytes - expected / 1e6) > 0.5,
                "that is MiB (or MB); the question asks for bytes, a whole number.")
    n = _whole(nbytes, "the bytes per GPU", "bytes come whole; leave the size in bytes, not MiB.")
    message = 16384 * 2
    require(n != expected // 2, "that is one stage of TP=8 x PP=2 (the lesson's table: 63 layers per GPU); here "
            "TP=8 x PP=1, every GPU holds all 126 layers, each all-reducing twice.")
    require(n != 252 * message, "that is the message size times the all-reduces: in a ring all-reduce each GPU "
            "sends 2 x (TP-1)/TP of the message (half to reduce, half to share the result).")
    require(n != 2 * expected, "the hidden state travels in bf16: 2 bytes per value, not 4.")
    require(n != expected * 80 // 126, "that is 70B's 80 layers; 405B has 126.")
    require(n == expected, "per GPU it is all-reduces per layer x layers x the ring's share of the message "
            "x the message (hidden_size values, 2 bytes each); check each factor against the task.")
    right(f"{n:,} bytes per GPU per token: {n / 2**20:.1f} MiB each decode step, in 252 small messages.")


def tp_link_times(tp8_us, tp16_us) -> None:
    """08: microseconds per token of TP all-reduce traffic, bandwidth term only: TP=8 on NVLink (450 GB/s each
    way: the 900 GB/s figure counts both directions), TP=16 across two nodes, whose ring runs at its slowest
    link: NVLink inside each node, and between the nodes their 8 InfiniBand ports of 50 GB/s, 400 GB/s."""
    from llmlab import cluster

    tp8, tp16 = cluster.tp_vs_pp("llama3.1-405b", [(8, 1), (16, 1)])
    a, b = _number(tp8_us, "tp8_us"), _number(tp16_us, "tp16_us")
    t8, t16 = tp8["tp_us"], tp16["tp_us"]
    bytes8, bytes16 = tp8["tp_bytes_per_gpu"], tp16["tp_bytes_per_gpu"]

    def near(x, target) -> bool:
        return abs(x - target) <= 0.01 * target

    require(not near(a * 1e6, t8), "that looks like seconds: multiply by 10**6 for µs.")
    require(not near(a, bytes8 / 900e9 * 1e6), "900 GB/s is NVLink's figure for both directions together; a ring "
            "all-reduce sends and receives at the same time, so each direction has 450e9 B/s.")
    require(near(a, t8), f"TP=8: bytes per GPU per token / 450e9 B/s, in µs (expected about {t8:.1f}).")
    require(not near(b * 1e6, t16), "tp16_us looks like seconds: multiply by 10**6 for µs.")
    require(not near(b, bytes16 / 50e9 * 1e6), "50e9 B/s is one InfiniBand port, but each of a node's 8 GPUs has "
            "its own, and NCCL spreads its rings over all of them: the two nodes exchange 8 x 50e9 = 400e9 B/s "
            "each way.")
    require(not near(b, bytes16 / 450e9 * 1e6), "the ring runs at its slowest link: NVLink (450e9 B/s) inside "
            "each node, but 8 x 50e9 = 400e9 B/s between the nodes.")
    require(not near(b, bytes8 / 400e9 * 1e6), "that is TP=8's traffic: over 16 GPUs each one sends 2 x 15/16 of "
            "the message per all-reduce, not 2 x 7/8.")
    require(near(b, t16), f"TP=16: 252 all-reduces x 2 x 15/16 x the message, over 8 ports x 50e9 B/s, in µs "
            f"(expected about {t16:.1f}).")
    right(f"TP=8 {a:.1f} µs vs TP=16 {b:.1f} µs per token: only {b / a:.2f}x, because each GPU has its own "
          "InfiniBand port. That is why vLLM's blog found both layouts similar with InfiniBand; without it (one "
          f"100 Gb/s Ethernet port per node, 12.5e9 B/s) TP=16 would need {bytes16 / 12.5e9 * 1e6:,.0f} µs.")


def pp_boundary(nbytes, us) -> None:
    """08: bytes one GPU of 405B's first stage (TP=8 x PP=2) sends across the boundary for a 2,048-token prompt's
    prefill -- each token's hidden state and residual in bf16, split over the stage's 8 GPUs -- and µs over that
    GPU's own InfiniBand port at 50 GB/s."""
    from llmlab import memory

    tokens, hidden, tp = 2048, memory.model_spec("llama3.1-405b").hidden_size, 8
    expected = tokens * 2 * hidden * 2 // tp  # two messages (hidden state, residual), 2 bytes a value, 1/8 each
    n = _whole(nbytes, "the bytes one GPU sends")
    require(n != 2 * hidden * 2 // tp, f"that is one token (the lesson's decode step); the prefill sends all "
            f"{tokens:,} of the prompt's at once.")
    require(n != expected * tp, "that is what the whole stage sends: vLLM splits each message over the stage's "
            f"{tp} GPUs, and each GPU sends its 1/{tp} slice.")
    require(n != expected // 2, "that is half: two messages cross for every token (the hidden state and the "
            "residual), each of hidden_size values of 2 bytes (bf16).")
    require(n == expected, f"{tokens:,} tokens x 2 messages x hidden_size x 2 bytes, divided over the {tp} GPUs.")
    # what one GPU sends in its stage's all-reduces for the same tokens (63 layers x 2 all-reduces x 2 x 7/8 of
    # the message), over its share of the hand-over
    ratio = 63 * 2 * 2 * 7 / 8 * tokens * hidden * 2 / n
    t = _number(us, "the microseconds")
    require(abs(t - n / 50e9) > 0.01 * n / 50e9, "that is seconds: multiply by 1e6 for µs.")
    require(abs(t - n / 50e9 * 1e6) <= 0.01 * n / 50e9 * 1e6, "each GPU sends over its own port: bytes / 50e9 "
            "B/s, times 1e6 for µs.")
    right(f"{n / 2**20:.0f} MiB per GPU, {t:.0f} µs for the prompt: {ratio:.0f}x less than each GPU sends in its "
          "stage's all-reduces for the same tokens (63 layers), and once per stage boundary.")


def load_eta_minutes(minutes) -> None:
    """08: minutes left for 405B's weights, from the shard line 44/191 after 05:10, at the average rate so far."""
    m = _number(minutes, "the minutes")
    expected = 310 / 44 * (191 - 44) / 60
    require(abs(m - 310 / 44 * 191 / 60) > 0.3, "that is the whole load: only 191 - 44 shards are left.")
    require(abs(m - expected * 60) > 0.05 * expected * 60, "that is seconds: divide by 60.")
    require(abs(m - expected) <= 0.25, f"05:10 is 310 s for 44 shards; the 147 shards left take 147 x 310/44 s "
            f"(about {expected:.1f} min).")
    right(f"about {m:.1f} minutes left (tqdm's own estimate: 17:18); the whole load takes ~22 min here.")
