"""Simulator profiles tests need beyond the shipped ones.

The shipped profiles are generate-only models, as the real Qwen3.6 is: vLLM (and so the sim)
404s the pooling and audio routes for them. A test of those routes (the sim's, or the gateway
relaying them) starts an engine whose model serves every task instead, as an operator would
start a pooling or speech model.
"""

from __future__ import annotations

from engine_pool.sim.profile import ALL_TASKS, EngineProfile, load_profile


def every_task(name: str = "h100-fast") -> EngineProfile:
    """The shipped profile ``name`` with a model that serves every task (generate, embed,
    score, transcription)."""
    return load_profile(name).model_copy(update={"tasks": ALL_TASKS})
