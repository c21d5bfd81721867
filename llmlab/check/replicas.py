"""Checks of notebook 15, replicas behind a router (``llmlab.replicas``): the KV room of two TP=1 replicas against
one TP=2 engine, the cold prefills of a room under least-loaded and prefix-aware routing, and where the replicas
overtook TP=2 on two H200s (``replicas.gpu_table``)."""

from __future__ import annotations

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: Llama 3.1 8B in bf16 on two H200s of 141 GB, requests of 32,768 tokens (the lesson prints two H100s'
# pools for 8,192-token requests: the learner redoes the arithmetic on other cards).
CONTEXT, GPU = 32_768, "H200"
# Exercise 2: four courses of six learners, interleaved as a room sends them, two replicas, one salt for the room.
COURSES, LEARNERS, SALT = ["A", "B", "C", "D"], 6, "workshop-salt"


def _kv_tokens(tp: int, gpu: str = GPU, context: int = CONTEXT) -> int:
    from llmlab import memory

    fit = memory.layout_fit(memory.model_spec("llama3.1-8b"), tp, 1, memory.gpu(gpu), dtype="bfloat16",
                            context=context)
    return fit.kv_blocks * memory.GPU_BLOCK_SIZE


def replica_kv(replica_tokens, tp2_tokens, replicas_fit, tp2_fit) -> None:
    """15: KV tokens of one TP=1 replica and of the TP=2 engine, and how many 32,768-token requests each layout
    holds at once on two H200s."""
    from llmlab.memory import GPU_BLOCK_SIZE

    replica_tokens, tp2_tokens = _whole(replica_tokens, "replica_tokens"), _whole(tp2_tokens, "tp2_tokens")
    replicas_fit, tp2_fit = _whole(replicas_fit, "replicas_fit"), _whole(tp2_fit, "tp2_fit")
    one, two = _kv_tokens(1), _kv_tokens(2)
    require(replica_tokens != _kv_tokens(1, "H100", 8192), "that is an H100's pool, as the lesson printed it; this "
            f"room runs on {GPU}s: memory.gpu('{GPU}').")
    require(replica_tokens != 2 * one, "replica_tokens is one replica's pool, on one GPU: the two replicas do not "
            "pool their caches.")
    require(replica_tokens == one, f"replica_tokens: memory.layout_fit(spec, 1, 1, memory.gpu('{GPU}'), "
            f"dtype='bfloat16', context={CONTEXT}).kv_blocks, times the block of 16 tokens.")
    require(tp2_tokens != two // 2, "tp2_tokens is the whole TP=2 engine's pool: every token's KV is split over the "
            "two GPUs, so kv_blocks already counts tokens of the engine, not of one GPU.")
    require(tp2_tokens == two, "tp2_tokens: the same layout_fit with tp=2.")
    per_request = -(-CONTEXT // GPU_BLOCK_SIZE) * GPU_BLOCK_SIZE
    require(replicas_fit != replica_tokens // per_request,
            "replicas_fit counts both replicas: each holds its own pool's worth of requests.")
    require(replicas_fit == 2 * (replica_tokens // per_request), f"replicas_fit: a request lives in one replica's "
            f"pool, so each replica holds {replica_tokens:,} // {per_request:,} whole requests, and there are two.")
    require(tp2_fit == tp2_tokens // per_request, f"tp2_fit: {tp2_tokens:,} tokens hold {tp2_tokens // per_request} "
            f"requests of {per_request:,}.")
    right(f"two replicas hold {replicas_fit} requests of {CONTEXT:,} tokens at once, the TP=2 engine {tp2_fit}: "
          "half the weights per GPU leave more room, and a request can use all of it.")


def _room():
    from llmlab import replicas

    prompts = replicas.course_prompts(COURSES, LEARNERS)
    course_of = [COURSES[i % len(COURSES)] for i in range(len(prompts))]
    return course_of, replicas.homes(prompts, [SALT] * len(prompts), 2)


def cold_prefills(least_loaded, prefix, prefix_requests) -> None:
    """15: how many times the room's course prompts are computed under least-loaded routing (an idle pool dealing
    the requests out in turn) and under prefix routing, and the requests per replica under prefix routing."""
    least_loaded, prefix = _whole(least_loaded, "least_loaded"), _whole(prefix, "prefix")
    course_of, homes = _room()
    want_requests = [homes.count(0), homes.count(1)]
    require(isinstance(prefix_requests, (list, tuple)) and len(prefix_requests) == 2,
            "prefix_requests: a list of two counts, replica 0's and replica 1's.")
    require(list(prefix_requests) == want_requests, "prefix_requests: count the replicas replicas.homes(prompts, "
            "[SALT] * len(prompts), 2) names, replica 0 first.")
    dealt = len({(i % 2, c) for i, c in enumerate(course_of)})
    require(prefix == len(set(course_of)), "prefix: every learner of a course goes to the course's home replica, "
            "so each course prompt is computed once there.")
    require(least_loaded != 2 * len(set(course_of)) or dealt == least_loaded,
            "least_loaded: not every course lands on both replicas. Write down which replica gets request i (turns: "
            "i % 2) and which course it belongs to (i % 4): count the (replica, course) pairs that occur.")
    require(least_loaded == dealt, "least_loaded: a course prompt is computed once on each replica that receives a "
            "learner of that course: count the (replica, course) pairs.")
    right(f"{least_loaded} cold prefills dealt in turn, {prefix} by prefix, requests {want_requests}: with an even "
          "number of courses, taking turns happens to keep each course on one replica too. Real rooms do not "
          "arrive in such order, and prefix routing does not depend on it.")


def replica_crossover(crossover, replicas_per_gpu, tp2_per_gpu) -> None:
    """15: the fewest requests in flight at which two replicas out-served the TP=2 engine in both H200 runs, and
    each layout's output tokens/s per GPU there, in run 1."""
    from llmlab import replicas

    tok = replicas.gpu_table()["output tok/s"]
    ahead = (tok["2 replicas"].min(axis=1) > tok["TP=2"].max(axis=1))
    level = int(ahead[ahead].index.min())
    c = _whole(crossover, "crossover")
    require(c in tok.index, f"crossover is one of the measured levels: {', '.join(map(str, tok.index))}.")
    require(c >= level, f"at {c} in flight the TP=2 engine was still ahead in at least one run: compare "
            "tok['2 replicas'] with tok['TP=2'] row by row.")
    require(c == level, f"the replicas were ahead in both runs already at fewer than {c} in flight.")
    rep, tp2 = tok.loc[level, ("2 replicas", "run1")], tok.loc[level, ("TP=2", "run1")]
    r, t = _number(replicas_per_gpu, "replicas_per_gpu"), _number(tp2_per_gpu, "tp2_per_gpu")
    require(abs(r - rep) > 1 and abs(t - tp2) > 1, "those are each layout's total; both use two GPUs, so divide by 2.")
    require(abs(r - rep / 2) <= 1, f"replicas_per_gpu: run 1's '2 replicas' output tok/s at {level}, over 2 GPUs.")
    require(abs(t - tp2 / 2) <= 1, f"tp2_per_gpu: run 1's 'TP=2' output tok/s at {level}, over its 2 GPUs.")
    right(f"from {level} in flight: {r:,.0f} against {t:,.0f} tokens/s per GPU. Below that one TP=2 engine served "
          "more; a replica given half the requests runs half a batch, which costs a GPU almost a whole step.")
