"""Reading the log-probabilities a vLLM server sends back: tables, likelihood, perplexity, surprise.

Every function takes a response as the openai client returns it (``Completion`` / ``ChatCompletion`` objects,
read through ``.model_dump()``), as plain JSON (a dict), or just one choice of it. The shapes, as vLLM's
OpenAI server writes them:

* completions, ``choices[i].logprobs``: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
  dict token -> logprob per position: the k most likely tokens plus the chosen one) and ``text_offset``
  (where each token starts in the text). With ``echo=True`` the first entry has no logprob (``None``).
* chat, ``choices[i].logprobs.content``: one entry per token with ``token``, ``logprob`` and ``top_logprobs``
  (a list of ``{token, logprob, bytes}``).
* vLLM's own ``prompt_logprobs``: a list with one entry per prompt token; the first is ``None`` (nothing comes
  before the first token), the others map token id -> ``{logprob, rank, decoded_token}``: the prompt's actual
  token (listed first) and the k most likely ones. It sits on the choice for completions and on the response
  for chat; through the openai client it is an extra field (``model_extra``), and JSON turns the ids into strings.

These logprobs are the model's *raw* ones (vLLM's default ``logprobs_mode``): computed before penalties,
temperature, top-k and top-p, whatever the request asked for. ``-inf`` is written as ``-9999.0``.
``rank`` is 1 + how many tokens have a logprob at least as high, so rank 1 is the model's top guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

NO_LOGPROBS_FIX = ("request them: completions.create(..., logprobs=k) or chat.completions.create(..., "
                   "logprobs=True, top_logprobs=k)")
TABLE_COLUMNS = ["position", "token", "logprob", "prob", "surprise_bits", "rank", "is_top1", "top_token",
                 "alternatives", "text_offset"]


def _plain(obj: Any) -> Any:
    """A JSON-like copy of an openai/pydantic object (extra fields such as prompt_logprobs included)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return obj


def _choice(response: Any, choice: int = 0) -> dict:
    data = _plain(response)
    if not isinstance(data, Mapping):
        raise TypeError(f"expected an OpenAI response, one of its choices or a dict, got {type(response).__name__}")
    if "choices" in data:
        choices = data["choices"] or []
        if choice >= len(choices):
            raise ValueError(f"the response has {len(choices)} choice(s), no choice {choice}. Fix: use choice=0.")
        return dict(choices[choice])
    return dict(data)


def _alternatives(top: Any) -> list[tuple[str, float]]:
    """Alternatives as (token, logprob), most likely first, from either the completions dict or the chat list."""
    if not top:
        return []
    if isinstance(top, Mapping):
        pairs = [(str(t), float(lp)) for t, lp in top.items()]
    else:
        pairs = [(str(_get(item, "token")), float(_get(item, "logprob"))) for item in _plain(top)]
    return sorted(pairs, key=lambda pair: -pair[1])


def _get(item: Any, key: str, default: Any = None) -> Any:
    if isinstance(item, Mapping):
        return item.get(key, default)
    return getattr(item, key, default)


def token_records(response: Any, choice: int = 0) -> list[dict]:
    """One dict per generated token: ``token``, ``logprob`` (None when absent), ``alternatives``, ``text_offset``.

    The common ground of the completions and chat formats; :func:`logprob_table` builds on it.
    """
    data = _choice(response, choice)
    logprobs = _plain(data.get("logprobs", data if ("content" in data or "tokens" in data) else None))
    if not logprobs:
        raise ValueError(f"this response carries no logprobs. Fix: {NO_LOGPROBS_FIX}.")
    if "content" in logprobs:
        return [{"token": item["token"], "logprob": item.get("logprob"),
                 "alternatives": _alternatives(item.get("top_logprobs")), "text_offset": None}
                for item in logprobs["content"] or []]
    tokens = logprobs.get("tokens") or []
    n = len(tokens)
    token_logprobs = logprobs.get("token_logprobs") or [None] * n
    tops = logprobs.get("top_logprobs") or [None] * n
    offsets = logprobs.get("text_offset") or [None] * n
    return [{"token": t, "logprob": lp, "alternatives": _alternatives(top), "text_offset": off}
            for t, lp, top, off in zip(tokens, token_logprobs, tops, offsets, strict=True)]


