"""Settings from SHOAL_* environment variables and an optional TOML file, through pydantic-settings."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

import platformdirs
from pydantic import AfterValidator, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from shoal.errors import ConfigurationError

# The request body budget per point of SHOAL_MAX_BATCH_POINTS when SHOAL_MAX_BODY_BYTES is unset: a point with
# a 64-dimensional vector and a few attributes is about 1 KiB of JSON (a 256-dimensional one in Arrow).
BODY_BYTES_PER_POINT = 1024


# The embedded default's tenant for requests without a key: never the CLI's own (`default`), so a keyless
# caller cannot touch what the CLI created.
ANONYMOUS_TENANT = "anonymous"

# Every duration setting is at most 100 years: durations are added to the clock (datetime and timedelta
# arithmetic, catalog timestamps, Redis expiries in milliseconds) and passed to Event.wait (at most
# threading.TIMEOUT_MAX, about 292 years), and a larger one overflows one of them (OverflowError, or a Redis
# or Postgres error on every operation that uses it) long after startup accepted it.
MAX_DURATION_S = 3_155_760_000  # 100 years of 365.25 days
MAX_DURATION_DAYS = 36_525
# PostgreSQL's lock_timeout is an integer number of milliseconds.
MAX_LOCK_TIMEOUT_MS = 2**31 - 1
# Counts and sizes reach the catalog (bigint) and numpy (int64).
MAX_COUNT = 2**63 - 1
# Redis takes an expiry in whole milliseconds and refuses 0, so a shorter TTL would fail every enqueue.
MIN_PENDING_TTL_S = 0.001
# HNSW ef_construction an index may ask for (shoal.engines.hnsw's limit, which settings cannot import).
MAX_EF_CONSTRUCTION = 1 << 16


def _group_name(group: str) -> str:
    """A consumer group name whose queue cannot be another group's dead-letter queue (`{group}.dead`) or
    processing list (`{queue}.processing.{consumer}`)."""
    parts = group.split(".")
    if (len(parts) > 1 and parts[-1] == "dead") or "processing" in parts[1:]:
        raise ValueError("a group name may not end in '.dead' nor hold '.processing' (the names of a group's "
                         "dead-letter queue and processing lists)")
    return group


def _at_most(limit: int, shown: str) -> AfterValidator:
    """A check that a setting is at most `limit`; its error says the bound as `shown` (with its unit)."""

    def check(value: float | None) -> float | None:
        if value is not None and value > limit:
            raise ValueError(f"must be at most {shown}")
        return value

    return AfterValidator(check)


_YEARS = "100 years"
Seconds = Annotated[float, _at_most(MAX_DURATION_S, f"{MAX_DURATION_S} s ({_YEARS})")]
WholeSeconds = Annotated[int, _at_most(MAX_DURATION_S, f"{MAX_DURATION_S} s ({_YEARS})")]
Millis = Annotated[int, _at_most(MAX_DURATION_S * 1000, f"{MAX_DURATION_S * 1000} ms ({_YEARS})")]
Days = Annotated[float, _at_most(MAX_DURATION_DAYS, f"{MAX_DURATION_DAYS} days ({_YEARS})")]
Count = Annotated[int, _at_most(MAX_COUNT, f"{MAX_COUNT} (a 64-bit integer)")]


def config_file() -> Path | None:
    """The TOML file named by SHOAL_CONFIG, else ./shoal.toml when present.

    A file SHOAL_CONFIG names must exist (ConfigurationError otherwise): pydantic-settings skips a missing
    one, so a typo would silently fall back to the defaults, and to the embedded catalog.
    """
    named = os.environ.get("SHOAL_CONFIG")
    if named:
        path = Path(named)
        if not path.exists():
            raise ConfigurationError(f"invalid settings: SHOAL_CONFIG: no such file: {named}")
        if not path.is_file():
            raise ConfigurationError(f"invalid settings: SHOAL_CONFIG: not a file: {named}")
        return path
    local = Path("shoal.toml")
    return local if local.is_file() else None


class Settings(BaseSettings):
    """Everything Shoal can be told. Environment beats the config file, which beats the defaults."""

    # No float setting may be inf or NaN (1e400 reads as inf): every one is a duration, ratio or gate. Inputs are
    # never part of an error: a refused URL may carry a password or key (each check names what is wrong itself).
    model_config = SettingsConfigDict(
        env_prefix="SHOAL_", extra="forbid", allow_inf_nan=False, hide_input_in_errors=True
    )

    data_dir: Path = Field(
        default_factory=lambda: Path(platformdirs.user_data_dir("shoal")),
        description="Home of the embedded servers and of local storage.",
    )
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL of the catalog; unset starts an embedded Postgres."
    )
    redis_url: str | None = Field(
        default=None, description="Redis URL of the broker; unset starts an embedded Valkey."
    )
    storage_uri: str | None = Field(
        default=None,
        description="Local directory (a path, ~ expanded, or file:///path) or s3://bucket/prefix; unset means "
        "DATA_DIR/storage. A local one is read as an absolute path.",
    )
    s3_endpoint_url: str | None = None
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str = "us-east-1"
    tenant: str = Field(default="default", description="Tenant of the Python API and CLI.")
    anonymous_tenant: str | None = Field(
        default=None,
        description="Tenant of HTTP requests without an API key; unset: 'anonymous' when the catalog is "
        "embedded, else none; empty string: never. Anonymous callers never delete.",
    )
    anonymous_role: Literal["read", "write"] = Field(
        default="write", description="Role of requests without an API key (write: upload and create, never delete)."
    )
    allow_anonymous_writes: bool = Field(
        default=False,
        description="Let `shoal api` serve anonymous writes on an address beyond loopback (refused otherwise).",
    )
    metrics_token: str | None = Field(
        default=None,
        description="Bearer token that lets a scraper see /metrics of every tenant (labels included).",
    )
    auth_failure_limit: Count = Field(
        default=20, ge=0, description="Failed authentications per client address and window before 429 (0: off)."
    )
    auth_failure_window_s: Seconds = Field(
        default=60.0, gt=0, description="Window over which failed authentications per client address are counted."
    )
    auth_failure_cache_s: Seconds = Field(
        default=10.0, ge=0, description="How long a rejected API key is answered 401 without hashing it again."
    )
    db_pool_size: Count = Field(
        default=5, ge=1, description="Catalog connections one process keeps open (shared by every tenant)."
    )
    db_max_overflow: Count = Field(
        default=5, ge=0, description="Catalog connections one process may open beyond the pool under load."
    )
    searcher_cache_bytes: Count = Field(
        default_factory=lambda: _half_of_memory(),
        ge=1 << 20,
        description="Memory budget of a process's loaded index segments and young tiers (writes not built yet, "
        "searched exactly); least recently searched indexes are unloaded to stay under it (default: half the "
        "machine's memory).",
    )
    placement_file: Path | None = Field(
        default=None,
        description="YAML file naming which searcher processes (nodes) serve which shards of which indexes "
        "(config/placement.yaml.example); unset: every API process serves every shard it is asked for.",
    )
    node: str | None = Field(
        default=None,
        description="This process's name among the placement file's nodes: it loads only the shards placed on "
        "it and fans out for the rest; unset: it serves no placed shard itself and fans out for all of them.",
    )
    fanout_timeout_s: Seconds = Field(
        default=10.0, gt=0,
        description="How long a fanned-out search waits for another node's answer before calling its shards "
        "unavailable.",
    )
    fanout_hedge_s: Seconds = Field(
        default=1.0, ge=0,
        description="How long a fanned-out search waits for a node's part before also asking the next replica "
        "listed for its shards (the first answer is taken; at most half SHOAL_FANOUT_TIMEOUT_S); 0: a replica is "
        "asked only when a node fails.",
    )
    searcher_poll_s: Seconds = Field(
        default=1.0, gt=0, description="How often searchers check the catalog for new versions and dropped indexes."
    )
    young_tier_max_seqs: Count = Field(
        default=20_000, ge=0,
        description="Log entries past an index's built watermark that a searcher keeps decoded and searches "
        "exactly for eventual queries (the young tier; 0: eventual serves built segments only). Entries "
        "beyond it wait for the workers' builds.",
    )
    max_batch_points: Count = Field(default=100_000, ge=1, description="Largest batch one upload may carry.")
    # Checked before any body is parsed (413): parsing is what costs, so a limit checked after it protects nothing.
    max_body_bytes: Count | None = Field(
        default=None, ge=1,
        description="Largest request body any route reads, checked before parsing (413); unset: max_batch_points "
        f"x {BODY_BYTES_PER_POINT} bytes (about 100 MB at the default 100,000 points).",
    )
    max_query_vectors: Count = Field(default=1_000, ge=1, description="Most query vectors one search may carry.")
    max_search_hits: Count = Field(
        default=100_000, ge=1,
        description="Most hits one search over HTTP may return: query vectors x k, k counted up to the rows the "
        "index holds (so a k past every row is fine on a small index); a search that could return more is "
        "refused (400) before it runs.",
    )
    group_commit_max_points: Count = Field(
        default=200_000, ge=1, description="Most points that concurrent uploads may share in one segment."
    )
    commit_retries: Count = Field(default=3, ge=1, description="Attempts at a commit whose outcome is unknown.")
    lock_timeout_ms: int = Field(
        default=30_000, ge=1, le=MAX_LOCK_TIMEOUT_MS,
        description="Catalog lock wait before giving up (PostgreSQL's lock_timeout: at most 2147483647 ms).",
    )
    sweep_interval_s: Seconds = Field(default=10.0, gt=0, description="How often beat sweeps for lagging shards.")
    lease_seconds: Seconds = Field(
        default=30.0, gt=0,
        description="How long a shard build lease lasts without renewal (a dead worker's lease expires).",
    )
    lease_heartbeat_s: Seconds = Field(
        default=10.0, gt=0,
        description="How often a worker renews the lease of the shard it builds (at most a third of "
        "lease_seconds).",
    )
    task_visibility_timeout_s: Seconds = Field(
        default=3600.0, gt=0, description="Broker redelivers an unacknowledged task after this long."
    )
    pending_ttl_s: Seconds = Field(
        default=120.0, ge=MIN_PENDING_TTL_S,
        description="How long a queued-task mark coalesces commits (a Redis expiry: at least 1 ms).",
    )
    max_segments: Count = Field(default=8, ge=1, description="Segments per shard before a merge is due.")
    min_merge_segments: Count = Field(
        default=4, ge=2,
        description="A merge that too many segments make due takes at least this many, the smallest ones.",
    )
    worker_nice: int = Field(
        default=2, ge=0, le=19,
        description="CPU priority (nice value) of worker processes: builds and merges yield the CPU to "
        "searchers, the API and producers on the same host (0: no lower than they are started).",
    )
    quick_build_backlog_seqs: Count = Field(
        default=5_000, ge=0,
        description="A materialization that finds at least this many log entries to build (ingest outruns the "
        "builds) builds its HNSW segment quickly, at SHOAL_QUICK_EF_CONSTRUCTION; merges rebuild quick segments "
        "at the index's own parameters once the shard has no such backlog (0: never build quickly).",
    )
    quick_ef_construction: int = Field(
        default=40, ge=1, le=MAX_EF_CONSTRUCTION,
        description="ef_construction of quickly built HNSW segments (see the setting above).",
    )
    quick_window_s: Seconds = Field(
        default=10.0, ge=0,
        description="A shard with quick segments stays busy (its builds and merges stay quick) while its data "
        "source took at least SHOAL_QUICK_BUILD_BACKLOG_SEQS entries in the last this many seconds; its quick "
        "segments are rebuilt at full quality once it takes fewer (0: as soon as there is no backlog).",
    )
    max_deleted_ratio: float = Field(default=0.3, gt=0, le=1, description="Dead rows in a segment before a merge.")
    merge_interval_s: Seconds = Field(
        default=60.0, ge=0, description="How often beat looks for due segment merges (0: never by beat)."
    )
    # Log compaction, retention and garbage collection (beat sweeps; 0 turns a sweep off).
    compaction_interval_s: Seconds = Field(
        default=300.0, ge=0, description="How often beat looks for logs worth compacting (0: never by beat)."
    )
    compaction_target_bytes: Count = Field(
        default=64 << 20, ge=1, description="Size compaction merges small log segments toward."
    )
    compaction_min_seqs: Count = Field(
        default=10_000, ge=1, description="New seqs below the lowest index watermark before the sweep compacts a log."
    )
    tombstone_retention_s: Seconds = Field(
        default=86_400.0, ge=0, description="How long compaction keeps a tombstone every index is already past."
    )
    retention_interval_s: Seconds = Field(
        default=3_600.0, ge=0, description="How often beat expires points past retention_days (0: never by beat)."
    )
    gc_interval_s: Seconds = Field(
        default=600.0, ge=0, description="How often beat deletes unreferenced files (0: never by beat)."
    )
    gc_grace_s: Seconds = Field(
        default=3_600.0, ge=0, description="How long an unreferenced file stays before GC deletes it."
    )
    # The trash (soft-deleted datasets) and its purge.
    trash_retention_days: Days = Field(
        default=30.0, ge=0, description="How long a soft-deleted dataset stays restorable before the purge."
    )
    purge_interval_s: Seconds = Field(
        default=3600.0, ge=0, description="How often beat purges trashed datasets whose retention ended (0: never)."
    )
    # Message intake (`shoal consume`) and its backpressure.
    intake_exchange: str = Field(default="shoal.intake", description="Durable topic exchange publishers send to.")
    intake_group: Annotated[str, AfterValidator(_group_name)] = Field(
        default="default", pattern=r"^[A-Za-z0-9_.-]{1,100}$", description="Consumer group: one queue per group."
    )
    intake_binding: str = Field(default="#", description="Routing-key pattern the group's queue is bound with.")
    intake_max_points: Count = Field(default=10_000, ge=1, description="Points gathered before one log commit.")
    intake_max_wait_ms: Millis = Field(default=200, ge=1, description="Longest wait for a commit to fill up.")
    intake_prefetch: Count = Field(default=2_000, ge=1, description="Unacknowledged messages a consumer may hold.")
    intake_visibility_timeout_s: Seconds = Field(
        default=300.0, gt=0, description="Broker redelivers a message a dead consumer held after this long."
    )
    max_index_lag_seqs: Count = Field(
        default=1_000_000,
        ge=0,
        description="Backpressure bound: index lag (head - built watermark) that slows intake and makes "
        "HTTP uploads answer 429 (0: no bound).",
    )
    backpressure_retry_after_s: WholeSeconds = Field(
        default=5, ge=1, description="Retry-After of a 429 under backpressure."
    )
    # Reindexing: new generations built aside and swapped in (shoal.index.reindex).
    reindex_recall_gate: float = Field(
        default=0.95, ge=0, le=1, description="recall@10 an ANN generation needs before it is swapped in."
    )
    reindex_keep_s: Seconds = Field(
        default=86_400.0, ge=0, description="How long the generation a reindex replaced is kept for rollback."
    )
    version_keep_s: Seconds = Field(
        default=86_400.0, ge=0, description="How long superseded index versions stay searchable (time travel)."
    )
    generations_interval_s: Seconds = Field(
        default=600.0, ge=0, description="How often beat drops expired generations (0: never by beat)."
    )

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("storage_uri")
    @classmethod
    def _storage_location(cls, value: str | None) -> str | None:
        # Resolved here, once, so every process (and child process) of a deployment means the same directory.
        return storage_location(value) if value else value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_endpoint_url(cls, value: str | None) -> str | None:
        return check_s3_endpoint_url(value) if value else value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        # Checked at startup: a malformed URL failed later, inside the first catalog connection, as a traceback.
        return check_database_url(value) if value else value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        # Checked at startup: a malformed URL failed later, in whatever first printed or opened it, as a traceback.
        return check_redis_url(value) if value else value

    @field_validator("anonymous_tenant")
    @classmethod
    def _anonymous_name(cls, value: str | None) -> str | None:
        from shoal.log.records import check_tenant_name

        return check_tenant_name(value) if value else value

    @property
    def resolved_anonymous_tenant(self) -> str | None:
        """The anonymous tenant in effect: the one named; else `anonymous` (never the CLI's tenant) in the
        embedded default, none otherwise."""
        if self.anonymous_tenant is not None:
            return self.anonymous_tenant or None
        return ANONYMOUS_TENANT if self.database_url is None else None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = config_file()
        if path is not None:
            sources.append(_toml_source(settings_cls, path))
        return tuple(sources)

    @property
    def body_limit_bytes(self) -> int:
        """The request body limit in effect: max_body_bytes, else max_batch_points x BODY_BYTES_PER_POINT."""
        return self.max_body_bytes or self.max_batch_points * BODY_BYTES_PER_POINT

    @property
    def resolved_storage_uri(self) -> str:
        """Where the log lives: the configured URI or the data directory's storage folder."""
        return self.storage_uri or str(self.data_dir / "storage")

    def child_env(self) -> dict[str, str]:
        """This process's environment, with SHOAL_* replaced so that a child process builds these Settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        for name, value in self.model_dump().items():
            if value is not None:
                env[f"SHOAL_{name.upper()}"] = str(value)
        return env

    def describe(self) -> dict[str, Any]:
        """Settings as shown to an operator: secrets and passwords inside URLs masked."""
        shown = self.model_dump(mode="json")
        for secret in ("s3_secret_key", "metrics_token"):
            if shown.get(secret):
                shown[secret] = "***"
        for name in ("database_url", "redis_url", "s3_endpoint_url"):
            if shown.get(name):
                shown[name] = mask_url(shown[name])
        # Credentials in an s3:// URI are refused (storage_location); masked anyway, should one get this far.
        if str(shown.get("storage_uri") or "").startswith("s3://"):
            shown["storage_uri"] = mask_url(shown["storage_uri"])
        return shown


# The URL schemes of a catalog Shoal can use: PostgreSQL through psycopg 3 (plain ones are given that driver).
DATABASE_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")


def check_database_url(url: str) -> str:
    """`url` unchanged when it is a PostgreSQL URL Shoal can connect with (scheme one of DATABASE_SCHEMES, a
    numeric port in 1..65535); else ValueError naming SHOAL_DATABASE_URL and what is wrong (password masked)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    form = "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
    try:
        named = f"SHOAL_DATABASE_URL {mask_url(url)!r}"
    except ValueError:  # too malformed for urlsplit even (a broken IPv6 host): not shown, it may hold a password
        named = "SHOAL_DATABASE_URL"
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in DATABASE_SCHEMES:
        what = f"scheme {scheme!r}" if scheme else "no scheme"
        raise ValueError(f"{named} has {what}: the catalog is PostgreSQL, {form} (or postgresql+psycopg://...)")
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        text = str(exc).strip()
        reason = "its port is not a number" if "int()" in text else (text.splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{named} is not a valid URL ({reason}): use {form}") from None
    # A port may also come as a query parameter (`?host=/tmp&port=5433`, libpq's form); it is read as the other.
    ports = [str(parsed.port)] if parsed.port is not None else []
    given = parsed.query.get("port", ())
    ports += [given] if isinstance(given, str) else list(given)
    # libpq takes one port per host, comma-separated (an empty one: the default).
    for port in (p.strip() for listed in ports for p in listed.split(",") if p.strip()):
        if not (port.isascii() and port.isdigit()):
            raise ValueError(f"{named} is not a valid URL (its port {port!r} is not a number): use {form}")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"{named} has port {port}: a port is 1..65535")
    return url


def storage_location(uri: str) -> str:
    """`uri` as Shoal opens it: an s3:// URI as given, checked; a local one (a path or a file:// URI) as an
    absolute path, ~ expanded. ValueError saying what is wrong with it otherwise.

    An s3:// URI needs a bucket, carries no credentials (the message then never shows the URI: it holds the
    secret) and has no empty, '.' or '..' path component (s3://bucket//p is not a prefix S3 paths can have; S3
    keeps '.' and '..' in keys as written, but the request paths of writes resolve them while listings match
    the prefix literally, so GC, stats and the storage checks would see nothing under it). A file:// URI names
    no host but localhost and is percent-decoded (file:///tmp/my%20dir); a local path's '.' and '..' are
    resolved.
    """
    parts = urlsplit(uri)
    if parts.scheme == "s3" and "@" in parts.netloc:
        # pyarrow's own form, s3://ACCESS:SECRET@bucket/prefix: never echoed.
        raise ValueError(
            "an s3:// storage URI cannot carry credentials (s3://KEY:SECRET@bucket/...): put them in "
            "SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY, and name the storage s3://bucket/prefix"
        )
    if parts.scheme in ("s3", "file") and (parts.query or parts.fragment):
        raise ValueError(f"{uri!r} has a query or fragment ('?' or '#'), which a storage URI cannot have")
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"{uri!r} names no bucket: use s3://bucket or s3://bucket/prefix")
        prefix = parts.path.removeprefix("/").removesuffix("/")
        if parts.path.startswith("//") or (prefix and "" in prefix.split("/")):
            raise ValueError(f"{uri!r} has an empty path component ('//'): use s3://bucket/prefix")
        if any(part in (".", "..") for part in prefix.split("/")):
            raise ValueError(
                f"{uri!r} has a '.' or '..' path component, which S3 does not resolve (files would be written "
                "where listings never look): name the prefix without them, e.g. s3://bucket/prefix"
            )
        return uri
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"{uri!r} names host {parts.netloc!r}: storage is a local directory (file:///path) or s3://"
            )
        path = unquote(parts.path)
    elif parts.scheme == "":
        path = uri  # a plain path is taken as written: '%', '?' and '#' are part of it
    else:
        raise ValueError(f"unsupported storage URI {uri!r}: use a local path or s3://bucket/prefix")
    return str(Path(path).expanduser().resolve())


