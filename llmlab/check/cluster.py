"""Checks of notebook 08, distributed serving (``llmlab.cluster``): TP and PP traffic, link times, load time."""

from __future__ import annotations

from llmlab.check.verdict import _number, _whole, require, right


def tp8_allreduce_bytes(nbytes) -> None:
    """08: bytes one GPU sends in the TP all-reduces of one decode step (one token) of 405B at TP=8, bf16."""
    from llmlab import cluster

    expected = cluster.tp_vs_pp("llama3.1-405b", [(8, 1)])[0]["tp_bytes_per_gpu"]
    n = _whole(nbytes, "the bytes per GPU")
    message = 16384 * 2
    require(n != 252 * message, "that is the message size times the all-reduces: in a ring all-reduce each GPU "
            "sends 2 x (TP-1)/TP of the message (half to reduce, half to share the result).")
    require(n != 126 * 2 * (7 / 8) * message, "each layer all-reduces twice: after attention and after the MLP.")
    require(n != 2 * expected, "the hidden state travels in bf16: 2 bytes per value, not 4.")
    require(n == expected, "use 2 all-reduces x 126 layers x 2 x (8-1)/8 x hidden_size 16,384 x 2 bytes.")
    right(f"{n:,} bytes per GPU per token: {n / 2**20:.1f} MiB each decode step, in 252 small messages.")


def tp_link_times(tp8_us, tp16_us) -> None:
    """08: microseconds per token of TP all-reduce traffic: TP=8 on NVLink (900 GB/s), TP=16 across nodes on
    InfiniBand (50 GB/s), bandwidth term only."""
    from llmlab import cluster

    tp8, tp16 = cluster.tp_vs_pp("llama3.1-405b", [(8, 1), (16, 1)])
    a, b = _number(tp8_us, "tp8_us"), _number(tp16_us, "tp16_us")
    require(abs(a * 1e6 - tp8["tp_us"]) > 0.01 * tp8["tp_us"], "that looks like seconds: multiply by 10**6 for µs.")
    require(abs(a - tp8["tp_us"]) <= 0.01 * tp8["tp_us"], f"TP=8: bytes per GPU per token / 900e9 B/s, in µs "
            f"(expected about {tp8['tp_us']:.1f}).")
    require(abs(b - tp16["tp_us"]) <= 0.01 * tp16["tp_us"], "TP=16: each GPU sends 2 x 15/16 of the message per "
            "all-reduce, and the ring waits for its slowest link, InfiniBand at 50e9 B/s.")
    right(f"TP=8 {a:.1f} µs vs TP=16 {b:.0f} µs per token: {b / a:.0f}x more time on the wire once TP leaves "
          "the node.")


def pp_boundary(nbytes, us) -> None:
    """08: bytes of one token's hidden state crossing the PP=2 stage boundary, and µs at InfiniBand's 50 GB/s."""
    n = _whole(nbytes, "the bytes across the boundary")
    require(n != 16384, "that counts values, not bytes: the hidden state has 16,384 values of 2 bytes each (bf16).")
    require(n == 16384 * 2, "one token's hidden state: hidden_size x 2 bytes, sent once, point to point.")
    ratio = 126 * 2 * 2 * 7 / 8  # TP=8's all-reduce bytes per GPU per token, over this hidden state's bytes
    t = _number(us, "the microseconds")
    require(abs(t - n / 50e9 * 1e6) <= 0.01 * n / 50e9 * 1e6, "the bandwidth term is bytes / 50e9 B/s, in "
            "seconds: multiply by 1e6 for µs.")
    right(f"{n:,} bytes, {t:.2f} µs per token: {ratio:.0f}x less than one GPU sends in TP=8's all-reduces, "
          "and once per stage boundary.")


def load_eta_minutes(minutes) -> None:
    """08: minutes left for 405B's weights, from the shard line 44/191 after 05:10, at the average rate so far."""
    m = _number(minutes, "the minutes")
    expected = 310 / 44 * (191 - 44) / 60
    require(abs(m - 310 / 44 * 191 / 60) > 0.3, "that is the whole load: only 191 - 44 shards are left.")
    require(abs(m - expected * 60) > 0.05 * expected * 60, "that is seconds: divide by 60.")
    require(abs(m - expected) <= 0.25, f"05:10 is 310 s for 44 shards; the 147 shards left take 147 x 310/44 s "
            f"(about {expected:.1f} min).")
    right(f"about {m:.1f} minutes left (tqdm's own estimate: 17:18); the whole load takes ~22 min here.")
