"""Checks of notebook 10, structured output (``llmlab.structured``): a bounded pattern, a parsed answer."""

from __future__ import annotations

import re

from llmlab.check.verdict import require, right

VERSES = ("John 3:16", "Genesis 1:1", "Psalms 119:105")
NOT_VERSES = ("John 3", "john 3:16", "John 3:16:2", "3:16")


def verse_regex(pattern: str, text: str, finish_reason: str) -> None:
    """10: a regex for a verse reference, and the server's answer under it."""
    require(isinstance(pattern, str), "store the regular expression as a string in `pattern`.")
    missed = next((v for v in VERSES if not re.fullmatch(pattern, v)), None)
    require(missed is None, f"it does not match {missed!r}: a book name with a capital, a space, chapter, ':' and "
            "verse.")
    loose = next((v for v in NOT_VERSES if re.fullmatch(pattern, v)), None)
    require(loose is None, f"it also matches {loose!r}, which is not a reference.")
    require(not re.search(r"(?<!\\)(?:[+*]|\{\d*,\})", pattern),
            "bound every repetition ({1,12} rather than +, * or {1,}): under an unbounded pattern a model can go "
            "on forever, and a small one does.")
    require(re.fullmatch(pattern, text) is not None, f"the server's answer {text!r} does not match your pattern: "
            "did you send it as extra_body=llmlab.structured.constraint(regex=pattern)?")
    require(finish_reason == "stop", f"finish_reason is {finish_reason!r}: the answer was cut, not finished; give it "
            "more max_tokens.")
    right(f"{text!r}: the grammar ended the answer where your pattern ends.")


def parsed(obj, text: str) -> None:
    """10: the constrained JSON answer, parsed."""
    import json

    require(isinstance(obj, dict), "parse the answer's text with json.loads: you should get a dict.")
    require(obj == json.loads(text), "that is not what the server answered: parse choices[0].text.")
    require(set(obj) == {"name", "age"}, f"the keys are {sorted(obj)}: the pattern asks for name and age.")
    require(isinstance(obj["name"], str) and isinstance(obj["age"], int), "name must be a string, age a whole number.")
    right(f"{obj}: an answer a program can read, whatever the model would have said.")
