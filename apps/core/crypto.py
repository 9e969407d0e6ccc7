"""Encryption at rest for provider credentials and resource secrets, and token hashing.

Fernet (AES-128-CBC + HMAC) from ``cryptography``; MultiFernet over
``CATACLOUD_ENCRYPTION_KEY`` so keys can be rotated (first key encrypts, all decrypt).
API and agent tokens are random 256-bit strings stored only as SHA-256 digests: they are
not guessable, so a slow password hash would add latency and no safety.
"""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings


@functools.cache
def _fernet() -> MultiFernet:
    return MultiFernet([Fernet(k.strip().encode()) for k in settings.CATACLOUD_ENCRYPTION_KEYS if k.strip()])


def encrypt_json(value: Any) -> str:
    return _fernet().encrypt(json.dumps(value).encode()).decode()


def decrypt_json(token: str) -> Any:
    if not token:
        return {}
    try:
        return json.loads(_fernet().decrypt(token.encode()))
    except InvalidToken as exc:  # wrong key: say so without printing anything secret
        raise RuntimeError("cannot decrypt a stored secret: is CATACLOUD_ENCRYPTION_KEY right?") from exc


def new_token(prefix: str) -> str:
    """A fresh bearer secret like ``cc_…`` (the prefix tells what kind of token it is)."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def encrypted(field: str, doc: str = "") -> Any:
    """A model property kept encrypted in the text field ``field``: a dict decrypted on use
    (``{}`` when unset), encrypted when set (an empty value clears the field). Never logged or
    returned by the API."""

    def get(obj: Any) -> Any:
        return decrypt_json(getattr(obj, field))

    def put(obj: Any, value: Any) -> None:
        setattr(obj, field, encrypt_json(value) if value else "")

    return property(get, put, doc=doc)
