"""An in-process cache of verified keys, so a request pays the catalog once per key and TTL (and the KDF once per
key), and of rejected ones, so a key that failed is answered 401 again without hashing it for a short while.

Revocation is therefore seen by other processes within the TTL (30 s by default); the process that revokes
a key evicts it at once. Entries are keyed by a SHA-256 digest of the presented key, never the key itself.
When each key was last verified is kept past its verdict (`verified_within`), so a key that worked is not
refused by the failure limiter (shoal.auth.limits) when its verdict expires and it is verified again.
When a verdict expires the key is checked against the catalog again (revocation, role and tenant are re-read),
but a secret this process already verified with the KDF is recognised by a proof (`knows_secret`: an HMAC under a
random per-process key over the key id, the secret and the stored hash), so only the first check of a key pays
the KDF. A wrong secret or a changed stored hash has no proof, and pays it as before.
Every table is bounded (a flood of distinct keys evicts the oldest entries, never grows memory).

While the catalog cannot be reached, an expired verdict is kept and served (`stale`, `stale_anonymous_id`) rather
than refusing every caller with 503: an anonymous tenant's id for as long as the outage lasts (it never changes),
a key's verdict for at most STALE_KEY_GRACE_S past its expiry. A rejection is never served past its TTL.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from shoal.auth.hashing import secret_proof
from shoal.auth.principal import Principal

CACHE_TTL_S = 30.0
MAX_ENTRIES = 10_000
# Rejections are cached briefly: long enough that repeating a bad key costs no KDF, short enough that nothing
# a key's owner fixes (a typo, a tenant created late) waits long.
FAILURE_TTL_S = 10.0
MAX_FAILURES = 10_000
# last_used_at is bookkeeping for operators ("is this key still in use?"): minute precision is plenty,
# and one UPDATE per key per minute keeps the hot path read-only.
TOUCH_INTERVAL_S = 60.0
# How long past its expiry a key's verdict still authenticates while the catalog cannot be reached. The bound is
# how long a key revoked during an outage (in another process, which cannot tell this one) may keep working; ten
# minutes rides out a Postgres restart or failover, and keeps that window short. Past it the key gets 503.
STALE_KEY_GRACE_S = 600.0
# After a verdict is served stale, it is served again without asking the catalog for this long (the Retry-After
# outages answer with): an outage then costs one failed connection per key every few seconds, not one per request,
# and searches stay on the event loop's fast path (shoal.api.fastpath).
OUTAGE_RECHECK_S = 5.0


@dataclass
class CachedKey:
    """A verified key: who it authenticates as, its row, until when the verdict holds, when it was touched, and
    until when it may be served stale while the catalog cannot be reached (`VerifiedKeys.stale`)."""

    principal: Principal
    row_id: int
    expires_at: float
    touched_at: float
    stale_until: float


def digest(presented: str) -> str:
    """The cache key of a presented API key (a fast hash: the key itself must not sit in memory dumps)."""
    return hashlib.sha256(presented.encode()).hexdigest()


class VerifiedKeys:
    """A thread-safe TTL cache of verified keys and of anonymous tenants' ids."""

    def __init__(
        self,
        ttl_s: float = CACHE_TTL_S,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        stale_grace_s: float = STALE_KEY_GRACE_S,
    ) -> None:
        self.ttl_s = ttl_s
        self.stale_grace_s = stale_grace_s
        self.max_entries = max_entries
        self.clock = clock
        self._keys: dict[str, CachedKey] = {}
        self._failures: dict[str, tuple[str, float]] = {}  # digest -> (the 401's message, expires at)
        self._anonymous: dict[str, tuple[int, float]] = {}
        self._verified: dict[str, float] = {}  # digest -> when last verified, oldest first (outlives the verdict)
        # key id -> proof of the secret last verified for it (least recently used first). The proof key is made
        # here and never leaves memory: a proof is useless without it.
        self._proofs: dict[str, bytes] = {}
        self._proof_key = os.urandom(32)
        self._lock = threading.Lock()

    def get(self, key_digest: str) -> CachedKey | None:
        """The cached verdict for a key digest, or None when absent or expired (an expired one is kept, for
        `stale`, until pruned)."""
        with self._lock:
            entry = self._keys.get(key_digest)
            return entry if entry is not None and entry.expires_at > self.clock() else None

    def stale(self, key_digest: str) -> CachedKey | None:
        """The verdict for a key digest, expired or not, while it is within its grace (`stale_until`); None
        otherwise. Call only when the catalog cannot be reached: the verdict is then served without asking the
        catalog again for OUTAGE_RECHECK_S (never past its grace)."""
        now = self.clock()
        with self._lock:
            entry = self._keys.get(key_digest)
            if entry is None or entry.stale_until <= now:
                return None
            entry.expires_at = max(entry.expires_at, min(now + OUTAGE_RECHECK_S, entry.stale_until))
            return entry

    def put(self, key_digest: str, principal: Principal, row_id: int, touched: bool) -> None:
        """Remember a verified key for the TTL (and that it was verified now, for `verified_within`); `touched`
        says whether last_used_at was just written."""
        now = self.clock()
        with self._lock:
            self._verified.pop(key_digest, None)  # re-inserted last: the dict stays ordered by time
            while len(self._verified) >= self.max_entries:
                del self._verified[next(iter(self._verified))]
            self._verified[key_digest] = now
            if self.ttl_s <= 0:
                return
            if len(self._keys) >= self.max_entries:
                self._prune(now)
            self._keys[key_digest] = CachedKey(
                principal, row_id, now + self.ttl_s, now if touched else now - TOUCH_INTERVAL_S,
                now + self.ttl_s + self.stale_grace_s,
            )

    def verified_within(self, key_digest: str, seconds: float) -> bool:
        """True when the key was verified less than `seconds` ago and has not failed since (its verdict may have
        expired meanwhile)."""
        with self._lock:
            at = self._verified.get(key_digest)
            return at is not None and self.clock() - at < seconds

    def remember_secret(self, key_id: str, secret: str, stored: str) -> None:
        """Remember that `secret` matched the stored hash `stored` of key `key_id` (call only after the KDF said
        so), as a proof rather than the secret; bounded, the least recently used key is forgotten first."""
        proof = secret_proof(self._proof_key, key_id, secret, stored)
        with self._lock:
            self._proofs.pop(key_id, None)  # re-inserted last: the dict stays ordered by use
            while len(self._proofs) >= self.max_entries:
                del self._proofs[next(iter(self._proofs))]
            self._proofs[key_id] = proof

    def knows_secret(self, key_id: str, secret: str, stored: str) -> bool:
        """True only when `remember_secret` was told this very secret for `key_id` with this stored hash (constant
        time compare): the KDF would accept it. False for any other secret, hash or key (then run the KDF)."""
        proof = secret_proof(self._proof_key, key_id, secret, stored)
        with self._lock:
            known = self._proofs.get(key_id)
            if known is None or not hmac.compare_digest(known, proof):
                return False
            self._proofs[key_id] = self._proofs.pop(key_id)  # most recently used: evicted last
            return True

    def failure(self, key_digest: str) -> str | None:
        """The message a key was recently rejected with, or None when it was not (or the verdict expired)."""
        with self._lock:
            found = self._failures.get(key_digest)
            if found is None:
                return None
            if found[1] <= self.clock():
                del self._failures[key_digest]
                return None
            return found[0]

    def put_failure(self, key_digest: str, message: str, ttl_s: float = FAILURE_TTL_S) -> None:
        """Remember for `ttl_s` that a key was rejected with `message` (bounded: the oldest go first). The key
        no longer counts as verified recently (`verified_within`): revoked, it is limited like any other; nor is
        its former verdict served stale in an outage."""
        now = self.clock()
        with self._lock:
            self._verified.pop(key_digest, None)
            self._keys.pop(key_digest, None)
            if ttl_s <= 0:
                return
            if key_digest not in self._failures and len(self._failures) >= MAX_FAILURES:
                for k in [k for k, (_, until) in self._failures.items() if until <= now]:
                    del self._failures[k]
                while len(self._failures) >= MAX_FAILURES:  # dicts keep insertion order: the oldest first
                    del self._failures[next(iter(self._failures))]
            self._failures[key_digest] = (message, now + ttl_s)

    def due_for_touch(self, entry: CachedKey) -> bool:
        """True (and marks the entry touched) when the key's last_used_at should be written again."""
        now = self.clock()
        with self._lock:
            if now - entry.touched_at < TOUCH_INTERVAL_S:
                return False
            entry.touched_at = now
            return True

    def anonymous_id(self, tenant: str) -> int | None:
        """The cached id of an anonymous tenant, or None."""
        with self._lock:
            found = self._anonymous.get(tenant)
            return found[0] if found is not None and found[1] > self.clock() else None

    def stale_anonymous_id(self, tenant: str) -> int | None:
        """The id of an anonymous tenant, expired or not (a tenant's id never changes, and tenants are never
        deleted); None when it was never cached. Call only when the catalog cannot be reached: the id is then
        served without asking the catalog again for OUTAGE_RECHECK_S."""
        now = self.clock()
        with self._lock:
            found = self._anonymous.get(tenant)
            if found is None:
                return None
            self._anonymous[tenant] = (found[0], max(found[1], now + OUTAGE_RECHECK_S))
            return found[0]

    def put_anonymous(self, tenant: str, tenant_id: int) -> None:
        """Remember an anonymous tenant's id for the TTL (and, for `stale_anonymous_id`, past it)."""
        with self._lock:
            self._anonymous[tenant] = (tenant_id, self.clock() + self.ttl_s)

    def evict_key(self, key_id: str) -> None:
        """Forget every cached verdict for `key_id`, and its proof (after it is revoked)."""
        with self._lock:
            for k in [k for k, e in self._keys.items() if e.principal.key_id == key_id]:
                del self._keys[k]
            self._proofs.pop(key_id, None)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._keys.clear()
            self._failures.clear()
            self._anonymous.clear()
            self._verified.clear()
            self._proofs.clear()

    def _prune(self, now: float) -> None:
        for k in [k for k, e in self._keys.items() if e.stale_until <= now]:
            del self._keys[k]
        # Still full (many keys in use, or kept for an outage): drop the oldest half rather than grow unbounded;
        # expired verdicts go first.
        if len(self._keys) >= self.max_entries:
            oldest = sorted(self._keys, key=lambda k: self._keys[k].expires_at)
            for k in oldest[: len(oldest) // 2]:
                del self._keys[k]


_caches: dict[str, VerifiedKeys] = {}
_by_engine: weakref.WeakKeyDictionary[Engine, VerifiedKeys] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def cache_for(engine: Engine) -> VerifiedKeys:
    """The process's shared cache for the catalog `engine` points at (engines on one URL share it)."""
    found = _by_engine.get(engine)  # every request asks: rendering the URL each time costs more than the rest
    if found is not None:
        return found
    url = engine.url.render_as_string(hide_password=False)
    with _caches_lock:
        cache = _caches.get(url)
        if cache is None:
            cache = _caches[url] = VerifiedKeys()
        _by_engine[engine] = cache
        return cache
