"""Counts in messages: "1 process", "2 processes", never "1 processes"."""

from __future__ import annotations


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """'1 process' / '4 processes'; `nouns` for a plural not made with -s or -es."""
    if count == 1:
        return f"{count} {noun}"
    if nouns is None:
        nouns = noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{count} {nouns}"
