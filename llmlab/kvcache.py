"""KV caching made visible: on the tiny model, in a few lines of numpy, in vLLM's blocks, on the live server.

Why: "the server keeps the keys and values of earlier tokens" is easy to say and hard to believe until
one sees it: the same greedy tokens with and without the cache, the per-token time that grows without
it, the cached tensors whose bytes ``llmlab.memory`` predicts, the blocks vLLM allocates instead of one
max-length slab per request, and the prefix-cache hit counters that the server itself exports.

The layers, pure first (as everywhere in llmlab):

1. :func:`attend`, :func:`decode_uncached`, :func:`decode_cached`: one attention head in numpy, where
   the cache is just two growing matrices;
2. paged KV memory in numbers: :func:`blocks_for`, :class:`BlockAllocator` (block tables),
   :func:`allocation_table` and :func:`waste_summary` (max-length pre-allocation vs paging), and
   :func:`prefix_cache_hit_tokens` (what vLLM's prefix cache can reuse);
3. the server's own counters: :func:`counters` reads one scrape of vLLM's ``/metrics`` into
   :class:`Counters`, and ``after - before`` is what some requests did (the type, the parser and vLLM's names live
   in ``llmlab.serve.metrics``, for every lesson that subtracts);
4. at the edges, I/O: :func:`greedy` (transformers, on CPU) and :func:`timed_completion` (HTTP to a vLLM
   server).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmlab.memory import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE
from llmlab.serve.metrics import (  # noqa: F401 -- vLLM's names and the snapshot, re-exported: notebooks read them here
    CACHE_CONFIG,
    FINISHED,
    GENERATED,
    KV_USAGE,
    PREFILL_COMPUTED,
    PREFIX_HITS,
    PREFIX_QUERIES,
    PROMPT_TOKENS,
    RUNNING,
    TTFT,
    Counters,
    Metrics,
    Sample,
    counters,
    fetch_metrics,
    metrics_url,
    parse_prometheus,
    read_counters,
    wait_for_request,
)
from llmlab.serve.paths import TINY_MODEL

__all__ = [
    "attend", "decode_uncached", "decode_cached",
    "blocks_for", "BlockAllocator", "allocation_table", "waste_summary", "requests_that_fit", "prefix_cache_hit_tokens",
    "Sample", "Metrics", "parse_prometheus", "metrics_url", "fetch_metrics", "Counters", "read_counters", "counters",
    "wait_for_request", "blocks_in_use", "Usage", "usage_while_running",
    "load_model", "Generation", "greedy", "cache_tensors", "cache_bytes", "tokens_processed", "Timed",
    "timed_completion", "server_token_ids",
    "GPU_BLOCK_SIZE", "CPU_BLOCK_SIZE",
]


# --------------------------------------------------------------------------------------------------
# 1. One attention head, with and without a cache (numpy)
# --------------------------------------------------------------------------------------------------

def attend(q, k, v):
    """Causal scaled dot-product attention of one head: ``softmax(q k^T / sqrt(d)) v``.

    ``q`` holds the last ``t`` positions' queries (t x d), ``k`` and ``v`` all ``s`` positions' keys and
    values (s x d); query ``i`` may look at keys ``0 .. s - t + i`` and no later one.  With ``t == s``
    this is a whole prompt; with ``t == 1`` it is one decoding step against a cache.
    """
    import numpy as np

    t, s = q.shape[0], k.shape[0]
    scores = q @ k.T / math.sqrt(q.shape[1])
    future = np.arange(s)[None, :] > (s - t + np.arange(t))[:, None]
    scores = np.where(future, -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (weights / weights.sum(axis=1, keepdims=True)) @ v


def decode_uncached(x, wq, wk, wv):
    """Attention output at every position, the way a model without a cache produces it while generating:
    at step ``t`` it recomputes the keys and values of *all* ``t`` tokens so far.

    Returns ``(outputs, projections)``: one row per position, and how many token projections (x @ W)
    it computed: 3 x (1 + 2 + ... + n), quadratic in n.
    """
    import numpy as np

    outputs, projections = [], 0
    for t in range(1, len(x) + 1):
        q, k, v = x[:t] @ wq, x[:t] @ wk, x[:t] @ wv  # everything again, for every new token
        projections += 3 * t
        outputs.append(attend(q, k, v)[-1])
    return np.stack(outputs), projections


def decode_cached(x, wq, wk, wv):
    """The same outputs with a KV cache: each step projects only the new token and appends its key and
    value to the cache; the new query attends over the cached rows.

    Returns ``(outputs, projections, (k_cache, v_cache))``: projections are 3 x n, linear in n.
    """
    import numpy as np

    d = wk.shape[1]
    k_cache, v_cache = np.empty((0, d)), np.empty((0, d))
    outputs = []
    for t in range(len(x)):
        new = x[t:t + 1]                                 # only the newest token
        k_cache = np.vstack([k_cache, new @ wk])         # the cache grows by one row per token
        v_cache = np.vstack([v_cache, new @ wv])
        outputs.append(attend(new @ wq, k_cache, v_cache)[0])
    return np.stack(outputs), 3 * len(x), (k_cache, v_cache)


def tokens_processed(prompt_tokens: int, new_tokens: int, use_cache: bool) -> int:
    """Token positions the model runs through to generate ``new_tokens`` after a prompt.

    With the cache: the prompt once, then one token per step (the last generated token needs no pass).
    Without: the whole sequence again at every step, so the total grows with the square of the length.
    """
    if prompt_tokens < 1 or new_tokens < 0:
        raise ValueError("a generation needs a prompt of at least 1 token and new_tokens >= 0")
    if new_tokens == 0:
        return 0
    if use_cache:
        return prompt_tokens + new_tokens - 1
    return sum(prompt_tokens + i for i in range(new_tokens))


# --------------------------------------------------------------------------------------------------
# 2. Paged KV memory: blocks, block tables, waste, prefix reuse
# --------------------------------------------------------------------------------------------------

def blocks_for(tokens: int, block_size: int = GPU_BLOCK_SIZE) -> int:
    """Blocks a request of ``tokens`` tokens holds: vLLM allocates whole blocks, so this rounds up."""
    if tokens < 0 or block_size <= 0:
        raise ValueError(f"tokens must be >= 0 and block_size > 0, got {tokens} and {block_size}")
    return -(-tokens // block_size)


class BlockAllocator:
    """A toy version of vLLM's block manager: a pool of numbered physical blocks, handed out one at a
    time as each request's tokens fill them, and a **block table** per request that maps its logical
    blocks (0, 1, 2, ...) to physical ones, which need not be adjacent.

    Why: this is all PagedAttention needs to stop reserving a maximum-length slab per request; the
    attention kernel reads a request's keys and values through its block table.
    """

    def __init__(self, num_blocks: int, block_size: int = GPU_BLOCK_SIZE):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks))     # physical block ids not held by any request
        self.tables: dict[str, list[int]] = {}  # request -> its physical blocks, in logical order
        self.lengths: dict[str, int] = {}       # request -> tokens it holds

    def append(self, request: str, tokens: int = 1) -> list[int]:
        """Add ``tokens`` tokens to a request (a prompt, or one generated token); take new blocks only when
        the last one is full.  Returns the request's block table.  A full pool raises ``MemoryError``:
        a real server would then pause (preempt) a request instead."""
        table = self.tables.setdefault(request, [])
        length = self.lengths.get(request, 0) + tokens
        need = blocks_for(length, self.block_size) - len(table)
        if need > len(self.free):
            raise MemoryError(f"{request}: needs {need} more blocks, {len(self.free)} free of {self.num_blocks}")
        table += [self.free.pop(0) for _ in range(need)]
        self.lengths[request] = length
        return table

    def release(self, request: str) -> None:
        """A finished request gives all its blocks back to the pool."""
        self.free += self.tables.pop(request)
        self.lengths.pop(request)

    def slot(self, request: str, position: int) -> tuple[int, int]:
        """Where token ``position`` of a request lives: (physical block, offset inside it)."""
        if not 0 <= position < self.lengths[request]:
            raise IndexError(f"{request} holds {self.lengths[request]} tokens, not position {position}")
        return self.tables[request][position // self.block_size], position % self.block_size

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        """Share of blocks in use, what vLLM exports as ``vllm:kv_cache_usage_perc`` (0..1)."""
        return self.used_blocks / self.num_blocks


def allocation_table(lengths, max_len: int, block_size: int = GPU_BLOCK_SIZE):
    """Per request, KV token slots: used, reserved by a naive server, and held in vLLM's blocks.

    A naive server pre-allocates ``max_len`` slots per request because it cannot know how long the
    answer will be; paging holds ``blocks_for(length) x block_size`` slots, so it wastes at most
    ``block_size - 1`` slots per request.  Returns a pandas DataFrame, one row per request.
    """
    import pandas as pd

    rows = []
    for i, n in enumerate(lengths):
        if not 0 < n <= max_len:
            raise ValueError(f"request {i}: length {n} is not within 1..max_len={max_len}")
        paged = blocks_for(n, block_size) * block_size
        rows.append({"request": i, "used": n, "naive reserved": max_len, "naive waste": max_len - n,
                     "blocks": paged // block_size, "paged reserved": paged, "paged waste": paged - n})
    return pd.DataFrame(rows).set_index("request")


def waste_summary(lengths, max_len: int, block_size: int = GPU_BLOCK_SIZE) -> dict:
    """Totals of :func:`allocation_table`: slots used, reserved either way, and the wasted share of each."""
    t = allocation_table(lengths, max_len, block_size)
    used, naive, paged = int(t["used"].sum()), int(t["naive reserved"].sum()), int(t["paged reserved"].sum())
    return {"requests": len(t), "used": used, "naive_reserved": naive, "paged_reserved": paged,
            "naive_waste": 1 - used / naive, "paged_waste": 1 - used / paged}


def requests_that_fit(pool_tokens: int, lengths, max_len: int, block_size: int = GPU_BLOCK_SIZE) -> tuple[int, int]:
    """How many of these requests (in order) a KV pool of ``pool_tokens`` slots holds at once:
    ``(naive, paged)``.  Naive reserves ``max_len`` each; paging holds each request's whole blocks."""
    naive = min(len(lengths), pool_tokens // max_len)
    paged, held = 0, 0
    for n in lengths:
        held += blocks_for(n, block_size) * block_size
        if held > pool_tokens:
            break
        paged += 1
    return naive, paged


def prefix_cache_hit_tokens(prompt_tokens: int, shared_tokens: int, block_size: int = CPU_BLOCK_SIZE) -> int:
    """Prompt tokens vLLM's prefix cache can serve when an earlier prompt shared the first ``shared_tokens``.

    vLLM caches only *full* blocks, each identified by a hash of its tokens chained to the previous
    block's hash, so a hit covers whole blocks of the shared prefix.  And it always recomputes at least
    the last prompt token (its logits give the first output token), so even an identical prompt hits at
    most ``prompt_tokens - 1`` tokens, rounded down to a block (``kv_cache_manager.get_computed_blocks``).
    """
    if prompt_tokens < 1 or not 0 <= shared_tokens <= prompt_tokens or block_size <= 0:
        raise ValueError("need prompt_tokens >= 1, 0 <= shared_tokens <= prompt_tokens, block_size > 0")
    usable = min(shared_tokens, prompt_tokens - 1)
    return usable // block_size * block_size


# --------------------------------------------------------------------------------------------------
# 3. vLLM's /metrics: the KV-cache figures of a scrape (llmlab.serve.metrics reads it into Counters)
# --------------------------------------------------------------------------------------------------

def blocks_in_use(now: Counters) -> int:
    """Blocks that running requests hold, from one scrape's :class:`Counters`: vLLM's usage gauge is
    ``1 - free / (num_gpu_blocks - 1)`` (one block is kept aside as a null block), so this inverts it."""
    if now.num_gpu_blocks is None:
        raise ValueError("this server exports no vllm:cache_config_info, so its pool's size (num_gpu_blocks) is "
                         "unknown: blocks in use cannot be counted from the usage gauge alone.")
    return round(now.kv_usage * (now.num_gpu_blocks - 1))


@dataclass(frozen=True)
class Usage:
    """The KV usage gauge read while one request generated (``during``) and once it finished (``after``):
    ``blocks_held`` at ``during``; ``alone``: only this request ran at that scrape and none finished between the
    scrapes before and during, so every block the gauge counted was its own; ``tries``: (requests running, requests
    finished meanwhile) at each reading -- why none was alone, on a shared server."""

    during: Counters
    after: Counters
    blocks_held: int
    alone: bool
    tries: list


def usage_while_running(client, model: str, prompt, max_tokens: int = 64, attempts: int = 8) -> Usage:
    """Read the KV usage gauge while one streamed request is generating, and again once it has finished.

    Why a helper: the gauge counts only blocks of *running* requests, and the tiny model finishes in a fraction
    of a second, so the scrape happens at the first streamed token.  The gauge is the server's, so the reading is
    this request's alone only when the server ran exactly one request at that scrape and no request finished
    between the scrapes before and during (so that one was still this one).  On a shared server that may never
    happen; after ``attempts`` readings the last is returned with ``alone=False``.
    """
    reading, tries = None, []
    for _ in range(attempts):
        before = counters(client)
        during = None
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for _chunk in stream:
            if during is None:
                during = counters(client)
        after = wait_for_request(client, before)
        if during is None:
            continue
        finished = during.finished - before.finished
        tries.append((during.running, finished))
        reading = Usage(during, after, blocks_in_use(during), finished == 0 and during.running == 1, tries)
        if reading.alone:
            return reading
    if reading is None:
        raise RuntimeError(f"the request sent no token in {attempts} tries: check the server's log.")
    return reading


# --------------------------------------------------------------------------------------------------
# 4. transformers on CPU: greedy decoding with and without the cache; the live server
# --------------------------------------------------------------------------------------------------

def load_model(path: str | Path = TINY_MODEL):
    """The tiny model and its tokenizer in float32 (the dtype it was trained and is served in), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        from llmlab.serve.info import ServerError

        raise ServerError(f"No model at {path}: the shipped tiny model lives in llmlab/models/llmlab-tiny "
                          "(reinstall llmlab), or pass the directory of another Hugging Face model.")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@dataclass
class Generation:
    """What :func:`greedy` saw, one entry per generated token.

    ``positions[i]`` is how many tokens preceded token ``i`` (the sequence length it was predicted from);
    ``seconds[i]`` the wall time of the forward pass that predicted it; with the cache, ``cache_shapes[i]``
    is the shape of layer 0's cached keys after that pass and ``cache_bytes[i]`` the bytes of all layers'
    cached keys and values.
    """

    prompt_tokens: int
    use_cache: bool
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cache_shapes: list[tuple[int, ...]] = field(default_factory=list)
    cache_bytes: list[int] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)


def cache_tensors(cache) -> list[tuple]:
    """``[(keys, values), ...]`` per layer from a transformers cache (``DynamicCache`` in transformers 5,
    the legacy tuple of tuples before).  Each tensor is (batch, kv_heads, cached tokens, head_dim)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]


