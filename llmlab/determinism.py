"""Determinism (notebook 14): when the same request gets the same answer, and when it does not.

Why: "temperature 0 is deterministic" is what most people believe, and an evaluation, a regression test or a
debugging session is built on it.  Greedy decoding is a deterministic *rule*, but the numbers it is applied to
come from floating-point sums whose order the kernels choose -- and a kernel may choose by the shape of the batch.
Floating-point addition is not associative, so the same row of numbers, summed in another order because other
requests shared its batch, can come out a few units in the last place apart; and where two tokens are nearly
tied, that decides which one greedy decoding picks.  Sampling adds one more source (the random draw), which a
request's ``seed`` fixes.

This module measures each source: :func:`answer` asks a live server greedily for every logprob
(``quantization.ask``, under a fresh ``cache_salt`` unless the prefix cache is wanted), :func:`under_load` asks
while other requests keep the server's batches full, and notebook 11's :func:`~llmlab.quantization.drift` says
how far two answers are apart.  Without a server, :func:`batch_rows` shows the cause in one matrix product, and
:func:`batched_logits` in the tiny model itself, run by PyTorch alone and in a batch.  What vLLM's batch-invariant
mode costs on a GPU, which the CPU build cannot run, comes from a committed H200 run (:func:`gpu_table`).
"""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path

import pandas as pd

from llmlab import loadtest
from llmlab.quantization import ask, drift  # noqa: F401  (drift: re-exported for the notebook)
from llmlab.serve.paths import RESULTS_DIR

# benchmarks/lessons_on_gpu.py determinism on one H200 (2026-11-26): default kernels, then VLLM_BATCH_INVARIANT=1.
GPU_RESULTS = RESULTS_DIR / "h200-llama3.1-8b-determinism" / "determinism.json"


def answer(client, model: str, prompt: str, max_tokens: int = 32, fresh: bool = True):
    """A greedy answer with the logprob of every prompt and answer token.  ``fresh``: under a new random
    ``cache_salt``, so the prompt is computed from scratch rather than found in the prefix cache (a hit reuses K
    and V computed in some earlier batch, which is a batch of its own)."""
    extra = {"cache_salt": secrets.token_hex(8)} if fresh else {}
    return ask(client, model, prompt, max_tokens, **extra)


def under_load(client, model: str, prompt: str, others: list[str], concurrency: int = 16, max_tokens: int = 32,
               delay: float = 0.05):
    """:func:`answer` ``prompt`` while ``others`` keep the server busy (``llmlab.loadtest.run`` at
    ``concurrency`` in a background thread, each answer 64 tokens): its tokens are computed in batches shared
    with whichever of the others are running.  ``delay`` seconds after the load starts, the prompt is sent."""
    if concurrency < 1 or not others:
        raise ValueError("give at least one other prompt and a concurrency of 1 or more: the load is what shares "
                         "the prompt's batches.")
    failures: list[BaseException] = []

    def load() -> None:
        try:
            loadtest.run(client, model, others, concurrency=concurrency, max_tokens=64, temperature=0,
                         ignore_eos=True, progress=False)
        except BaseException as e:  # noqa: BLE001  (reported to the caller below)
            failures.append(e)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    threading.Event().wait(delay)
    try:
        return answer(client, model, prompt, max_tokens)
    finally:
        thread.join()
        if failures:
            raise RuntimeError(f"the background load failed ({failures[0]}): is the server still up?") from failures[0]


def _operands(rows: int, inner: int, outer: int, seed: int):
    """``x`` (rows x inner) and ``w`` (inner x outer), standard normal from ``seed``."""
    import torch

    if rows < 1 or inner < 1 or outer < 1:
        raise ValueError(f"rows={rows}, inner={inner}, outer={outer}: a matrix product needs sizes of 1 or more.")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, inner, generator=g), torch.randn(inner, outer, generator=g)


