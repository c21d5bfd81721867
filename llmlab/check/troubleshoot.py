"""Checks of notebook 19, troubleshooting (``llmlab.troubleshoot``): the cause of the committed H100 job that never
started and the memory share vLLM was given, the longest context vLLM accepts on a given KV pool, and which pending
SLURM job never starts by itself; and which sign each of three excerpts shows (a revoked key, a client that stopped
reading, a wrong key) with the fix of the cell behind the second."""

from __future__ import annotations

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: benchmarks/results/h100-llama3.1-8b-launch/job-oom.out and launch-oom.json (the launcher's H100 job
# started with --extra-vllm-args "--gpu-memory-utilization 0.1", after the job's own 0.9).
EX1_SIGN, EX1_UTILIZATION = "no-kv-memory", 0.1

# Exercise 2: Llama 3.1 8B in bfloat16 on one GPU that leaves exactly 4 GiB for the KV cache, blocks of 16 tokens.
EX2_MODEL, EX2_POOL, EX2_BLOCK = "llama3.1-8b", 4 * 2**30, 16

# Exercise 3: the pending reasons of four jobs; the one that never starts by itself.
EX3_REASONS, EX3_NEVER = ("Resources", "Priority", "PartitionTimeLimit", "QOSGrp*Limit"), "PartitionTimeLimit"


def oom_at_start(cause, utilization) -> None:
    """19: the sign (a name of ``troubleshoot.SIGNS``) of the committed H100 job that never started, and the
    ``--gpu-memory-utilization`` vLLM ran it with."""
    from llmlab import troubleshoot

    names = [s.name for s in troubleshoot.SIGNS]
    require(isinstance(cause, str) and cause in names, f"cause should be one of the signs' names: {', '.join(names)}.")
    require(cause != "kv-at-start", "that sentence names a max seq len and the GiB one request needs; this log says no "
            "memory at all was left for the cache: the weights came first.")
    require(cause not in ("core-exited", "engine-died"), "the engine core did refuse, but that is the API server's "
            "line after it; read up to the root cause, the ValueError above.")
    require(cause == EX1_SIGN, "read the ValueError in launch-oom.json's last log lines: which sign's sentence is it?")
    u = _number(utilization, "utilization")
    require(u != 0.9, "the job's line has --gpu-memory-utilization twice, 0.9 then 0.1; vLLM's parser keeps the last "
            "one it reads.")
    require(u != 90 and u != 10, "a fraction of the GPU's memory, as vLLM takes it (0.9 is 90 %).")
    require(abs(u - EX1_UTILIZATION) < 1e-9, "the value after the last --gpu-memory-utilization on the job's "
            "vllm serve line.")
    right("no-kv-memory at 0.1: vLLM may use 10 % of 79.18 GiB, 7.9 GiB, and the 8B's weights alone are 15.0 GiB "
          "(vllm-first.log), so no memory is left for a single KV block. Drop the second flag: 0.9 left 54.93 GiB.")


def longest_context(tokens) -> None:
    """19: the longest --max-model-len vLLM 0.32 accepts for Llama 3.1 8B (bf16) with exactly 4 GiB of KV cache and
    blocks of 16 tokens (its "estimated maximum model length")."""
    from llmlab import memory, troubleshoot

    n = _whole(tokens, "tokens", "a context is whole tokens: what fits rounds down (//).")
    good = troubleshoot.refusal(EX2_MODEL, EX2_POOL, 131_072, EX2_BLOCK)["estimated_max_len"]
    s = memory.model_spec(EX2_MODEL)
    per_token = memory.kv_bytes_per_token(EX2_MODEL)
    require(n != good + EX2_BLOCK, "vLLM keeps one block of the pool back as its null block: a request can use every "
            "block but that one.")
    require(n != good // 2 and n != (good + EX2_BLOCK) // 2, "that is half: bfloat16 is 2 bytes a number, and each "
            "layer keeps both K and V -- count each once.")
    require(n not in (good * 2, (good + EX2_BLOCK) * 2), "that is twice the answer: each layer keeps a key and a value "
            "(2), 8 KV heads of 128 numbers, 2 bytes each -- 2 twice, not three times.")
    wrong_heads = (EX2_POOL // (per_token * s.num_heads // s.num_kv_heads * EX2_BLOCK) - 1) * EX2_BLOCK
    require(n != wrong_heads, f"that counts {s.num_heads} query heads; keys and values have {s.num_kv_heads} "
            "(grouped-query attention).")
    gb = (4 * 10**9 // (per_token * EX2_BLOCK) - 1) * EX2_BLOCK
    require(n != gb, "that is 4 GB (10**9 bytes); vLLM's GiB are 2**30 bytes.")
    require(n % EX2_BLOCK == 0, "vLLM gives a request whole blocks of 16 tokens: the longest context is a whole "
            "number of them.")
    require(n == good, f"not {n:,}: the pool's whole blocks (4 GiB // (16 x the bytes of one token)), less one, "
            "times 16.")
    right(f"{n:,} tokens ({per_token:,} bytes a token): vLLM's refusal of the model's 131,072 would name "
          f"{n}; --max-model-len {n} or less starts, and one such request fills the pool.")


def never_starts(reason) -> None:
    """19: which of four pending jobs' SLURM reasons (exercise 3) never lets the job start by itself."""
    from llmlab import troubleshoot

    require(isinstance(reason, str) and reason in EX3_REASONS,
            f"reason should be one of the four lines' reasons: {', '.join(EX3_REASONS)}.")
    require(reason != "Resources", "Resources is the normal wait: the job starts as soon as the nodes it asked for "
            "are free.")
    require(reason != "Priority", "Priority: jobs ahead of it go first; it starts in its turn.")
    require(reason != "QOSGrp*Limit", "the QOS limit counts your group's running jobs: it starts when one of them "
            "ends.")
    require(reason == EX3_NEVER, "which limit does no amount of waiting change?")
    right(f"PartitionTimeLimit: {troubleshoot.PENDING_REASONS[EX3_NEVER][0]} It waits forever: cancel it "
          "(scancel) and launch again with a --time the partition allows.")


# Exercise 4: three excerpts (a learner's error, the proxy's log, another learner's error) and the cell behind the
# second; each excerpt's sign, and the fix of that cell.
EX4_CAUSES = {"A": "revoked", "B": "unread", "C": "bad-key"}
EX4_FIXES = {"a": "raise the proxy's SEND_TIMEOUT so that the learner is not dropped",
             "b": "open the stream with `with ... as stream:` so that leaving the loop closes it",
             "c": "ask for fewer max_tokens",
             "d": "restart the server"}
EX4_FIX = "b"


def cut_off(causes, fix) -> None:
    """19: the sign of each of exercise 4's excerpts (``{"A": name, "B": name, "C": name}``) and the letter of the
    fix for the cell behind excerpt B."""
    from llmlab import troubleshoot

    names = [s.name for s in troubleshoot.SIGNS]
    require(isinstance(causes, dict) and set(causes) == set(EX4_CAUSES),
            'causes should be a dict with the excerpts\' letters: {"A": ..., "B": ..., "C": ...}.')
    require(all(c in names for c in causes.values()), f"each cause should be one of the signs' names: "
            f"{', '.join(names)}.")
    require(causes["A"] != "bad-key", "A's key is not wrong: the sentence says its owner revoked it (a key that was "
            "registered and worked); a wrong key reads 'missing or wrong API key'.")
    require(causes["C"] != "revoked", "C's sentence is the one of a key the proxy never knew (a typo, another "
            "server's key), not one its owner revoked.")
    require(causes["B"] not in ("engine-died", "core-exited"), "B is the proxy's line, and the engine is fine: "
            "the proxy dropped one client, the one that read nothing for 60 s.")
    require(causes == EX4_CAUSES, "match each excerpt's sentence with a sign's (troubleshoot.diagnose does it).")
    require(fix in EX4_FIXES, f"fix should be one of the letters {', '.join(EX4_FIXES)}.")
    require(fix != "a", "a longer time-out keeps the connection longer; the learner's cell still never reads the "
            "rest, and vLLM still generates all 800 tokens for nobody.")
    require(fix != "c", "fewer tokens only makes the waste smaller: the cell still leaves the stream open and "
            "unread.")
    require(fix != "d", "the server is fine: one client left its stream open; nothing a restart changes.")
    require(fix == EX4_FIX, "which fix makes leaving the loop close the stream?")
    right("A revoked (the instructor's `llmlab revoke JOB USER --undo` gives them back), B unread, C a wrong key. "
          "For B: `with client.completions.create(..., stream=True) as stream:` closes the stream when the block "
          "ends, break or not; vLLM aborts the request at once instead of generating the rest for nobody.")
