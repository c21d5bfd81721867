"""Checks of notebook 10, structured output (``llmlab.structured``): a bounded pattern for references the lesson's
pattern does not cover (numbered books, verse ranges), and a reference as a JSON object a program can read."""

from __future__ import annotations

import re

from llmlab.check.verdict import require, right

# Exercise 1: the lesson's pattern takes "John 3:16"; these also need a numbered book (1-3) and a verse range.
VERSES = ("John 3:16", "Genesis 1:1", "Psalms 119:105", "1 Kings 2:3", "John 3:16-18", "2 Samuel 7:12-14")
NOT_VERSES = ("John 3", "john 3:16", "John 3:16:2", "3:16", "John 3:16-", "4 Kings 1:1", "1Kings 2:3",
              "John 3:-18")


def verse_regex(pattern: str, text: str, finish_reason: str) -> None:
    """10: a regex for a verse reference, and the server's answer under it."""
    require(isinstance(pattern, str), "store the regular expression as a string in `pattern`.")
    missed = next((v for v in VERSES if not re.fullmatch(pattern, v)), None)
    require(missed is None, f"it does not match {missed!r}: an optional book number (1-3) and a space, a book name "
            "with a capital, a space, chapter, ':', verse, and an optional '-' and last verse.")
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


def parsed_reference(obj, text: str) -> None:
    """10: the constrained answer, a reference as a compact JSON object, parsed."""
    import json

    require(isinstance(obj, dict), "parse the answer's text with json.loads: you should get a dict.")
    require(obj == json.loads(text), "that is not what the server answered: parse choices[0].text.")
    require(set(obj) == {"book", "chapter", "verse"}, f"the keys are {sorted(obj)}: the layout asks for book, "
            "chapter and verse.")
    require(isinstance(obj["book"], str) and obj["book"][:1].isupper(), "book must be a string with a capital.")
    require(all(isinstance(obj[k], int) and not isinstance(obj[k], bool) and obj[k] >= 1 for k in ("chapter", "verse")),
            "chapter and verse must be whole numbers from 1: a JSON number, not a string in quotes.")
    require(re.fullmatch(r'\{"book": "[^"]*", "chapter": \d+, "verse": \d+\}', text) is not None,
            f"{text!r} is not the compact layout: no space but the one after each ':' and ','.")
    right(f"{obj}: an answer a program can read, whatever the model would have said.")
