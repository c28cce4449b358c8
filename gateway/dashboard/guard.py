"""Who may read the admin surface: ``/admin/*`` and the ops dashboard.

Contract (``admin_access`` is pure; ``AdminGuard`` applies it to every HTTP request):
- Paths outside ``/admin`` and ``/dashboard`` are never touched (``/metrics`` stays open for
  Prometheus, the proxy routes are the clients' business).
- With ``server.admin_token`` set, ``/admin/*`` needs ``Authorization: Bearer <token>``, compared
  in constant time; anything else is 401 in the OpenAI error shape with ``WWW-Authenticate``.
  The dashboard page itself (HTML, JS, CSS: no data) is then served to anyone, because a browser
  cannot attach a bearer header to a navigation; the page reads the token from the URL fragment
  (``/dashboard#token=...``, never sent to a server, so never in an access log) and sends it on
  every state request.
- Without a token, the whole admin surface answers loopback clients only (403 otherwise). Behind
  a reverse proxy on the same host every client looks like loopback: set a token there.

Guarding by path prefix, not route by route, means an admin endpoint added later is covered
without anyone remembering to. The middleware is raw ASGI (not BaseHTTPMiddleware) so it does
not interfere with the proxy routes' disconnect handling.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_body
from gateway.exchange import header

ADMIN_PREFIXES = ("/admin", "/dashboard")


@dataclass(frozen=True, slots=True)
class Verdict:
    allow: bool
    status: int = 200
    message: str = ""
    type: Literal["", "authentication_error", "permission_error"] = ""


ALLOW = Verdict(allow=True)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def admin_access(
    path: str, client_host: str | None, authorization: str | None, token: str | None
) -> Verdict:
    """May this request read the admin surface? Pure: the caller supplies every input."""
    admin = _under(path, "/admin")
    if not admin and not _under(path, "/dashboard"):
        return ALLOW
    if token is None:
        if is_loopback(client_host):
            return ALLOW
        return Verdict(
            False,
            403,
            "admin endpoints answer loopback clients only; set server.admin_token to open them",
            "permission_error",
        )
    if not admin:
        return ALLOW  # the dashboard's static page; its data comes from /admin/dashboard.json
    given = _bearer(authorization)
    if given is not None and hmac.compare_digest(given.encode(), token.encode()):
        return ALLOW
    return Verdict(
        False,
        401,
        "admin endpoints need 'Authorization: Bearer <server.admin_token>'",
        "authentication_error",
    )


class AdminGuard:
    """Raw ASGI middleware applying ``admin_access`` to HTTP requests.

    ``token_of`` is asked on every admin request, so a policy reload rotates the token at once.
    """

    def __init__(self, app: ASGIApp, token_of: Callable[[], str | None]) -> None:
        self._app = app
        self._token_of = token_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(ADMIN_PREFIXES):
            client = scope.get("client")
            authorization = header(scope, b"authorization")
            verdict = admin_access(
                scope["path"],
                client[0] if client else None,
                None if authorization is None else authorization.decode("latin-1"),
                self._token_of(),
            )
            if not verdict.allow:
                await _refuse(send, verdict)
                return
        await self._app(scope, receive, send)


async def _refuse(send: Send, verdict: Verdict) -> None:
    body = orjson.dumps(error_body(verdict.message, verdict.type, verdict.status))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if verdict.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="shapegate-admin"'))
    await send({"type": "http.response.start", "status": verdict.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
