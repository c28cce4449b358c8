"""A prompt's token count: the figure every lane threshold is written in (its method says how
it was reached). gateway/count/tokens.py produces it; the decision, the record and the tuning
tools read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Method = Literal["bound", "cache", "exact", "none"]


@dataclass(frozen=True, slots=True)
class TokenCount:
    tokens: int
    method: Method
    tokenizer: str
    prompt_bytes: int
    seconds: float
    # What the counter needs to finish a bound without planning the prompt again (its own
    # private plan: gateway/count/tokens.py reads it back; nothing else looks inside).
    plan: object = field(default=None, repr=False, compare=False)
    # The largest single sequence of a batch (None: one sequence, ``tokens`` itself).
    largest: int | None = None

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
