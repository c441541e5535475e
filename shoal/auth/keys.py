"""Tenants and their API keys in the catalog, and turning an Authorization header into a Principal.

Secrets are returned once, by `create_key`, and never stored or shown again: the catalog keeps a salted
scrypt hash. Verified keys are cached in process for `cache.CACHE_TTL_S` (30 s), so a revoked key may
still work for up to that long in processes other than the one that revoked it. After that the key's row is read
again; the KDF is not rerun for a secret the process already verified against the same stored hash.

While the catalog cannot be reached, a caller this process already knows keeps being served from the cache past
the TTL (so `eventual` searches of loaded indexes go on answering): the anonymous tenant for the whole outage, a
key for at most `cache.STALE_KEY_GRACE_S` (10 min) past its verdict's expiry. A key not verified before the outage
gets the outage's error (503), as does one whose verdict was a rejection.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from dataclasses import dataclass

from sqlalchemy import Engine, Select, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from shoal.auth.cache import FAILURE_TTL_S, TOUCH_INTERVAL_S, CachedKey, VerifiedKeys, cache_for, digest
from shoal.auth.hashing import (
    KEY_ID_HEX_DIGITS,
    dummy_hash,
    format_key,
    hash_secret,
    new_key_id,
    new_secret,
    parse_key,
    verify_secret,
)
from shoal.auth.limits import FailureLimiter
from shoal.auth.principal import Principal, Role
from shoal.catalog.db import catalog_unreachable
from shoal.catalog.models import ApiKey, Tenant
from shoal.errors import AlreadyExistsError, AuthenticationError, NotFoundError, ValidationError
from shoal.log.records import check_tenant_name, storable_text

log = logging.getLogger(__name__)

AUTH_SCHEME = "apikey"
SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,19}")
KEY_ID_RE = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX_DIGITS}}}")
MISSING_KEY = "missing API key: send the header 'Authorization: ApiKey <key>'"
MAX_KEY_NAME = 200
# The default role of the anonymous tenant: Vektonn clients send no key, and they upload as well as search.
# Whatever its role, an anonymous caller never deletes (shoal.auth.principal.require_key).
ANONYMOUS_ROLE = Role.WRITE


@dataclass(frozen=True)
class TenantRecord:
    """A tenant and how many unrevoked keys it has."""

    id: int
    name: str
    created_at: dt.datetime
    active_keys: int


@dataclass(frozen=True)
class KeyRecord:
    """An API key as listings show it: everything but the secret, which is never kept."""

    key_id: str
    tenant: str
    role: Role
    name: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked_at: dt.datetime | None

    @property
    def revoked(self) -> bool:
        """True once the key has been revoked; a revoked key never authenticates again."""
        return self.revoked_at is not None


def _key_record(row: ApiKey, tenant: str) -> KeyRecord:
    return KeyRecord(
        row.key_id, tenant, Role(row.role), row.name, row.created_at, row.last_used_at, row.revoked_at
    )


def _key_and_tenant(key_id: str) -> Select[tuple[ApiKey, str]]:
    return select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_id == key_id)


def _tenant_id(s: Session, name: str) -> int:
    found = s.scalars(select(Tenant.id).where(Tenant.name == check_tenant_name(name))).one_or_none()
    if found is None:
        raise NotFoundError(f"tenant {name!r} not found")
    return found


# -- tenants --------------------------------------------------------------------------------------------


def create_tenant(engine: Engine, name: str) -> int:
    """Create tenant `name` and return its id; InvalidNameError for a bad name, AlreadyExistsError if it exists.

    A tenant may also exist because a Python API or CLI call named it (they create their tenant on first use).
    """
    check_tenant_name(name)
    with Session(engine) as s, s.begin():
        created = s.execute(
            insert(Tenant).values(name=name).on_conflict_do_nothing(index_elements=["name"]).returning(Tenant.id)
        ).scalar_one_or_none()
    if created is None:
        raise AlreadyExistsError(f"tenant {name!r} already exists")
    return created


def list_tenants(engine: Engine) -> list[TenantRecord]:
    """Every tenant by name, with its count of unrevoked keys."""
    active = func.count(ApiKey.id).filter(ApiKey.revoked_at.is_(None))
    with Session(engine) as s:
        rows = s.execute(
            select(Tenant.id, Tenant.name, Tenant.created_at, active)
            .outerjoin(ApiKey, ApiKey.tenant_id == Tenant.id)
            .group_by(Tenant.id)
            .order_by(Tenant.name)
        ).all()
    return [TenantRecord(r[0], r[1], r[2], int(r[3])) for r in rows]


# -- keys -----------------------------------------------------------------------------------------------


def create_key(engine: Engine, tenant: str, role: str | Role, name: str = "") -> tuple[KeyRecord, str]:
    """Create a key of `tenant` with `role`; return its record and the plaintext key, which exists only here.

    NotFoundError if the tenant does not exist; ValidationError for an unknown role, or a name over 200 chars or
    that the catalog cannot store (a NUL, or a lone surrogate: a byte of a latin-1 terminal that is not UTF-8).
    """
    parsed_role = Role.parse(role)
    if not isinstance(name, str):
        raise ValidationError(f"key name must be a string, got {type(name).__name__}")
    if len(name) > MAX_KEY_NAME:
        raise ValidationError(f"key name is {len(name)} characters long; at most {MAX_KEY_NAME} are allowed")
    if not storable_text(name):
        raise ValidationError(
            f"key name must be valid Unicode without NUL characters (Postgres stores neither a lone surrogate nor "
            f"NUL), got {name!r}"
        )
    secret = new_secret()
    secret_hash = hash_secret(secret)  # before the transaction: the KDF must not hold a connection
    for attempt in range(3):
        key_id = new_key_id()
        try:
            with Session(engine) as s, s.begin():
                row = ApiKey(
                    tenant_id=_tenant_id(s, tenant),
                    key_id=key_id,
                    secret_hash=secret_hash,
                    role=parsed_role.value,
                    name=name,
                )
                s.add(row)
                s.flush()
                s.refresh(row)
                record = _key_record(row, tenant)
            return record, format_key(key_id, secret)
        except IntegrityError as exc:
            # 48 random bits: a key id collision is astronomically rare, but a retry costs nothing.
            if "uq_api_keys_key_id" not in str(exc.orig) or attempt == 2:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def list_keys(engine: Engine, tenant: str, *, include_revoked: bool = True) -> list[KeyRecord]:
    """The keys of `tenant`, oldest first, without secrets; NotFoundError if the tenant does not exist."""
    with Session(engine) as s:
        tenant_id = _tenant_id(s, tenant)
        q = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
        if not include_revoked:
            q = q.where(ApiKey.revoked_at.is_(None))
        return [_key_record(r, tenant) for r in s.scalars(q.order_by(ApiKey.created_at, ApiKey.id))]


def revoke_key(engine: Engine, key_id: str, *, tenant: str | None = None) -> KeyRecord:
    """Revoke `key_id` (idempotent: a revoked key keeps its first revocation time) and return its record.

    With `tenant`, only a key of that tenant is found (what a tenant-scoped route must pass); InvalidNameError
    (nothing changed) when `tenant` is no tenant name. NotFoundError for an unknown key, and for an id no key
    can have (not 12 lower-case hex digits). This process forgets the key at once; others within the
    verified-key cache's TTL.
    """
    if tenant is not None:
        check_tenant_name(tenant)  # asked of the catalog, a NUL or a number would fail as a driver error
    if not isinstance(key_id, str) or not KEY_ID_RE.fullmatch(key_id):
        # No key has such an id; asked of the catalog, a NUL or a lone surrogate would fail as a driver error.
        raise NotFoundError(f"API key {key_id!r} not found: key ids are {KEY_ID_HEX_DIGITS} lower-case hex digits")
    with Session(engine) as s, s.begin():
        q = _key_and_tenant(key_id)
        if tenant is not None:
            q = q.where(Tenant.name == tenant)
        found = s.execute(q.with_for_update(of=ApiKey)).one_or_none()
        if found is None:
            raise NotFoundError(f"API key {key_id!r} not found")
        row, tenant_name = found
        if row.revoked_at is None:
            row.revoked_at = s.scalar(select(func.now()))
        record = _key_record(row, tenant_name)
    cache_for(engine).evict_key(key_id)
    return record


# -- authentication -------------------------------------------------------------------------------------


def authenticate(
    engine: Engine,
    header_value: str | None,
    anonymous_tenant: str | None = None,
    *,
    cache: VerifiedKeys | None = None,
    anonymous_role: str | Role = ANONYMOUS_ROLE,
    client: str | None = None,
    limiter: FailureLimiter | None = None,
    failure_ttl_s: float = FAILURE_TTL_S,
) -> Principal:
    """The Principal an `Authorization` header value authenticates as; AuthenticationError otherwise.

    The header must read `ApiKey <key>` (scheme case-insensitive). Without a header (None or blank) the
    caller is `anonymous_tenant` with `anonymous_role` when one is given (the tenant is created if needed), and
    rejected otherwise. A header that is present but wrong is always rejected, never downgraded to
    anonymous. `cache` defaults to the process's shared cache for the engine's catalog.

    A rejected key is remembered for `failure_ttl_s`, and answered again without the KDF. With a `limiter`,
    every rejection counts against the `client` address, and an address over its limit gets RateLimitedError
    for any key not verified already: a cached good key costs nothing, so it still passes, and so does a key
    verified within the limiter's window before its verdict expired (a key the address used successfully keeps
    working for the rest of the window: `_check_limit`).
    """
    cache = cache if cache is not None else cache_for(engine)
    if header_value is None or not header_value.strip():
        if anonymous_tenant is None:
            raise AuthenticationError(MISSING_KEY)
        return _anonymous(engine, anonymous_tenant, Role.parse(anonymous_role), cache)
    address = client or "unknown"
    presented = _presented_counted(header_value, limiter, address)
    key_digest = digest(presented)
    entry = _cached(cache, key_digest, presented)
    if entry is not None:
        if cache.due_for_touch(entry):
            _touch(engine, entry.row_id)
        return entry.principal

    if limiter is not None:
        _check_limit(cache, limiter, key_digest, address)  # before anything that costs: the KDF, a catalog query
    try:
        return _verify(engine, cache, presented, key_digest, failure_ttl_s)
    except AuthenticationError:
        if limiter is not None:
            limiter.failed(address)
        raise


def screen(
    engine: Engine,
    header_value: str | None,
    anonymous_tenant: str | None = None,
    *,
    cache: VerifiedKeys | None = None,
    client: str | None = None,
    limiter: FailureLimiter | None = None,
) -> None:
    """Raise what `authenticate` would raise for this header when that is known without any I/O (no KDF, no
    catalog): AuthenticationError for a missing key without an anonymous tenant, a malformed header or a key
    rejected moments ago; RateLimitedError for an address over its limit presenting a key not verified
    recently. Counts the failure as `authenticate` would, so a caller answers the error instead of calling it.
    Returns when `authenticate` must decide (it may still refuse), e.g. before a request's body is read."""
    cache = cache if cache is not None else cache_for(engine)
    if header_value is None or not header_value.strip():
        if anonymous_tenant is None:
            raise AuthenticationError(MISSING_KEY)
        return
    address = client or "unknown"
    presented = _presented_counted(header_value, limiter, address)
    key_digest = digest(presented)
    if _cached(cache, key_digest, presented) is not None:
        return
    if limiter is not None:
        _check_limit(cache, limiter, key_digest, address)
    failed = cache.failure(key_digest)
    if failed is not None:
        if limiter is not None:
            limiter.failed(address)
        raise AuthenticationError(failed)


