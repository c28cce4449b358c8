"""Field readers shared by the per-route parsers; each raises ``BadRequest`` naming its field."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import BadRequest


def load_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson rejects nesting deeper than 1024 and invalid UTF-8 with this same error type.
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def model_of(data: dict[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    return model


def stream_of(data: dict[str, Any]) -> bool:
    stream = data.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    return stream


def positive_int(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if value < 1:
        raise BadRequest(f"'{name}' must be at least 1, got {value}", param=name)
    return value


def objects(value: Any, name: str) -> list[dict[str, Any]]:
    """An optional array of objects (null or absent: empty)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise BadRequest(f"'{name}' must be an array of objects", param=name)
    return value