def cache_bytes(cache) -> int:
    """Bytes held by all cached keys and values: what ``llmlab.memory.kv_bytes_per_token`` predicts per token."""
    return sum(t.numel() * t.element_size() for pair in cache_tensors(cache) for t in pair)


def greedy(model, input_ids, new_tokens: int, use_cache: bool = True) -> Generation:
    """Greedy decoding written out step by step, so that each token's time and the cache can be observed.

    With ``use_cache`` the first pass runs the whole prompt and returns its keys and values; every later
    pass feeds only the newest token plus that cache.  Without, every pass runs the whole sequence so far
    (which is what the cache saves).  Either way the argmax of the last position is the next token.
    """
    import torch

    ids = torch.as_tensor(input_ids).reshape(1, -1)
    result = Generation(prompt_tokens=ids.shape[1], use_cache=use_cache)
    past, step_input = None, ids
    with torch.inference_mode():
        for _ in range(new_tokens):
            start = time.perf_counter()
            if use_cache:
                out = model(input_ids=step_input, past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
            else:
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
            token = out.logits[0, -1].argmax()
            result.seconds.append(time.perf_counter() - start)
            result.positions.append(ids.shape[1])
            result.tokens.append(int(token))
            if use_cache:
                result.cache_shapes.append(tuple(cache_tensors(past)[0][0].shape))
                result.cache_bytes.append(cache_bytes(past))
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
            step_input = token.view(1, 1)
    return result


NOT_REPORTED = ("This server does not report each request's cached tokens: vLLM leaves "
                "usage.prompt_tokens_details out unless it is started with --enable-prompt-tokens-details, which "
                "every server llmlab starts passes (ask the server's owner to add it).")


def cached_tokens(usage) -> int | None:
    """The prompt tokens *this* request found in the prefix cache (``usage.prompt_tokens_details.cached_tokens``);
    None from a server that does not report them (vLLM's ``--enable-prompt-tokens-details``, which every server
    llmlab starts passes).  Why per request: ``/metrics`` counters add every client's requests, so on a shared
    server their differences around your request are everyone's; this field is yours alone."""
    found = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
    return int(found) if found is not None else None


@dataclass(frozen=True)
class Timed:
    """One streamed completion as this client saw it (:func:`timed_completion`): seconds to the first token
    (``ttft``) and in all, the text, and the server's token counts (``usage``: None where the server sent none;
    ``cached_tokens`` None from a server started without ``--enable-prompt-tokens-details``)."""

    ttft: float
    seconds: float
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


def timed_completion(client, model: str, prompt, max_tokens: int = 1, extra_body: dict | None = None) -> Timed:
    """Send one streamed completion and time it from the client: seconds to the first token and in all, and the
    server's token counts (``usage``, with :func:`cached_tokens`).  Greedy, so repeated runs do the same work.
    The times are what this client saw: on a shared server they include waiting behind others' requests."""
    start = time.perf_counter()
    first, usage, text = None, None, []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
    for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter() - start
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - start
    return Timed(first if first is not None else total, total, "".join(text),
                 usage.prompt_tokens if usage else None, usage.completion_tokens if usage else None,
                 cached_tokens(usage) if usage else None)


def server_token_ids(client, model: str, prompt: str) -> list[int]:
    """The token ids the *server's* tokenizer gives ``prompt`` (its start token included), as the server counts
    them: a cluster's model splits text differently from the tiny one.

    Read back from an echoed completion (``echo``, ``logprobs=0``, vLLM's ``return_tokens_as_token_ids``),
    because llmlab's proxy does not forward vLLM's ``/tokenize``.  It is a request like any other, so it puts
    ``prompt``'s blocks into the prefix cache: ask after an experiment on that cache, never before."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    tokens = r.choices[0].logprobs.tokens[: r.usage.prompt_tokens]
    return [int(t.removeprefix("token_id:")) for t in tokens]
