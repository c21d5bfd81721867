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


def seeded_answers(a: str, b: str, c: str) -> None:
    """14: two sampled answers with the same seed, and one with another seed."""
    require(all(isinstance(t, str) for t in (a, b, c)), "pass the three answers' texts (choices[0].text).")
    require(a == b, "the two answers with the same seed differ: send both with seed=7 and the same prompt, "
            "temperature and max_tokens.")
    require(c != a, "the third answer is the same as the first: give it another seed (or none), so that it draws "
            "other random numbers.")
    right("the same seed drew the same tokens; another seed drew others.")
