"""Client API keys: optional, stored hashed, compared in constant time.

Keys come from ``auth.api_key_sha256`` (hex SHA-256 digests, so a policy file holds no secret)
and from the environment variable named by ``auth.api_keys_env`` (plain keys separated by
commas, hashed at start-up and never kept). With neither configured, the API is open.

``ClientAuth.check(header)`` takes the raw ``Authorization`` header and raises
``Unauthorized`` (401 in the OpenAI shape) unless it is ``Bearer <a known key>``. Every stored
digest is compared, with ``hmac.compare_digest``, whatever matches first, so the time taken says
nothing about which key nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from gateway.errors import Unauthorized
from gateway.settings import AuthSettings, ConfigError


class ClientAuth:
    def __init__(self, digests: frozenset[bytes]) -> None:
        self._digests = tuple(sorted(digests))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @classmethod
    def from_settings(
        cls, auth: AuthSettings, environ: Mapping[str, str] | None = None
    ) -> ClientAuth:
        environ = os.environ if environ is None else environ
        digests = {bytes.fromhex(h) for h in auth.api_key_sha256}
        if auth.api_keys_env:
            raw = environ.get(auth.api_keys_env)
            if not raw:
                raise ConfigError(
                    f"auth.api_keys_env: environment variable {auth.api_keys_env} is not set"
                )
            digests |= {
                hashlib.sha256(k.strip().encode()).digest() for k in raw.split(",") if k.strip()
            }
        return cls(frozenset(digests))

    def check(self, header: bytes | None) -> None:
        if not self._digests:
            return
        scheme, _, key = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not key.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        presented = hashlib.sha256(key.strip()).digest()
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        if not matched:
            raise Unauthorized("invalid API key")
