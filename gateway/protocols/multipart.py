"""The ``model`` field of a multipart/form-data body (``/v1/audio/transcriptions`` and kin).

There is no text to count: such a request goes to the lane the policy names
(``routes.multipart_lane``). Only the small ``model`` field is read; the body (already bounded by
``server.max_body_bytes`` while it was read) is forwarded as it came.
"""

from __future__ import annotations

import re

from engine_pool.engine_api import RouteKind
from gateway.errors import BadRequest
from gateway.protocols.openai import CompletionPrompt, RoutedRequest

_BOUNDARY = re.compile(rb'boundary="?([^";\s]+)"?', re.IGNORECASE)
_MODEL = re.compile(rb'content-disposition:[^\r\n]*\bname="model"', re.IGNORECASE)
# A part's headers are looked at up to this far; the audio itself is never scanned.
HEAD_BYTES = 8192
# Form fields sent after the file are looked for in this many bytes at the end of the body.
TAIL_BYTES = 65536


def _field_value(body: bytes, head_end: int, delimiter: bytes) -> str | None:
    following = body.find(b"\r\n" + delimiter, head_end, head_end + HEAD_BYTES)
    if following < 0:
        return None
    try:
        value = body[head_end + 4 : following].strip().decode("utf-8")
    except UnicodeDecodeError:
        return None
    return value or None


def multipart_model(content_type: bytes | None, body: bytes) -> str:
    """The ``model`` form field, read without scanning the uploaded file: the parts before the
    first file part are read in order, then the last ``TAIL_BYTES`` (fields sent after the
    file). A 32 MB upload costs a few bounded ``find`` calls either way."""
    found = _BOUNDARY.search(content_type or b"")
    if content_type is None or found is None or b"multipart/form-data" not in content_type.lower():
        raise BadRequest("this route takes a multipart/form-data body")
    delimiter = b"--" + found.group(1)
    at = body.find(delimiter, 0, HEAD_BYTES)
    while at >= 0:
        start = at + len(delimiter)
        head_end = body.find(b"\r\n\r\n", start, start + HEAD_BYTES)
        if head_end < 0 or b"filename=" in body[start:head_end]:
            break  # a file part (or garbage): the rest is looked for at the end
        if _MODEL.search(body, start, head_end):
            model = _field_value(body, head_end, delimiter)
            if model is not None:
                return model
            break
        following = body.find(b"\r\n" + delimiter, head_end, head_end + HEAD_BYTES)
        at = following + 2 if following >= 0 else -1
    named = body.find(b'name="model"', max(0, len(body) - TAIL_BYTES))
    if named >= 0:
        head_end = body.find(b"\r\n\r\n", named, named + HEAD_BYTES)
        model = _field_value(body, head_end, delimiter) if head_end >= 0 else None
        if model is not None:
            return model
    raise BadRequest("'model' is required and must be a string", param="model")


def parse_multipart(kind: RouteKind, content_type: bytes | None, body: bytes) -> RoutedRequest:
    return RoutedRequest(
        route=kind,
        model=multipart_model(content_type, body),
        prompt=CompletionPrompt(),
        stream=False,
        include_usage=False,
        max_tokens=None,
        body_bytes=len(body),
    )
