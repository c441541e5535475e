"""The key format and how secrets are hashed and checked. Standard library only.

A key reads `shoal_<key_id>_<secret>`: the key id (12 hex digits) is public and finds the row; the secret
(`secrets.token_urlsafe(32)`, 256 random bits) is shown once and only its salted scrypt hash is stored.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "shoal"
KEY_ID_HEX_DIGITS = 12
# The secret part is bounded so a hostile header cannot make the KDF hash megabytes.
KEY_RE = re.compile(rf"^{KEY_PREFIX}_([0-9a-f]{{{KEY_ID_HEX_DIGITS}}})_([A-Za-z0-9_-]{{16,128}})$")

# scrypt at n=2**14, r=8 costs 16 MiB and ~50 ms: expensive for anyone who steals the table. A process pays it
# once per key, not once per verdict: after it, `secret_proof` (an HMAC, microseconds) re-checks the same secret
# when the cached verdict expires (shoal.auth.cache), else a key used less often than the cache's TTL would cost
# the KDF on every request. The parameters are stored with each hash, so they can change.
SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
SCHEME = "scrypt"


@dataclass(frozen=True)
class ParsedKey:
    """A syntactically valid key split into its public id and its secret."""

    key_id: str
    secret: str


def new_key_id() -> str:
    """A fresh random key id: 12 lower-case hex digits."""
    return secrets.token_hex(KEY_ID_HEX_DIGITS // 2)


def new_secret() -> str:
    """A fresh random secret with 256 bits of entropy."""
    return secrets.token_urlsafe(32)


def format_key(key_id: str, secret: str) -> str:
    """The key as the user gets it: `shoal_<key_id>_<secret>`."""
    return f"{KEY_PREFIX}_{key_id}_{secret}"


def parse_key(text: str) -> ParsedKey | None:
    """The key id and secret of `text`, or None when it is not a well-formed key."""
    match = KEY_RE.fullmatch(text)
    return ParsedKey(match.group(1), match.group(2)) if match else None


def _scrypt(secret: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, dklen=HASH_BYTES, maxmem=64 * 1024 * 1024)


def hash_secret(secret: str) -> str:
    """A self-describing salted hash of `secret`: `scrypt$n$r$p$<salt hex>$<hash hex>`."""
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(secret, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    return f"{SCHEME}${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digest.hex()}"


def verify_secret(secret: str, stored: str) -> bool:
    """True when `secret` hashes to `stored` (constant-time compare); False for any unreadable `stored`."""
    try:
        scheme, n, r, p, salt_hex, digest_hex = stored.split("$")
        if scheme != SCHEME:
            return False
        expected = bytes.fromhex(digest_hex)
        actual = _scrypt(secret, bytes.fromhex(salt_hex), int(n), int(r), int(p))
    except ValueError:
        return False
    return hmac.compare_digest(actual, expected)


def secret_proof(proof_key: bytes, key_id: str, secret: str, stored: str) -> bytes:
    """An HMAC-SHA256 under `proof_key` of a key id, a secret and the key's stored hash: equal proofs mean the
    same secret for the same key and the same stored hash. Only as secret as `proof_key`, which must be random
    and never leave the process: with it, a proof can be brute-forced far faster than the KDF."""
    # NUL never occurs in a key id, a secret (KEY_RE) or a stored hash: the fields cannot run into each other.
    message = "\0".join((key_id, secret, stored)).encode()
    return hmac.new(proof_key, message, hashlib.sha256).digest()


@functools.cache
def dummy_hash() -> str:
    """A hash no key matches. Checked when the key id is unknown, so a miss costs what a wrong secret costs
    and response times do not tell which key ids exist. Made on first use: import stays cheap."""
    return hash_secret(new_secret())