def _presented_counted(header_value: str, limiter: FailureLimiter | None, address: str) -> str:
    """The key a header presents; a malformed header is a failed authentication of `address` (429 when over)."""
    try:
        return _presented_key(header_value)
    except AuthenticationError:
        if limiter is not None:
            limiter.check(address)
            limiter.failed(address)
        raise


def _check_limit(cache: VerifiedKeys, limiter: FailureLimiter, key_digest: str, address: str) -> None:
    """RateLimitedError when `address` is over its limit, unless the key was verified within the limiter's window
    plus the cache's TTL: its verdict expired only because the TTL is shorter than the window, and a key an
    address used successfully keeps working (else 20 bogus keys from behind a shared proxy lock out everyone's
    keys once their verdicts expire). A key that fails verification loses that standing (put_failure)."""
    if not cache.verified_within(key_digest, cache.ttl_s + limiter.window_s):
        limiter.check(address)


def _cached(cache: VerifiedKeys, key_digest: str, presented: str) -> CachedKey | None:
    """The cached verdict on a presented key, checked to be about that key's id (a verdict about any other
    key is dropped: it must never authenticate this one)."""
    entry = cache.get(key_digest)
    if entry is None:
        return None
    parsed = parse_key(presented)
    if parsed is None or parsed.key_id != entry.principal.key_id:
        log.warning("dropped a cached key verdict that does not match the key presented")
        cache.evict_key(entry.principal.key_id or "")
        return None
    return entry


