"""Tenants and API keys against a real Postgres: hashing, authentication, roles, anonymous, isolation, CLI."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, text
from typer.testing import CliRunner, Result

from shoal import Shoal
from shoal.auth import (
    AuthenticationError,
    PermissionDeniedError,
    Principal,
    Role,
    authenticate,
    create_key,
    create_tenant,
    list_keys,
    list_tenants,
    require,
    revoke_key,
)
from shoal.auth import keys as keys_module
from shoal.auth.cache import VerifiedKeys
from shoal.catalog.db import alembic_config, migrate
from shoal.catalog.repo import Catalog
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.errors import AlreadyExistsError, InvalidNameError, NotFoundError, ValidationError

KEY_RE = re.compile(r"^shoal_[0-9a-f]{12}_[A-Za-z0-9_-]{43}$")


@pytest.fixture
def engine(make_settings: Callable[..., Settings]) -> Iterator[Engine]:
    """The engine of a Shoal on the test catalog (migrated to the newest schema)."""
    client = Shoal(make_settings())
    yield client.engine
    client.close()


def new_tenant(engine: Engine) -> str:
    name = "auth-" + uuid.uuid4().hex[:10]
    create_tenant(engine, name)
    return name


def fresh() -> VerifiedKeys:
    """A cache of its own, so a test sees the database's verdict rather than an earlier test's."""
    return VerifiedKeys()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- tenants and keys -----------------------------------------------------------------------------------


def test_tenants_and_keys_of_each_role(engine: Engine) -> None:
    name = new_tenant(engine)
    with pytest.raises(AlreadyExistsError, match="already exists"):
        create_tenant(engine, name)
    with pytest.raises(InvalidNameError):
        create_tenant(engine, "Not/A/Tenant")

    created = {role: create_key(engine, name, role, f"{role} key") for role in ("read", "write", "admin")}
    for role, (record, plaintext) in created.items():
        assert KEY_RE.fullmatch(plaintext)
        assert plaintext.startswith(f"shoal_{record.key_id}_")
        assert record.role == Role(role) and record.tenant == name and record.name == f"{role} key"
        assert record.last_used_at is None and not record.revoked

    listed = list_keys(engine, name)
    assert [k.key_id for k in listed] == [created[r][0].key_id for r in ("read", "write", "admin")]
    assert [k.role for k in listed] == [Role.READ, Role.WRITE, Role.ADMIN]
    assert next(t for t in list_tenants(engine) if t.name == name).active_keys == 3

    with pytest.raises(ValidationError, match="unknown role 'owner'"):
        create_key(engine, name, "owner")
    with pytest.raises(NotFoundError, match="tenant 'no-such-tenant' not found"):
        create_key(engine, "no-such-tenant", "read")
    with pytest.raises(NotFoundError):
        list_keys(engine, "no-such-tenant")


def test_the_secret_is_never_in_the_database(engine: Engine) -> None:
    name = new_tenant(engine)
    record, plaintext = create_key(engine, name, "write")
    secret = plaintext.split("_", 2)[2]
    with engine.connect() as conn:
        rows = [r[0] for r in conn.execute(text("SELECT k::text FROM api_keys k"))]
        stored = conn.execute(
            text("SELECT secret_hash FROM api_keys WHERE key_id = :k"), {"k": record.key_id}
        ).scalar_one()
    assert rows and not any(secret in row or plaintext in row for row in rows)
    assert stored.startswith("scrypt$")
    # Keys never share a salt, so equal secrets would still hash differently.
    create_key(engine, name, "write")
    with engine.connect() as conn:
        hashes = list(conn.execute(text("SELECT secret_hash FROM api_keys")).scalars())
    assert len(hashes) >= 2 and len({h.split("$")[4] for h in hashes}) == len(hashes)


# -- authentication -------------------------------------------------------------------------------------


def test_a_good_key_authenticates_in_any_scheme_case(engine: Engine) -> None:
    name = new_tenant(engine)
    record, plaintext = create_key(engine, name, "read")
    tenant_id = Catalog(engine, name).tenant_id
    for header in (f"ApiKey {plaintext}", f"apikey {plaintext}", f"APIKEY   {plaintext}  "):
        principal = authenticate(engine, header, cache=fresh())
        assert principal == Principal(name, tenant_id, Role.READ, record.key_id)
        assert not principal.anonymous


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("   ", "missing API key"),
        ("Bearer abc", "unsupported authorization scheme 'Bearer'"),
        ("Basic dXNlcjpwYXNz", "unsupported authorization scheme 'Basic'"),
        ("ApiKey", "malformed Authorization header"),
        ("ApiKey a b", "malformed Authorization header"),
        ("ApiKey not-a-key", "malformed API key"),
        ("ApiKey shoal_XYZ_abc", "malformed API key"),
        ("ApiKey shoal_000000000000_" + "A" * 43, "invalid API key"),
    ],
)
def test_bad_headers_are_rejected(engine: Engine, header: str | None, message: str) -> None:
    with pytest.raises(AuthenticationError, match=re.escape(message)):
        authenticate(engine, header, cache=fresh())


def test_a_wrong_secret_or_a_bare_key_is_rejected_without_echoing_the_secret(engine: Engine) -> None:
    name = new_tenant(engine)
    record, plaintext = create_key(engine, name, "admin")
    secret = plaintext.split("_", 2)[2]
    wrong = f"shoal_{record.key_id}_{'x' * 43}"
    with pytest.raises(AuthenticationError, match="^invalid API key$"):
        authenticate(engine, f"ApiKey {wrong}", cache=fresh())
    with pytest.raises(AuthenticationError, match="unsupported authorization scheme:") as bare:
        authenticate(engine, plaintext, cache=fresh())
    assert secret[:4] not in str(bare.value) and record.key_id not in str(bare.value)
    # A wrong secret must not poison the cache for the right one.
    cache = fresh()
    with pytest.raises(AuthenticationError):
        authenticate(engine, f"ApiKey {wrong}", cache=cache)
    assert authenticate(engine, f"ApiKey {plaintext}", cache=cache).key_id == record.key_id


def test_a_revoked_key_is_rejected(engine: Engine) -> None:
    name = new_tenant(engine)
    record, plaintext = create_key(engine, name, "write")
    header = f"ApiKey {plaintext}"
    assert authenticate(engine, header).key_id == record.key_id  # now in the process's shared cache

    revoked = revoke_key(engine, record.key_id)
    assert revoked.revoked and revoked.tenant == name
    # The revoking process forgets the key at once.
    with pytest.raises(AuthenticationError, match=f"API key {record.key_id} has been revoked"):
        authenticate(engine, header)
    # Revoking again changes nothing; listings show it revoked; it no longer counts as active.
    assert revoke_key(engine, record.key_id).revoked_at == revoked.revoked_at
    assert list_keys(engine, name)[0].revoked_at == revoked.revoked_at
    assert list_keys(engine, name, include_revoked=False) == []
    assert next(t for t in list_tenants(engine) if t.name == name).active_keys == 0
    with pytest.raises(NotFoundError):
        revoke_key(engine, "0123456789ab")


def test_other_processes_see_a_revocation_within_the_cache_ttl(engine: Engine) -> None:
    name = new_tenant(engine)
    record, plaintext = create_key(engine, name, "write")
    clock = FakeClock()
    elsewhere = VerifiedKeys(ttl_s=30, clock=clock)  # the cache of another process
    header = f"ApiKey {plaintext}"
    authenticate(engine, header, cache=elsewhere)
    revoke_key(engine, record.key_id)
    clock.now += 29
    assert authenticate(engine, header, cache=elsewhere).key_id == record.key_id  # the documented window
    clock.now += 2
    with pytest.raises(AuthenticationError, match="revoked"):
        authenticate(engine, header, cache=elsewhere)


def test_the_cache_spares_the_kdf(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    name = new_tenant(engine)
    _, plaintext = create_key(engine, name, "read")
    calls = []
    real = keys_module.verify_secret
    monkeypatch.setattr(keys_module, "verify_secret", lambda s, h: calls.append(1) or real(s, h))
    cache = fresh()
    for _ in range(5):
        authenticate(engine, f"ApiKey {plaintext}", cache=cache)
    assert len(calls) == 1


def test_last_used_at_is_written_at_most_once_a_minute(engine: Engine) -> None:
    name = new_tenant(engine)
    record, plaintext = create_key(engine, name, "read")
    header = f"ApiKey {plaintext}"

    def last_used() -> object:
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT last_used_at FROM api_keys WHERE key_id = :k"), {"k": record.key_id}
            ).scalar_one()

    authenticate(engine, header, cache=fresh())
    first = last_used()
    assert first is not None
    authenticate(engine, header, cache=fresh())  # a cache miss, but within the minute: no write
    assert last_used() == first

    with engine.begin() as conn:
        conn.execute(
            text("UPDATE api_keys SET last_used_at = now() - interval '2 minutes' WHERE key_id = :k"),
            {"k": record.key_id},
        )
    stale = last_used()
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=3600, clock=clock)
    authenticate(engine, header, cache=cache)
    touched = last_used()
    assert touched > stale  # type: ignore[operator]
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE api_keys SET last_used_at = now() - interval '2 minutes' WHERE key_id = :k"),
            {"k": record.key_id},
        )
    authenticate(engine, header, cache=cache)  # a cache hit within the minute: no write
    assert last_used() < touched  # type: ignore[operator]
    clock.now += 61
    authenticate(engine, header, cache=cache)  # a cache hit a minute later: written again
    assert last_used() >= touched  # type: ignore[operator]


# -- roles ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("held", list(Role))
@pytest.mark.parametrize("needed", list(Role))
def test_roles_form_a_hierarchy(held: Role, needed: Role) -> None:
    principal = Principal("t", 1, held, "0123456789ab")
    order = [Role.READ, Role.WRITE, Role.ADMIN]
    if order.index(held) >= order.index(needed):
        assert require(principal, needed) is principal
        assert require(principal, needed.value.upper()) is principal
    else:
        with pytest.raises(PermissionDeniedError, match=f"has role '{held.value}'; this operation needs"):
            require(principal, needed)


def test_keys_carry_their_role_into_the_principal(engine: Engine) -> None:
    name = new_tenant(engine)
    _, read_key = create_key(engine, name, "read")
    reader = authenticate(engine, f"ApiKey {read_key}", cache=fresh())
    require(reader, "read")
    with pytest.raises(PermissionDeniedError):
        require(reader, "write")
    with pytest.raises(ValidationError, match="unknown role"):
        require(reader, "superuser")


# -- anonymous ------------------------------------------------------------------------------------------


def test_the_anonymous_tenant_is_off_unless_named(engine: Engine) -> None:
    with pytest.raises(AuthenticationError, match="missing API key"):
        authenticate(engine, None, None, cache=fresh())

    anon = "anon-" + uuid.uuid4().hex[:8]
    principal = authenticate(engine, None, anon, cache=fresh())
    assert principal.anonymous and principal.key_id is None
    assert principal.tenant_name == anon and principal.role == Role.WRITE == "write"
    assert principal.tenant_id == Catalog(engine, anon).tenant_id  # created on first use
    assert authenticate(engine, "", anon).tenant_id == principal.tenant_id
    require(principal, "write")
    with pytest.raises(PermissionDeniedError, match="the anonymous tenant"):
        require(principal, "admin")

    # A header that is present but wrong is rejected, never downgraded to anonymous.
    with pytest.raises(AuthenticationError):
        authenticate(engine, "ApiKey shoal_000000000000_" + "A" * 43, anon, cache=fresh())
    with pytest.raises(InvalidNameError):
        authenticate(engine, None, "Bad Name", cache=fresh())


# -- isolation ------------------------------------------------------------------------------------------


def test_a_key_authenticates_as_its_own_tenant_only(engine: Engine) -> None:
    a, b = new_tenant(engine), new_tenant(engine)
    key_a, plain_a = create_key(engine, a, "admin")
    key_b, plain_b = create_key(engine, b, "admin")
    pa_ = authenticate(engine, f"ApiKey {plain_a}", cache=fresh())
    pb_ = authenticate(engine, f"ApiKey {plain_b}", cache=fresh())
    assert (pa_.tenant_name, pa_.tenant_id) == (a, Catalog(engine, a).tenant_id)
    assert (pb_.tenant_name, pb_.tenant_id) == (b, Catalog(engine, b).tenant_id)
    assert pa_.tenant_id != pb_.tenant_id

    # A's secret with B's key id is just a wrong secret.
    crossed = f"shoal_{key_b.key_id}_{plain_a.split('_', 2)[2]}"
    with pytest.raises(AuthenticationError, match="invalid API key"):
        authenticate(engine, f"ApiKey {crossed}", cache=fresh())

    assert [k.key_id for k in list_keys(engine, a)] == [key_a.key_id]
    assert [k.key_id for k in list_keys(engine, b)] == [key_b.key_id]
    # A tenant-scoped revocation cannot reach another tenant's key.
    with pytest.raises(NotFoundError):
        revoke_key(engine, key_a.key_id, tenant=b)
    assert authenticate(engine, f"ApiKey {plain_a}", cache=fresh()).tenant_name == a
    assert revoke_key(engine, key_a.key_id, tenant=a).revoked


# -- CLI ------------------------------------------------------------------------------------------------


runner = CliRunner()


@pytest.fixture
def cli_env(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SHOAL_* variables pointing the CLI at the test catalog; no stray shoal.toml."""
    monkeypatch.chdir(tmp_path)
    for var in ("SHOAL_CONFIG", "SHOAL_TENANT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SHOAL_DATABASE_URL", pg_url)
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path / "data"))


