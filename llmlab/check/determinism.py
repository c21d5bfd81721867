"""Checks of notebook 14, determinism (``llmlab.determinism``): where a matrix product's row starts to depend on
its batch, and a sampled answer made reproducible by its seed."""

from __future__ import annotations

from llmlab.check.verdict import _whole, require, right


def first_varying_batch(n) -> None:
    """14: the smallest batch whose row 0 of ``x[:n] @ w`` differs from row 0 alone (16 x 512 @ 512 x 512, seed 1)."""
    from llmlab.determinism import first_varying_batch as compute

    want = compute(16, 512, 512, seed=1)
    if want is None:
        require(n is None, "on this machine every batch from 1 to 16 gives row 0 bit for bit: the answer is None.")
        right("no batch of 1 to 16 rows moves row 0 on this machine: its kernel keeps one order for every shape.")
        return
    require(n is not None, "row 0 does change on this machine: compare torch.equal((x[:n] @ w)[0], alone) for n = 1, "
            "2, ... 16.")
    n = _whole(n, "n")
    require(n != want - 1, "that is a 0-based index; n counts rows, starting at 1 (x[:n] has n rows).")
    require(n >= want, f"with {n} rows row 0 is still bitwise equal to row 0 alone: look further.")
    require(n == want, f"row 0 already differs with fewer rows than {n}: the smallest such n.")
    right(f"from {n} rows on, the product takes another path and row 0 moves in its last bits.")


def seeded_choice(choices, seed, again) -> None:
    """14: the three choices of one request (n=3, seed=7), and the seed of a single request that repeats the third.

    vLLM hands the n choices of a seeded request the seeds seed, seed + 1, ... (``v1/engine/parallel_sampling.py``),
    so choice i is a request of its own with seed + i: the step the learner finds by reasoning or by trying."""
    require(isinstance(choices, list | tuple) and len(choices) == 3 and all(isinstance(t, str) for t in choices),
            "choices should be the three texts of the one request with n=3: [c.text for c in r.choices].")
    require(len(set(choices)) > 1, "the three choices are the same: sample them (temperature=1.0); at temperature 0 "
            "every choice is the greedy answer.")
    require(isinstance(again, str), "again should be the text of your single request (choices[0].text).")
    require(seed != 7, "seed 7 repeats the first choice, not the third: each choice of a seeded request draws with "
            "a seed of its own. Which?")
    require(seed == 9, "vLLM gives choice i of a request with seed s the seed s + i "
            "(vllm/v1/engine/parallel_sampling.py): the third choice, index 2, drew with 7 + 2.")
    require(again == choices[2], "with seed 9 your answer should be the third choice: send the same prompt, "
            "temperature and max_tokens, n=1. (On a GPU, three sequences in one batch can differ in the last bits "
            "from one alone: sections 3 and 4 of this lesson.)")
    right("choice i of a seeded request is the request with seed + i: a sampled answer you can repeat one by one.")
