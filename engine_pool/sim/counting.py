"""Prompt token counts for the sim, from the gateway's own tokenizer registry.

The simulated engine must see the same number of prompt tokens as a real vLLM would, so it
counts with ``gateway.tokens.TokenCounter`` (the model's real tokenizer and chat template) rather
than an estimate. This is the one place ``engine_pool`` imports the gateway's tokenizer code.

Contract:
- ``PromptCounter`` is what the sim's HTTP layer needs: ``count(prompt)`` (exact), ``encode``
  and ``render_chat`` (for ``/tokenize``). Calls are blocking: the app runs them in a worker
  thread, so a 300k-token prompt does not stall the event loop.
- ``RegistryCounter.for_profile(profile)`` builds a minimal gateway ``Settings`` holding just the
  profile's model and tokenizer, and loads it (start-up cost: the vocabulary is read once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine_pool.sim.profile import EngineProfile
from gateway.protocol import ChatPrompt, Prompt
from gateway.settings import Settings, parse_settings

if TYPE_CHECKING:
    from gateway.tokens import TokenCounter


class PromptCounter(Protocol):
    def count(self, prompt: Prompt) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, prompt: ChatPrompt) -> str: ...


def profile_settings(profile: EngineProfile) -> Settings:
    """A gateway ``Settings`` whose only job is to name the profile's model and tokenizer."""
    return parse_settings(
        {
            "models": [
                {
                    "name": profile.model,
                    "aliases": list(profile.aliases),
                    "tokenizer": profile.tokenizer.model_dump(exclude_none=True),
                    "max_model_len": profile.max_model_len,
                }
            ],
            # Settings demand a cluster and a lane; the sim uses neither.
            "clusters": [{"name": "self", "endpoints": ["http://127.0.0.1:1"]}],
            "lanes": [
                {
                    "name": "all",
                    "max_prompt_tokens": profile.max_model_len + 1,
                    "clusters": ["self"],
                    "slots": {"lane": 1, "per_endpoint": 1},
                }
            ],
        },
        environ={},
    )


class RegistryCounter:
    """``PromptCounter`` over the gateway's ``TokenCounter`` for one model."""

    def __init__(self, counter: TokenCounter, model: str) -> None:
        self._counter = counter
        self._model = model

    @classmethod
    def for_profile(cls, profile: EngineProfile) -> RegistryCounter:
        from gateway.tokens import TokenCounter

        return cls(TokenCounter.from_settings(profile_settings(profile)), profile.model)

    def count(self, prompt: Prompt) -> int:
        # exact_above=0: the engine always counts exactly, never settles for a bound.
        return self._counter.count_sync(self._model, prompt, exact_above=0).tokens

    def encode(self, text: str) -> list[int]:
        return self._counter.encode(self._model, text)

    def decode(self, ids: list[int]) -> str:
        return self._counter.decode(self._model, ids)

    def render_chat(self, prompt: ChatPrompt) -> str:
        return self._counter.render_chat(self._model, prompt)