def check_redis_url(url: str) -> str:
    """`url` unchanged when redis-py reads it (its own parser decides: redis://, rediss:// or unix://, a port
    that is a number, known query arguments); else ValueError naming SHOAL_REDIS_URL, with the URL's password
    masked."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"SHOAL_REDIS_URL {mask_url(url)!r} is not a URL redis can use: {exc}") from None
    return url


def check_s3_endpoint_url(url: str) -> str:
    """`url` unchanged when it is an S3 endpoint Shoal can use: http:// or https://, a host and an optional port,
    nothing else; else ValueError naming SHOAL_S3_ENDPOINT_URL and what is wrong.

    pyarrow takes only the scheme, host and port of an endpoint, so a path or query would be dropped without a
    word, and credentials in it (user:password@) would be taken for part of the host name: all are refused, and
    a URL carrying credentials is never shown (they go in SHOAL_S3_ACCESS_KEY and SHOAL_S3_SECRET_KEY).
    """
    if "@" in url:
        raise ValueError(
            "SHOAL_S3_ENDPOINT_URL cannot carry credentials (user:password@host): put them in SHOAL_S3_ACCESS_KEY "
            "and SHOAL_S3_SECRET_KEY, and give the endpoint as http(s)://host:port"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # a broken IPv6 host
        raise ValueError(
            f"SHOAL_S3_ENDPOINT_URL {url!r} is not a URL ({exc}): use e.g. http://127.0.0.1:9000"
        ) from None
    named = f"SHOAL_S3_ENDPOINT_URL {url!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{named} is not an http:// or https:// URL (e.g. http://127.0.0.1:9000)")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"{named} has a path ({parts.path!r}), which S3 requests would not use: give the endpoint as "
            "http(s)://host:port"
        )
    if parts.query or parts.fragment:
        raise ValueError(
            f"{named} has a query or fragment ('?' or '#'), which S3 requests would not use: give the endpoint as "
            "http(s)://host:port"
        )
    return url


def _toml_source(settings_cls: type[BaseSettings], path: Path) -> TomlConfigSettingsSource:
    """The settings in the TOML file `path`; ConfigurationError naming the file when it cannot be read or
    parsed (the source reads it at once, and its own errors would reach the operator as a traceback)."""
    try:
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"invalid settings: {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigurationError(f"invalid settings: cannot read {path}: {exc.strerror or exc}") from None


def _half_of_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):  # not every platform tells
        return 4 << 30


# Query parameters that carry a secret in the URLs Shoal takes (libpq's `?password=`, `?sslpassword=`; redis-py's
# `?password=`).
_SECRET_PARAMS = frozenset({"password", "sslpassword"})


# A URL's user:password@, as SQLAlchemy reads it: the password runs to the first "@", "/", "?" and "#" included
# (a base64 password often holds "/"), where urlsplit ends the authority at the first of those.
# A password in the user part, as either reader of Shoal's URLs splits it: SQLAlchemy's ends at the first `@`
# and may hold `/`, `?` and `#`; urllib's (redis-py's) ends at the last `@` before the path and may hold `@`.
# The longer of the two is masked.
_USERINFO_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*:)[^@]*@")
_NETLOC_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*:)[^/?#]*@")


def mask_url(url: str) -> str:
    """`url` with any password replaced by `***`, in its user part or as a query parameter (safe to print or
    log); never raises (a URL it cannot read is shown as its scheme alone)."""
    found = [m for m in (_USERINFO_PASSWORD.match(url), _NETLOC_PASSWORD.match(url)) if m is not None]
    longest = max(found, key=lambda m: m.end(), default=None)
    masked = url if longest is None else f"{longest.group(1)}***@{url[longest.end():]}"
    try:
        parts = urlsplit(masked)
    except ValueError:  # e.g. a broken IPv6 host: nothing of it is shown
        scheme = masked.partition("://")[0] if "://" in masked else ""
        return f"{scheme}://***" if scheme.isalnum() else "***"
    if not parts.query:
        return masked  # as given (urlunsplit would drop an empty host: redis:///0 as redis:/0)
    pairs = [pair.split("=", 1) for pair in parts.query.split("&")]
    query = "&".join(
        f"{p[0]}=***" if len(p) == 2 and unquote(p[0]).lower() in _SECRET_PARAMS else "=".join(p) for p in pairs
    )
    # Only the query is rebuilt: urlunsplit drops an empty host (postgresql:///db?host=/run as postgresql:/db?...).
    head = masked[: masked.index("?")] if "?" in masked else masked
    fragment = f"#{parts.fragment}" if "#" in masked else ""
    return f"{head}?{query}{fragment}"