def _verify(engine: Engine, cache: VerifiedKeys, presented: str, key_digest: str, failure_ttl_s: float) -> Principal:
    """Check a presented key against the catalog (the KDF); a rejection is cached for `failure_ttl_s`. When the
    catalog cannot be reached, a verdict of this key that expired less than the cache's grace ago answers instead
    (the driver's error is raised when there is none)."""
    failed = cache.failure(key_digest)
    if failed is not None:
        raise AuthenticationError(failed)
    try:
        return _check_key(engine, cache, presented, key_digest)
    except AuthenticationError as exc:
        cache.put_failure(key_digest, str(exc), failure_ttl_s)
        raise
    except SQLAlchemyError as exc:
        stale = _stale_verdict(cache, key_digest, presented) if catalog_unreachable(exc) else None
        if stale is None:
            raise  # answered as the outage it is (503), or the error it is
        log.warning("the catalog is unreachable: API key %s authenticated from its expired cached verdict (%s)",
                    stale.key_id, exc.__class__.__name__)
        return stale


def _stale_verdict(cache: VerifiedKeys, key_digest: str, presented: str) -> Principal | None:
    """The principal of a key's expired verdict still within its grace, when it is about this very key; None
    otherwise (never seen, rejected, revoked here, or past the grace)."""
    entry = cache.stale(key_digest)
    if entry is None:
        return None
    parsed = parse_key(presented)
    if parsed is None or parsed.key_id != entry.principal.key_id:
        return None
    return entry.principal


