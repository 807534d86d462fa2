"""API keys: ``Authorization: Bearer KEY`` on every ``/v1`` request, ``/tokenize``, ``/detokenize`` and
``/version`` (and on ``/metrics`` when it has keys).

Keys come from ``--api-key`` (repeat it, or give several after one flag, for several keys) or, when no
flag gives one, from ``DDTREE_API_KEY`` (comma-separated). A key is compared in constant time (its SHA-256
digest against each configured one, all of them every time) and never appears in a log line or an error
body. ``/health`` and ``/ready`` stay open, for load balancers and orchestrators.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from ddtree.server.config import API_KEY_ENV
from ddtree.server.errors import APIError

KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/version"})  # vLLM's, outside /v1: keyed as /v1


def api_keys(flags: Iterable[str] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """The keys ``--api-key`` gives, else the comma-separated ``DDTREE_API_KEY``; blanks dropped."""
    given = list(flags or []) or env.get(API_KEY_ENV, "").split(",")
    return tuple(key.strip() for key in given if key.strip())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_access_warning(host: str, port: int, keys: tuple[str, ...]) -> str | None:
    """What to say at start-up when the server takes no key yet listens beyond this machine."""
    if keys or is_loopback(host):
        return None
    return (
        f"ddtree serve: warning: no API key, so anyone who can reach {host}:{port} can use this server; "
        f"set --api-key or ${API_KEY_ENV}"
    )


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyRing:
    """Configured keys, kept only as digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, presented: bytes) -> bool:
        digest = _digest(presented)
        matches = [hmac.compare_digest(digest, d) for d in self._digests]  # every one: no early exit
        return any(matches)


def unauthorized(missing: bool) -> APIError:
    message = (
        "this server needs an API key: send it as 'Authorization: Bearer KEY'"
        if missing
        else "the API key is not valid"
    )
    return APIError(
        401, message, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"}
    )


def bearer(scope: Scope) -> bytes | None:
    """The token of the request's ``Authorization: Bearer`` header, or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
    return None


class APIKeyMiddleware:
    """401 for a ``/v1`` (or ``KEYED_PATHS``, or keyed ``/metrics``) request without one of the keys; others
    pass through."""

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], metrics_api_keys: Iterable[str]) -> None:
        self.app = app
        self.keys = KeyRing(api_keys)
        self.metrics_keys = KeyRing(metrics_api_keys)

    def _ring(self, path: str) -> KeyRing | None:
        if path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS:
            return self.keys
        if path == "/metrics":
            return self.metrics_keys
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ring = self._ring(scope["path"]) if scope["type"] == "http" else None
        if ring:
            token = bearer(scope)
            if token is None or not ring.accepts(token):
                await unauthorized(token is None).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
