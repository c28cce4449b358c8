"""The ``model`` field of a multipart/form-data body (``/v1/audio/transcriptions`` and kin).

There is no text to count: such a request goes to the lane the policy names
(``routes.multipart_lane``). Only the small ``model`` field is read; the body (already bounded by
``server.max_body_bytes`` while it was read) is forwarded as it came.
"""

from __future__ import annotations

import re

from gateway.errors import BadRequest
from gateway.protocol import CompletionPrompt, Endpoint, RoutedRequest

_BOUNDARY = re.compile(rb'boundary="?([^";\s]+)"?', re.IGNORECASE)
_MODEL = re.compile(rb'content-disposition:[^\r\n]*\bname="model"[^\r\n]*\r\n', re.IGNORECASE)


def multipart_model(content_type: bytes | None, body: bytes) -> str:
    found = _BOUNDARY.search(content_type or b"")
    if content_type is None or found is None or b"multipart/form-data" not in content_type.lower():
        raise BadRequest("this route takes a multipart/form-data body")
    delimiter = b"\r\n--" + found.group(1)
    for part in (b"\r\n" + body).split(delimiter):
        head = _MODEL.search(part)
        if head is None:
            continue
        start = part.find(b"\r\n\r\n", head.start())
        if start >= 0:
            value = part[start + 4 :].strip()
            try:
                model = value.decode("utf-8")
            except UnicodeDecodeError:
                break
            if model:
                return model
    raise BadRequest("'model' is required and must be a string", param="model")


def parse_multipart(endpoint: Endpoint, content_type: bytes | None, body: bytes) -> RoutedRequest:
    return RoutedRequest(
        endpoint=endpoint,
        model=multipart_model(content_type, body),
        prompt=CompletionPrompt(),
        stream=False,
        include_usage=False,
        max_tokens=None,
        body_bytes=len(body),
    )
