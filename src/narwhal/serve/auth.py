"""Who may call the router: API keys for the OpenAI routes (and, when asked, /metrics, /health
and /ready), one admin token for /admin. Only SHA-256 digests of the secrets are kept, and they
are compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

from narwhal.serve.errors import Forbidden, RouterError, Unauthorized

__all__ = ["Auth", "hash_secret"]


def hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _bearer(header: str) -> str | None:
    scheme, _, value = header.partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


class Auth:
    def __init__(self, api_key_hashes: tuple[bytes, ...], admin_token_hash: bytes | None) -> None:
        self.api_key_hashes = api_key_hashes
        self.admin_token_hash = admin_token_hash

    def client_allowed(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries one of the API keys (any value
        when none is configured)."""
        if not self.api_key_hashes:
            return True
        key = _bearer(authorization)
        if key is None:
            return False
        digest = hash_secret(key)
        # Compare against every key without stopping early: timing says nothing about which.
        matched = False
        for known in self.api_key_hashes:
            matched |= hmac.compare_digest(digest, known)
        return matched

    def admin_refusal(self, authorization: str) -> RouterError | None:
        """Why an admin call with this ``Authorization`` header is refused, or None."""
        if self.admin_token_hash is None:
            return Forbidden("admin endpoints are disabled (no admin token configured)")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            hash_secret(given.strip()), self.admin_token_hash
        ):
            return Unauthorized("admin token required")
        return None
