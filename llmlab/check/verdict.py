"""Right or not yet: what every check says, and the small tests of a number they share.

Part of ``llmlab.check`` (its ``__init__`` says how the parts fit).  The topic modules import these from
here, not from the package, so that the package can re-export the topic modules without an import circle.
"""

from __future__ import annotations

from numbers import Integral, Real


class NotYet(AssertionError):
    """The answer is not right yet; the message says why."""

    def _render_traceback_(self) -> list[str]:
        """What Jupyter shows for a wrong answer: the hint, one line.  IPython calls this in place of printing the
        traceback, which ran through the course's internals for some 25 lines and printed the check's source around
        the failure -- lines that compute the answer (learner-review-1).  The cell still fails, so an automated
        run (nbval) sees the error as before."""
        return [str(self)]


def require(condition: bool, hint: str) -> None:
    """Raise :class:`NotYet` with ``hint`` (what is still wrong, and why) unless ``condition`` holds."""
    if not condition:
        raise NotYet(f"Not yet: {hint}")


def right(message: str) -> None:
    """Print the one line of a correct answer, starting with "Right:"."""
    print(f"Right: {message}")


def _is_number(value) -> bool:
    """A real number, numpy's included (``numpy.int64``, ``numpy.float32``), but not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _whole(value, what: str, rounding: str = "") -> int:
    """``value`` as an int, if it is a whole number (GPUs, bytes and tokens are counted, not measured).

    ``rounding`` says how this quantity rounds (tokens down, GPUs up); without it the hint names both.
    """
    require(_is_number(value), f"{what} should be a number.")
    require(isinstance(value, Integral) or float(value).is_integer(), f"{what} should be a whole number: " + (
        rounding or "GPUs, bytes and tokens come whole (a GPU count rounds up, math.ceil; bytes and tokens that "
        "fit round down, //)."))
    return int(value)


def _number(value, what: str) -> float:
    """``value`` as a float, if it is a number (not a bool, not a string)."""
    require(_is_number(value), f"{what} should be a number.")
    return float(value)
