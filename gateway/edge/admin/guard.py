"""Who may read the admin surface: ``/admin/*`` and the ops dashboard.

Contract (``admin_access`` is pure; ``AdminGuard`` applies it to every HTTP request):
- Paths outside ``/admin`` and ``/dashboard`` are never touched (``/metrics`` stays open for
  Prometheus, the proxy routes are the clients' business).
- Cross-site requests to ``/admin/*`` are refused (403) in every mode: a ``Sec-Fetch-Site``
  other than ``same-origin`` or ``none``, or an ``Origin`` whose host is not the request's
  ``Host``. (The dashboard's static files may be opened from a link on another site.) A web
  page on any site can make a browser send requests to a loopback gateway; these two headers
  are how the browser says so, and a page cannot forge or remove them.
- Requests that change state (any method but GET and HEAD) also need the bearer token or the
  non-simple header ``X-Shapegate-Admin`` (any value): a page cannot attach either to a
  cross-site request without a CORS preflight, which the gateway never grants.
- With ``server.admin_token`` set, ``/admin/*`` needs ``Authorization: Bearer <token>``, compared
  in constant time; anything else is 401 in the OpenAI error shape with ``WWW-Authenticate``.
  The dashboard page itself (HTML, JS, CSS: no data) is then served to anyone, because a browser
  cannot attach a bearer header to a navigation; the page reads the token from the URL fragment
  (``/dashboard#token=...``, never sent to a server, so never in an access log) and sends it on
  every state request.
- Without a token, the whole admin surface answers loopback clients only (403 otherwise; a
  client on a unix socket is a local process and counts as loopback), and
  only under a loopback ``Host`` (``localhost`` or a loopback address): a name an attacker
  controls that resolves to 127.0.0.1 (DNS rebinding) makes a page same-origin with the
  gateway, and the ``Host`` header is what still tells. Behind a reverse proxy on the same host
  every client looks like loopback: set a token there. Any local process (or any page, should
  a browser ever fail to send the headers above) can still act as admin in this mode.

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

from gateway.core.exchange import header
from gateway.errors import error_body

ADMIN_PREFIXES = ("/admin", "/dashboard")
# The non-simple header a state-changing admin request carries when it has no bearer token.
ADMIN_HEADER = b"x-shapegate-admin"
SAFE_METHODS = frozenset({"GET", "HEAD"})


def reload_command(url: str) -> str:
    """The shell command that applies an edited policy from the gateway's own machine, as
    ``shapegate demo`` and ``shapegate init`` print it: without an admin token, a POST needs the
    admin header; ``--fail-with-body`` makes a refusal a failed command, its reason printed."""
    return f"curl --fail-with-body -X POST -H '{ADMIN_HEADER.decode()}: 1' {url}/admin/reload"


FORBIDDEN: Literal["permission_error"] = "permission_error"


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


@dataclass(frozen=True, slots=True)
class AdminRequest:
    """What the guard reads of a request (header values decoded as latin-1, None if absent)."""

    path: str
    method: str = "GET"
    client_host: str | None = None
    host: str | None = None
    origin: str | None = None
    sec_fetch_site: str | None = None
    authorization: str | None = None
    admin_header: bool = False
    # Arrived on a unix socket (a worker's private one, gateway/edge/workers.py): a local process.
    unix_socket: bool = False

    @classmethod
    def from_scope(cls, scope: Scope) -> AdminRequest:
        def text(name: bytes) -> str | None:
            value = header(scope, name)
            return None if value is None else value.decode("latin-1")

        client = scope.get("client")
        server = scope.get("server")
        return cls(
            path=scope["path"],
            method=scope.get("method", "GET"),
            client_host=client[0] if client else None,
            host=text(b"host"),
            origin=text(b"origin"),
            sec_fetch_site=text(b"sec-fetch-site"),
            authorization=text(b"authorization"),
            admin_header=header(scope, ADMIN_HEADER) is not None,
            unix_socket=not client and server is not None and server[1] is None,
        )


def _split_host(value: str) -> tuple[str, str]:
    """``host[:port]`` -> (host, port), with IPv6 brackets removed; lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        return name, rest.removeprefix(":")
    name, _, port = value.partition(":")
    return name, port


def is_loopback_name(host_header: str | None) -> bool:
    """A ``Host`` that can only mean this machine: ``localhost`` or a loopback address."""
    if not host_header:
        return False
    name, _ = _split_host(host_header)
    return name == "localhost" or name.endswith(".localhost") or is_loopback(name)


def cross_site(req: AdminRequest) -> str | None:
    """Why the browser says this request comes from another site, or None."""
    site = (req.sec_fetch_site or "").strip().lower()
    if site and site not in ("same-origin", "none"):
        return f"Sec-Fetch-Site: {site}"
    if req.origin is not None:
        _, sep, rest = req.origin.strip().partition("://")
        if not sep or req.host is None or _split_host(rest) != _split_host(req.host):
            return f"Origin {req.origin.strip()[:100]!r} is not this gateway"
    return None


def admin_access(req: AdminRequest, token: str | None) -> Verdict:
    """May this request use the admin surface? Pure: the caller supplies every input."""
    admin = _under(req.path, "/admin")
    if not admin and not _under(req.path, "/dashboard"):
        return ALLOW
    # The dashboard's files hold no data (and refuse framing): a link from another site may
    # open the page; everything it then reads is under /admin.
    why = cross_site(req) if admin else None
    if why is not None:
        return Verdict(
            False, 403, f"cross-site requests to the admin surface are refused ({why})", FORBIDDEN
        )
    given = _bearer(req.authorization)
    if token is None:
        if not (req.unix_socket or is_loopback(req.client_host)):
            return Verdict(
                False,
                403,
                "admin endpoints answer loopback clients only; set server.admin_token to open them",
                FORBIDDEN,
            )
        if not is_loopback_name(req.host):
            return Verdict(
                False,
                403,
                "without server.admin_token, admin endpoints answer only a loopback Host "
                "(localhost, 127.0.0.1, [::1])",
                FORBIDDEN,
            )
    elif admin and not (given is not None and hmac.compare_digest(given.encode(), token.encode())):
        return Verdict(
            False,
            401,
            "admin endpoints need 'Authorization: Bearer <server.admin_token>'",
            "authentication_error",
        )
    if req.method not in SAFE_METHODS and given is None and not req.admin_header:
        return Verdict(
            False,
            403,
            f"{req.method} on the admin surface needs the bearer token or an "
            f"'{ADMIN_HEADER.decode()}' header",
            FORBIDDEN,
        )
    return ALLOW


class AdminGuard:
    """Raw ASGI middleware applying ``admin_access`` to HTTP requests.

    ``token_of`` is asked on every admin request, so a policy reload rotates the token at once.
    """

    def __init__(self, app: ASGIApp, token_of: Callable[[], str | None]) -> None:
        self._app = app
        self._token_of = token_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(ADMIN_PREFIXES):
            verdict = admin_access(AdminRequest.from_scope(scope), self._token_of())
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