def batch_rows(rows: int = 32, inner: int = 256, outer: int = 4096, seed: int = 0) -> pd.DataFrame:
    """The kernel-level cause, without a server: row 0 of ``x @ w`` computed in batches of 1, 2, 4, ... ``rows``
    rows, against the same row computed alone.  PyTorch's CPU matrix product (oneDNN/MKL) picks its blocking,
    and so the order of each row's sums, by the shape of the whole product."""
    import torch

    x, w = _operands(rows, inner, outer, seed)
    alone = (x[:1] @ w)[0]
    sizes = [1 << i for i in range(rows.bit_length()) if 1 << i <= rows]
    out = []
    for n in sizes:
        row = (x[:n] @ w)[0]
        out.append({"batch rows": n, "bitwise equal to batch 1": bool(torch.equal(row, alone)),
                    "largest difference": float((row - alone).abs().max())})
    return pd.DataFrame(out).set_index("batch rows")


def batched_logits(prompt: str, others: list[str], model=None, tokenizer=None) -> pd.DataFrame:
    """The tiny model's next-token logits after ``prompt``, computed by PyTorch (notebook 02's ``transformers``
    model) alone and as the first row of batches with 1, 2, ... of ``others`` (padded on the right, so the
    prompt's positions do not move): how far each batch's logits are from the prompt's alone, and whether the
    greedy token is the same."""
    import torch

    from llmlab.kvcache import load_model

    if not others:
        raise ValueError("give at least one other prompt to share the batch with.")
    if model is None or tokenizer is None:
        model, tokenizer = load_model()
    tokenizer.padding_side = "right"
    last = len(tokenizer(prompt).input_ids) - 1
    rows = []
    with torch.no_grad():
        alone = model(**tokenizer([prompt], return_tensors="pt")).logits[0, last]
        for n in range(1, len(others) + 1):
            batch = tokenizer([prompt, *others[:n]], return_tensors="pt", padding=True)
            logits = model(**batch).logits[0, last]
            rows.append({"batch": n + 1, "bitwise equal to alone": bool(torch.equal(logits, alone)),
                         "largest difference": float((logits - alone).abs().max()),
                         "same greedy token": int(logits.argmax()) == int(alone.argmax())})
    return pd.DataFrame(rows).set_index("batch")


def first_varying_batch(rows: int = 16, inner: int = 512, outer: int = 512, seed: int = 1) -> int | None:
    """The smallest number of leading rows of ``x`` (1 to ``rows``) for which row 0 of ``x[:n] @ w`` is not
    bitwise equal to row 0 computed alone, or None if every batch agrees (``x``, ``w`` drawn as in
    :func:`batch_rows`)."""
    import torch

    x, w = _operands(rows, inner, outer, seed)
    alone = (x[:1] @ w)[0]
    return next((n for n in range(1, rows + 1) if not torch.equal((x[:n] @ w)[0], alone)), None)


def gpu_table(path: Path | str = GPU_RESULTS) -> pd.DataFrame:
    """The GPU run of ``benchmarks/lessons_on_gpu.py determinism``, one row per setting: how many repetitions of one
    greedy request gave its first answer's tokens and logprobs to the bit, alone and amid the other requests, and
    the speed (batch 1, and 64 requests in flight)."""
    runs = json.loads(Path(path).read_text())
    runs.pop("machine")
    rows = {}
    for name, r in runs.items():
        c64 = next(s for s in r["sweep"] if s["concurrency"] == 64)
        rows[name] = {"alone: same bits": _same_bits(r["alone"]), f"amid {r['others']} others: same bits":
                      _same_bits(r["amid_others"]), "batch 1 tok/s": round(1 / r["batch1"]["tpot_p50"]),
                      "c=64 tok/s": round(c64["output_tokens_per_s"]), "c=64 TPOT ms": round(1000 * c64["tpot_p50"], 2)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("Llama 3.1 8B on one H200")


def _same_bits(repeats: list[dict]) -> str:
    """'k of n': the repetitions whose tokens and logprobs equal the first answer's to the bit."""
    same = sum(r["same_tokens"] and r["max_logprob_diff"] == 0 for r in repeats)
    return f"{same} of {len(repeats)}"

