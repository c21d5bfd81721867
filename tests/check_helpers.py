"""What every exercise-check test asks of a check (tests/unit/test_check.py, test_batching.py, test_lora_checks.py):
a wrong answer raises ``NotYet`` with a sentence that names the mistake; the right one prints one "Right:" line."""

import re

import pytest

from llmlab import check


def not_yet(fn, *args, hint: str, hides: int | None = None, **kwargs) -> None:
    """``fn(*args)`` raises NotYet, whose message starts with "Not yet:" and contains ``hint`` -- and, given the
    answer as ``hides``, never states it (neither 14450688 nor 14,450,688)."""
    with pytest.raises(check.NotYet, match=re.escape(hint)) as e:
        fn(*args, **kwargs)
    assert str(e.value).startswith("Not yet: ")
    assert isinstance(e.value, AssertionError)  # an unsolved exercise fails nbval loudly
    if hides is not None:
        for shown in {str(hides), f"{hides:,}"}:
            assert not re.search(rf"(?<![\d,.]){re.escape(shown)}(?![\d,])", str(e.value)), (shown, str(e.value))


def right(capsys, fn, *args, **kwargs) -> str:
    """``fn(*args)`` passes and prints one line starting with "Right:"; returns it."""
    fn(*args, **kwargs)
    out = capsys.readouterr().out
    assert out.startswith("Right: ") and out.count("\n") == 1, out
    return out
