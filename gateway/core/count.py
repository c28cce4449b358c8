"""A prompt's token count: the figure every lane threshold is written in (its method says how
it was reached). gateway/count/tokens.py produces it; the decision, the record and the tuning
tools read it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Method = Literal["bound", "cache", "exact", "none"]


class TokenCount(NamedTuple):
    """A named tuple, not a frozen dataclass: a request makes three (the bound, the record's
    copy without its plan, the exact count), and a frozen dataclass's ``__init__`` sets each
    field through ``object.__setattr__`` (0.78 against 0.25 us for these seven fields).
    Immutable all the same; ``__repr__`` leaves out the plan as the dataclass did (it holds
    the prompt's pieces: a repr never shows text)."""

    tokens: int
    method: Method
    tokenizer: str
    prompt_bytes: int
    seconds: float
    # What the counter needs to finish a bound without planning the prompt again (its own
    # private plan: gateway/count/tokens.py reads it back; nothing else looks inside).
    plan: object = None
    # The largest single sequence of a batch (None: one sequence, ``tokens`` itself).
    largest: int | None = None

    def __repr__(self) -> str:
        return (
            f"TokenCount(tokens={self.tokens!r}, method={self.method!r}, "
            f"tokenizer={self.tokenizer!r}, prompt_bytes={self.prompt_bytes!r}, "
            f"seconds={self.seconds!r}, largest={self.largest!r})"
        )

    def without_plan(self) -> TokenCount:
        """The count without its plan (a record never holds text); ``dataclasses.replace``'s
        result, built directly (it looks up the fields each call: one a request)."""
        if self.plan is None:
            return self
        return TokenCount(
            self.tokens,
            self.method,
            self.tokenizer,
            self.prompt_bytes,
            self.seconds,
            None,
            self.largest,
        )

    @property
    def exact(self) -> int | None:
        return None if self.method == "bound" else self.tokens

    @property
    def longest(self) -> int:
        """The largest single sequence: what must fit a context (``tokens`` but for batches)."""
        return self.tokens if self.largest is None else self.largest
