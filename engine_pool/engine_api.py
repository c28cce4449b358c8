"""The engine's API as both sides of the gateway name it: the routes a vLLM-compatible engine
serves a request of, and Anthropic's error body. The gateway (``gateway/protocols/routes.py``
maps paths to these names) and the simulator (``engine_pool/sim/app.py``) import them from here,
so the two cannot drift apart."""

from __future__ import annotations

from typing import Any, Literal

# Every engine route the gateway counts and lanes and the simulator serves, as vLLM does.
RouteKind = Literal[
    "chat",
    "completions",
    "responses",
    "messages",
    "embeddings",
    "pooling",
    "score",
    "rerank",
    "tokenize",
    "detokenize",
    "transcriptions",
    "translations",
]


def anthropic_error_body(message: str, status: int, types: dict[int, str]) -> dict[str, Any]:
    """An error in Anthropic's shape; ``types`` maps an HTTP status to its error type (the
    gateway uses Anthropic's own table, the simulator vLLM's shorter one), else ``api_error``."""
    return {"type": "error", "error": {"type": types.get(status, "api_error"), "message": message}}