def shoal_cli(*args: str, code: int = 0) -> Result:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    return result


def test_cli_round_trip(cli_env: None, engine: Engine) -> None:
    name = "cli-" + uuid.uuid4().hex[:10]
    assert f"Tenant {name} created" in shoal_cli("tenant", "create", name).stdout
    again = shoal_cli("tenant", "create", name, code=1)
    assert again.stderr.startswith("error: ") and "already exists" in again.stderr
    assert "invalid tenant name" in shoal_cli("tenant", "create", "Bad Name", code=1).stderr

    created = shoal_cli("key", "create", "--tenant", name, "--role", "WRITE", "--name", "ingest job")
    plaintext = created.stdout.strip()
    assert KEY_RE.fullmatch(plaintext), created.stdout  # the key alone on stdout, for $(...)
    assert "cannot be shown again" in created.stderr and "role write" in created.stderr
    principal = authenticate(engine, f"ApiKey {plaintext}", cache=fresh())
    assert principal.tenant_name == name and principal.role == Role.WRITE

    listed = json.loads(shoal_cli("key", "list", "--tenant", name, "--json").stdout)
    assert [(k["key_id"], k["role"], k["name"], k["revoked_at"]) for k in listed] == [
        (principal.key_id, "write", "ingest job", None)
    ]
    assert plaintext.split("_", 2)[2] not in shoal_cli("key", "list", "--tenant", name).stdout
    tenants = json.loads(shoal_cli("tenant", "list", "--json").stdout)
    assert {"name": name, "active_keys": 1}.items() <= next(t for t in tenants if t["name"] == name).items()
    assert name in shoal_cli("tenant", "list").stdout

    assert "revoked" in shoal_cli("key", "revoke", principal.key_id or "").stdout
    with pytest.raises(AuthenticationError, match="revoked"):
        authenticate(engine, f"ApiKey {plaintext}", cache=fresh())
    assert "not found" in shoal_cli("key", "revoke", "0123456789ab", code=1).stderr
    assert "tenant 'nobody-here' not found" in shoal_cli(
        "key", "create", "--tenant", "nobody-here", "--role", "read", code=1
    ).stderr
    shoal_cli("key", "create", "--tenant", name, "--role", "owner", code=2)


# -- schema ---------------------------------------------------------------------------------------------


def test_the_api_keys_migration_matches_the_models_and_goes_down_and_up(fresh_db: str) -> None:
    migrate(fresh_db)
    cfg = alembic_config(fresh_db)
    command.check(cfg)
    command.downgrade(cfg, "0002")
    command.upgrade(cfg, "head")
    command.check(cfg)
