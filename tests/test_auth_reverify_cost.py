"""Re-verifying a key whose cached verdict expired, against a real Postgres: the key's row is read again
(revocation, role), but a secret this process already verified against the same stored hash costs no KDF; a wrong
secret, or a stored hash that changed, still goes through the KDF."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, text

from shoal import Shoal
from shoal.auth import AuthenticationError, Role, authenticate, create_key, create_tenant, hashing, revoke_key
from shoal.auth.cache import CACHE_TTL_S, VerifiedKeys
from shoal.config.settings import Settings


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class KdfCounter:
    """Counts the scrypt runs of shoal.auth.hashing (every hash and every verification goes through one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = hashing._scrypt

        def counted(secret: str, salt: bytes, n: int, r: int, p: int) -> bytes:
            self.calls += 1
            return real(secret, salt, n, r, p)

        monkeypatch.setattr(hashing, "_scrypt", counted)


@pytest.fixture
def engine(make_settings: Callable[..., Settings]) -> Iterator[Engine]:
    """The engine of a Shoal on the test catalog (migrated to the newest schema)."""
    client = Shoal(make_settings())
    yield client.engine
    client.close()


def _key(engine: Engine, role: str = "read") -> tuple[str, str]:
    """A key of a fresh tenant: its key id and its plaintext."""
    tenant = "reverify-" + uuid.uuid4().hex[:10]
    create_tenant(engine, tenant)
    record, plaintext = create_key(engine, tenant, role)
    return record.key_id, plaintext


def _sql(engine: Engine, statement: str, **params: object) -> None:
    with engine.begin() as conn:
        conn.execute(text(statement), params)


def _expired(clock: FakeClock) -> None:
    clock.now += CACHE_TTL_S + 1


def test_an_expired_verdict_is_renewed_without_the_kdf(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    key_id, plaintext = _key(engine, "read")
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=CACHE_TTL_S, clock=clock)
    kdf = KdfCounter(monkeypatch)
    header = f"ApiKey {plaintext}"
    assert authenticate(engine, header, cache=cache).key_id == key_id
    assert kdf.calls == 1  # the first verification pays
    for _ in range(3):
        _expired(clock)
        assert authenticate(engine, header, cache=cache).key_id == key_id
    assert kdf.calls == 1

    # The row is still read on each renewal: a changed role is honoured once the verdict expires.
    _sql(engine, "UPDATE api_keys SET role = 'write' WHERE key_id = :k", k=key_id)
    assert authenticate(engine, header, cache=cache).role is Role.READ  # the cached verdict, as before
    _expired(clock)
    assert authenticate(engine, header, cache=cache).role is Role.WRITE
    assert kdf.calls == 1


def test_a_wrong_secret_is_refused_and_pays_the_kdf(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    key_id, plaintext = _key(engine)
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=CACHE_TTL_S, clock=clock)
    kdf = KdfCounter(monkeypatch)
    authenticate(engine, f"ApiKey {plaintext}", cache=cache)
    _expired(clock)
    wrong = hashing.format_key(key_id, hashing.new_secret())
    before = kdf.calls
    with pytest.raises(AuthenticationError, match="invalid API key"):
        authenticate(engine, f"ApiKey {wrong}", cache=cache)
    assert kdf.calls == before + 1  # no proof for this secret: the KDF decided, as a first try would
    assert authenticate(engine, f"ApiKey {plaintext}", cache=cache).key_id == key_id  # the right one still works


def test_a_revoked_key_is_refused_once_its_verdict_expires(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    key_id, plaintext = _key(engine)
    clock = FakeClock()
    elsewhere = VerifiedKeys(ttl_s=CACHE_TTL_S, clock=clock)  # another process's cache: revoke_key cannot evict it
    kdf = KdfCounter(monkeypatch)
    header = f"ApiKey {plaintext}"
    authenticate(engine, header, cache=elsewhere)
    _expired(clock)
    authenticate(engine, header, cache=elsewhere)  # renewed by the proof
    assert kdf.calls == 1
    revoke_key(engine, key_id)
    _expired(clock)
    with pytest.raises(AuthenticationError, match="revoked"):
        authenticate(engine, header, cache=elsewhere)


def test_a_changed_stored_hash_falls_back_to_the_kdf(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    key_id, plaintext = _key(engine)
    secret = plaintext.split("_", 2)[2]
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=CACHE_TTL_S, clock=clock)
    header = f"ApiKey {plaintext}"
    rehashed, other = hashing.hash_secret(secret), hashing.hash_secret(hashing.new_secret())
    kdf = KdfCounter(monkeypatch)
    authenticate(engine, header, cache=cache)
    assert kdf.calls == 1

    # The same secret under a new salt (a rehash, say with new parameters): the KDF runs again, and accepts it.
    _sql(engine, "UPDATE api_keys SET secret_hash = :h WHERE key_id = :k", h=rehashed, k=key_id)
    _expired(clock)
    authenticate(engine, header, cache=cache)
    assert kdf.calls == 2
    _expired(clock)
    authenticate(engine, header, cache=cache)  # and the new hash's proof spares it from then on
    assert kdf.calls == 2

    # Rotated to another secret: the old secret's proof does not count, the KDF refuses it.
    _sql(engine, "UPDATE api_keys SET secret_hash = :h WHERE key_id = :k", h=other, k=key_id)
    _expired(clock)
    with pytest.raises(AuthenticationError, match="invalid API key"):
        authenticate(engine, header, cache=cache)
    assert kdf.calls == 3


def test_proofs_are_bounded_and_forgotten_on_eviction() -> None:
    cache = VerifiedKeys(max_entries=2)
    stored = "scrypt$16384$8$1$00$00"  # never hashed here: the proof only binds the secret to this string
    for key_id in ("000000000001", "000000000002", "000000000003"):
        cache.remember_secret(key_id, "secret-" + key_id, stored)
    assert not cache.knows_secret("000000000001", "secret-000000000001", stored)  # the oldest went first
    assert cache.knows_secret("000000000002", "secret-000000000002", stored)
    assert not cache.knows_secret("000000000002", "secret-000000000003", stored)
    assert not cache.knows_secret("000000000002", "secret-000000000002", stored + "0")
    cache.evict_key("000000000002")
    assert not cache.knows_secret("000000000002", "secret-000000000002", stored)
    assert cache.knows_secret("000000000003", "secret-000000000003", stored)