def _check_key(engine: Engine, cache: VerifiedKeys, presented: str, key_digest: str) -> Principal:
    parsed = parse_key(presented)
    if parsed is None:
        raise AuthenticationError("malformed API key: expected shoal_<key id>_<secret>")
    with Session(engine) as s:
        found = s.execute(_key_and_tenant(parsed.key_id)).one_or_none()
    if found is None:
        verify_secret(parsed.secret, dummy_hash())  # same cost as a wrong secret: timing tells nothing
        raise AuthenticationError("invalid API key")
    row, tenant_name = found
    if not _secret_matches(cache, row.key_id, parsed.secret, row.secret_hash):
        raise AuthenticationError("invalid API key")
    # Told only to a caller holding the right secret, so it leaks nothing and helps the key's owner.
    if row.revoked_at is not None:
        raise AuthenticationError(f"API key {row.key_id} has been revoked")

    principal = Principal(tenant_name, row.tenant_id, Role(row.role), row.key_id)
    now = dt.datetime.now(dt.UTC)
    due = row.last_used_at is None or (now - row.last_used_at).total_seconds() >= TOUCH_INTERVAL_S
    if due:
        _touch(engine, row.id)
    cache.put(key_digest, principal, row.id, touched=True)
    return principal


def _secret_matches(cache: VerifiedKeys, key_id: str, secret: str, stored: str) -> bool:
    """True when `secret` is the one `stored` hashes: by the cache's proof when this process verified this secret
    against this very hash before (an HMAC: microseconds), else by the KDF (~50 ms), whose success is remembered.
    Without this, every key used less often than the verdicts' TTL pays the KDF on every request."""
    if cache.knows_secret(key_id, secret, stored):
        return True
    if not verify_secret(secret, stored):
        return False
    cache.remember_secret(key_id, secret, stored)
    return True