def _rank(token: str, logprob: float, alternatives: list[tuple[str, float]]) -> int | None:
    """Rank among the listed alternatives: exact inside the top-k; a token outside it gets k+1 (a lower bound)."""
    if not alternatives:
        return None
    return 1 + sum(1 for t, lp in alternatives if t != token and lp >= logprob)


def surprise(logprobs: Any, base: float = 2.0) -> np.ndarray:
    """Surprise (information content) of each token, ``-log(p)``, in bits by default.

    1 bit = as unexpected as a coin flip; 10 bits = a one-in-a-thousand token. Takes a list of logprobs, a
    table from :func:`logprob_table`/:func:`prompt_table`, or a response.
    """
    return -_logprob_values(logprobs) / math.log(base)


def logprob_table(response: Any, choice: int = 0) -> pd.DataFrame:
    """A DataFrame with one row per generated token.

    Columns: ``position``, ``token``, ``logprob``, ``prob``, ``surprise_bits``, ``rank`` (among the returned
    alternatives, see ``_rank``), ``is_top1`` (was it the model's most likely token), ``top_token`` (that most
    likely token), ``alternatives`` (list of (token, prob), most likely first) and ``text_offset`` (completions).
    """
    rows = []
    for position, rec in enumerate(token_records(response, choice)):
        lp = math.nan if rec["logprob"] is None else float(rec["logprob"])
        alts = rec["alternatives"]
        rank = None if math.isnan(lp) else _rank(rec["token"], lp, alts)
        rows.append({
            "position": position, "token": rec["token"], "logprob": lp, "prob": math.exp(lp),
            "surprise_bits": -lp / math.log(2), "rank": rank, "is_top1": None if rank is None else rank == 1,
            "top_token": alts[0][0] if alts else None,
            "alternatives": [(t, math.exp(a)) for t, a in alts], "text_offset": rec["text_offset"],
        })
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    return table.astype({"rank": "Int64", "is_top1": "boolean"})


def _logprob_values(source: Any) -> np.ndarray:
    if isinstance(source, pd.DataFrame):
        values = source["logprob"].to_numpy(dtype=float)
    elif isinstance(source, pd.Series):
        values = source.to_numpy(dtype=float)
    elif isinstance(source, np.ndarray) or (isinstance(source, Sequence) and not isinstance(source, str | bytes)):
        values = np.array([math.nan if v is None else float(v) for v in source], dtype=float)
    else:
        values = np.array([math.nan if r["logprob"] is None else float(r["logprob"])
                           for r in token_records(source)], dtype=float)
    return values


def sequence_logprob(source: Any) -> float:
    """Log-likelihood of the whole sequence: the sum of its tokens' logprobs (missing ones, e.g. the first
    prompt token, are skipped). Its ``exp`` is the probability of producing exactly this text."""
    values = _logprob_values(source)
    return float(np.nansum(values))


def perplexity(source: Any) -> float:
    """``exp(-mean logprob)``: the model was on average as unsure as a fair choice among this many tokens.

    1.0 means every token was certain; compare perplexities of texts under the *same* model and tokenizer only.
    """
    values = _logprob_values(source)
    values = values[~np.isnan(values)]
    if values.size == 0:
        raise ValueError("no logprobs to average. Fix: " + NO_LOGPROBS_FIX + " (or prompt_logprobs=k).")
    return float(np.exp(-values.mean()))


# --------------------------------------------------------------------------------------------- prompt logprobs


def _prompt_source(source: Any, choice: int) -> tuple[list, list | None]:
    """(prompt_logprobs list, prompt_token_ids or None) from a response, a choice, or the list itself."""
    if isinstance(source, Sequence) and not isinstance(source, str | bytes | Mapping):
        return list(source), None
    data = _plain(source)
    picked = _choice(data, choice)
    for holder in (picked, data):
        if isinstance(holder, Mapping) and holder.get("prompt_logprobs") is not None:
            return list(holder["prompt_logprobs"]), holder.get("prompt_token_ids")
    raise ValueError("this response carries no prompt_logprobs. Fix: pass extra_body={'prompt_logprobs': k} "
                     "(k >= 0) with the request.")


def _entries(position: Mapping) -> list[tuple[int, float, int | None, str | None]]:
    """(token id, logprob, rank, decoded token) for one position, in the order the server listed them."""
    return [(int(tid), float(_get(v, "logprob")), _get(v, "rank"), _get(v, "decoded_token"))
            for tid, v in position.items()]


