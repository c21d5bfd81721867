"""Checks of notebook 06, threaded requests (``llmlab.loadtest``): the job queue, TPOT, the knee of a sweep,
a resumed run.
"""

from __future__ import annotations

from llmlab.check.verdict import _is_number, _number, require, right


def job_queue(send_all, workers: int = 4) -> None:
    """06: ``send_all(ask, prompts, workers)`` keeps ``workers`` requests in flight, answers in prompt order.

    The learner's function is run on a stand-in ``ask`` that sleeps instead of calling a server (so the
    check is fast and sends no load) and counts how many calls run at the same time.
    """
    import random
    import threading
    import time
    from concurrent.futures import Future

    lock, state = threading.Lock(), {"now": 0, "max": 0, "calls": 0}

    def ask(prompt: str) -> str:
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(random.Random(prompt).uniform(0.02, 0.08))  # unequal times: answers finish out of order
        with lock:
            state["now"] -= 1
        return prompt.upper()

    prompts = [f"prompt {i}" for i in range(6 * workers)]
    answers = send_all(ask, prompts, workers)
    require(answers is not None, "send_all returned None: return the list of answers.")
    require(not isinstance(answers, dict), "send_all returned a dict: return a list of answers, one per prompt, in "
            "the order of the prompts.")
    require(not isinstance(answers, str), "send_all returned one string: return a list of answers, one per prompt.")
    answers = list(answers)
    require(not any(isinstance(a, Future) for a in answers), "send_all returned futures: return a list of answers, "
            "each future's .result(), in the order of the prompts.")
    require(all(isinstance(a, str) for a in answers), "send_all should return a list of answers: what ask(prompt) "
            "returned (a string), one per prompt.")
    require(state["calls"] == len(prompts), f"ask was called {state['calls']} times for {len(prompts)} prompts: "
            "call it exactly once per prompt.")
    require(sorted(answers) == sorted(p.upper() for p in prompts), "return what ask(prompt) returned, one answer "
            "per prompt.")
    require(answers == [p.upper() for p in prompts], "the answers are not in the order of the prompts: they "
            "finish in any order, so put each one at its prompt's index (or use pool.map, which keeps the order).")
    require(state["max"] > 1, "only one request was in flight at a time: submit all the prompts to the "
            "ThreadPoolExecutor first, then collect the results.")
    require(state["max"] <= workers, f"{state['max']} requests ran at once for workers={workers}: create the pool "
            "with max_workers=workers.")
    require(state["max"] == workers, f"at most {state['max']} of the {workers} workers were busy at once: give "
            "the pool max_workers=workers and all the prompts up front.")
    right(f"{len(prompts)} answers in order, {workers} requests in flight at once.")


def tpot_by_hand(tpot, record) -> None:
    """06: the time per output token of one record, from its TTFT, latency and output tokens."""
    require(_is_number(tpot), "tpot should be a number of seconds.")
    n, ttft, latency = record.output_tokens, record.ttft, record.latency
    expected = (latency - ttft) / (n - 1)
    require(abs(tpot - latency / n) > 1e-12, "latency / tokens counts the wait for the first token too: TPOT "
            "leaves out the TTFT.")
    require(abs(tpot - (latency - ttft) / n) > 1e-12, "after the first token come tokens - 1 more, not tokens: "
            "divide by output_tokens - 1.")
    require(abs(tpot - expected) <= 1e-9 * max(1.0, expected), "TPOT = (latency - ttft) / (output_tokens - 1), "
            "all from the record.")
    right(f"{tpot * 1000:.2f} ms per token after the first; the mean gap between tokens is the same "
          f"({sum(record.itl) / len(record.itl) * 1000:.2f} ms).")


def knee(answer, table, share: float = 0.8) -> None:
    """06: the smallest concurrency of a sweep that reaches ``share`` of its best throughput."""
    tput = table["output_tokens_per_s"]
    best = tput.max()
    expected = int(min(c for c in table.index if tput[c] >= share * best))
    require(answer in set(table.index), f"{answer!r} is not a concurrency of the sweep ({list(table.index)}).")
    require(answer != int(tput.idxmax()) or answer == expected, "that is where throughput peaks; the question is "
            f"the *smallest* concurrency that already gets {share:.0%} of the peak.")
    require(int(answer) == expected, f"compare each level's output_tokens_per_s with {share:.0%} of the best "
            f"({share * best:.0f} tokens/s) and take the smallest concurrency that reaches it.")
    gain = best / tput[expected] - 1
    right(f"concurrency {expected} gives {tput[expected]:.0f} of the best {best:.0f} output tokens/s; more requests "
          f"in flight add latency for at most {gain:.0%} more throughput.")


def goodput(share, result, slo: dict) -> None:
    """06: the share of a run's requests that met every SLO (``slo`` in seconds: ttft, tpot, latency)."""
    from llmlab.loadtest import check_slo, meets_slo

    slo = check_slo(slo)
    share = _number(share, "the share")
    records = result.records
    good = sum(meets_slo(r, slo) for r in records)
    expected = good / len(records)
    ok = [r for r in records if r.status == "ok"]
    require(0 <= share <= 1, f"{share:g} is not a share: count the good requests and divide by all of them.")
    require(share != 100 * expected or expected == 0, "a share between 0 and 1, not a percentage.")
    if abs(share - expected) > 1e-12:
        strict = sum(all((getattr(r, k) or 0.0) < v for k, v in slo.items()) for r in ok) / len(records)
        require(abs(share - good / max(len(ok), 1)) > 1e-12 or len(ok) == len(records), "divide by every "
                "request, failed ones too: a request that failed was not served within any SLO.")
        require(abs(share - strict) > 1e-12, "a request exactly at the limit meets it: use <=, as vLLM does.")
        for name in slo:
            one = sum(meets_slo(r, {name: slo[name]}) for r in records) / len(records)
            require(abs(share - one) > 1e-12, f"that counts only the {name} objective: a good request meets "
                    f"every one ({', '.join(slo)}).")
        require(False, f"count the requests with status 'ok' whose {', '.join(slo)} are all within the SLOs "
                f"({', '.join(f'{k} <= {v:g} s' for k, v in slo.items())}), over all {len(records)} requests.")
    right(f"{good} of {len(records)} requests met every SLO ({expected:.0%}); at "
          f"{result.summary()['requests_per_s']:.1f} requests/s that is a goodput of "
          f"{result.summary(slo)['goodput_requests_per_s']:.1f} requests/s.")


def resumed(path, count: int) -> None:
    """06: a run saved in ``path`` that failed and was resumed: ``count`` requests, all ok in the end."""
    import json
    from pathlib import Path

    from llmlab import loadtest

    result = loadtest.load(path)  # the last record of each request
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    sessions = {json.loads(line).get("session") for line in lines}  # every attempt
    require(len(result.records) == count, f"the file holds {len(result.records)} requests, not {count}: save every "
            "attempt to the same file.")
    require(len(sessions) >= 2 or not result.failed, "only one run is in the file: run again with the same "
            "save= path and resume=True.")
    first = result.failed[0].error[:80] if result.failed else ""
    require(not result.failed, f"{len(result.failed)} requests still failed ({first}): resume against the "
            "working server (client), with resume=True.")
    require(len(sessions) >= 2, "all ok at once? The exercise starts with a run against the server that is down.")
    right(f"all {count} requests ok after {len(sessions)} runs; the file keeps every attempt.")