def cached_principal(
    engine: Engine,
    header_value: str | None,
    anonymous_tenant: str | None = None,
    anonymous_role: str | Role = ANONYMOUS_ROLE,
) -> Principal | None:
    """The Principal `authenticate` would return, when it is known without any I/O: a cached verdict on the key
    that is not due for its last-used write, or a cached anonymous tenant. None when `authenticate` must run
    (it may hash, query or write), so a caller on an event loop knows when to move the work to a thread."""
    cache = cache_for(engine)
    if header_value is None or not header_value.strip():
        if anonymous_tenant is None:
            return None
        tenant_id = cache.anonymous_id(anonymous_tenant)
        role = anonymous_role if type(anonymous_role) is Role else Role.parse(anonymous_role)
        return None if tenant_id is None else Principal(anonymous_tenant, tenant_id, role, None)
    try:
        presented = _presented_key(header_value)
    except AuthenticationError:
        return None
    entry = _cached(cache, digest(presented), presented)
    if entry is None or cache.clock() - entry.touched_at >= TOUCH_INTERVAL_S:
        return None
    return entry.principal


def _presented_key(header_value: str) -> str:
    parts = header_value.split()
    if parts[0].lower() != AUTH_SCHEME:
        # Echo the scheme only when it looks like one: a bare key sent without a scheme must not end up,
        # even in part, in an error message or a log.
        shown = f" {parts[0]!r}" if SCHEME_RE.fullmatch(parts[0]) else ""
        raise AuthenticationError(f"unsupported authorization scheme{shown}: send 'Authorization: ApiKey <key>'")
    if len(parts) != 2:
        raise AuthenticationError("malformed Authorization header: expected 'ApiKey <key>'")
    return parts[1]


def _anonymous(engine: Engine, tenant: str, role: Role, cache: VerifiedKeys) -> Principal:
    tenant_id = cache.anonymous_id(tenant)
    if tenant_id is None:
        check_tenant_name(tenant)
        try:
            tenant_id = _anonymous_tenant_id(engine, tenant)
        except SQLAlchemyError as exc:
            # A tenant's id never changes: one served before stays right for as long as the catalog is away.
            tenant_id = cache.stale_anonymous_id(tenant) if catalog_unreachable(exc) else None
            if tenant_id is None:
                raise
            log.warning("the catalog is unreachable: anonymous tenant %r served from its cached id (%s)",
                        tenant, exc.__class__.__name__)
            return Principal(tenant, tenant_id, role, None)
        cache.put_anonymous(tenant, tenant_id)
    return Principal(tenant, tenant_id, role, None)


def _anonymous_tenant_id(engine: Engine, tenant: str) -> int:
    """The id of tenant `tenant`, created on first use, as the Python API does for its tenant: the embedded
    default just works."""
    with Session(engine) as s, s.begin():
        s.execute(insert(Tenant).values(name=tenant).on_conflict_do_nothing(index_elements=["name"]))
        return s.scalars(select(Tenant.id).where(Tenant.name == tenant)).one()


def _touch(engine: Engine, row_id: int) -> None:
    # The WHERE makes concurrent processes write at most once a minute between them. Best effort: usage
    # bookkeeping must never fail a request whose key verified.
    try:
        with Session(engine) as s, s.begin():
            s.execute(
                update(ApiKey)
                .where(
                    ApiKey.id == row_id,
                    (ApiKey.last_used_at.is_(None))
                    | (ApiKey.last_used_at < func.now() - dt.timedelta(seconds=TOUCH_INTERVAL_S)),
                )
                .values(last_used_at=func.now())
            )
    except SQLAlchemyError as exc:
        log.warning("could not record the use of API key row %s: %s", row_id, exc)