def prompt_table(source: Any, prompt_token_ids: Sequence[int] | None = None, choice: int = 0) -> pd.DataFrame:
    """A DataFrame with one row per prompt token: how likely the model found the prompt, token by token.

    ``source`` is a response, a choice, or the ``prompt_logprobs`` list. Which entry of a position is the
    prompt's own token comes from ``prompt_token_ids`` (given, or found in the response); failing that, the
    first entry, which is where vLLM puts it. Columns: ``position``, ``token_id``, ``token``, ``logprob``,
    ``prob``, ``rank`` (in the whole vocabulary), ``is_top1``, ``top_token``, ``top_logprob``.
    The first position has no logprob: a model cannot predict the first token of a text from nothing.
    """
    positions, found_ids = _prompt_source(source, choice)
    ids = list(prompt_token_ids) if prompt_token_ids is not None else found_ids
    if ids is not None and len(ids) != len(positions):
        raise ValueError(f"prompt_token_ids has {len(ids)} ids but prompt_logprobs {len(positions)} positions. "
                         "Fix: pass the ids of the same prompt (usage.prompt_tokens tells how many).")
    rows = []
    for pos, entry in enumerate(positions):
        rows.append(_prompt_row(pos, entry, None if ids is None else int(ids[pos])))
    table = pd.DataFrame(rows, columns=["position", "token_id", "token", "logprob", "prob", "rank", "is_top1",
                                        "top_token", "top_logprob"])
    return table.astype({"token_id": "Int64", "rank": "Int64", "is_top1": "boolean"})


def _prompt_row(pos: int, entry: Mapping | None, token_id: int | None) -> dict:
    empty = {"position": pos, "token_id": token_id, "token": None, "logprob": math.nan, "prob": math.nan,
             "rank": None, "is_top1": None, "top_token": None, "top_logprob": math.nan}
    if not entry:
        return empty
    entries = _entries(entry)
    own = next((e for e in entries if e[0] == token_id), None) if token_id is not None else entries[0]
    if own is None:
        raise ValueError(f"prompt token id {token_id} is missing from position {pos} of prompt_logprobs. "
                         "Fix: pass the prompt_token_ids of the same request.")
    best = min(entries, key=lambda e: (e[2] if e[2] is not None else math.inf, -e[1]))
    rank = own[2]
    is_top1 = rank == 1 if rank is not None else own[1] >= best[1]
    return {**empty, "token_id": own[0], "token": own[3], "logprob": own[1], "prob": math.exp(own[1]),
            "rank": rank, "is_top1": is_top1, "top_token": best[3], "top_logprob": best[1]}


def top1_guesses(source: Any, prompt_token_ids: Sequence[int] | None = None, choice: int = 0) -> list[bool | None]:
    """For each prompt token: was it the model's top-1 guess given the tokens before it? (None for the first.)

    A quick measure of how predictable a prompt is: a famous quotation is mostly ``True`` after a few tokens.
    """
    return [None if pd.isna(v) else bool(v) for v in prompt_table(source, prompt_token_ids, choice)["is_top1"]]


# --------------------------------------------------------------------------------------------- the live server


def score_text(client, model: str, text: str, k: int = 1) -> pd.DataFrame:
    """``prompt_table`` of ``text`` as scored by the server (one request, one generated token, ``prompt_logprobs``).

    vLLM also returns the prompt's token ids (``return_token_ids``), so every row names the right token.
    """
    response = client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": k, "return_token_ids": True})
    return prompt_table(response)


def score_choices(client, model: str, prompt: str, options: Sequence[str]) -> pd.DataFrame:
    """Score multiple-choice answers by the summed log-probability of their tokens after ``prompt``.

    The sum favours short answers (every token costs probability), so the mean per token is given too.
    Each option should start with the space that separates it from the prompt (" earth", not "earth"),
    or the tokens at the boundary will not be the ones the model would write.
    """
    start = len(score_text(client, model, prompt))
    rows = []
    for option in options:
        table = score_text(client, model, prompt + option)
        own = table.iloc[start:]
        rows.append({"option": option, "tokens": len(own), "logprob_sum": float(own["logprob"].sum()),
                     "logprob_mean": float(own["logprob"].mean())})
    return pd.DataFrame(rows).sort_values("logprob_sum", ascending=False, ignore_index=True)
