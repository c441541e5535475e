"""The one error map (shoal.api.errors) through the real app: every core error answers a Vektonn route in
Vektonn's shape and a dataset route in the dataset API's shape, with the statuses and headers clients have
always seen. The expected answers are written out here, not read from the map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.datasets.errors import ErrorCode
from shoal.datasets.service import DatasetService
from shoal.errors import (
    AlreadyExistsError,
    AuthenticationError,
    BackpressureError,
    CapacityError,
    CommitError,
    ConfigurationError,
    ConflictError,
    CorruptArtifactError,
    CorruptSegmentError,
    DatasetError,
    InvalidNameError,
    NotFoundError,
    PermissionDeniedError,
    ReindexConflictError,
    ShardsUnavailableError,
    ShoalError,
    ValidationError,
)

INTERNAL = (500, "INTERNAL_ERROR", "internal error", {})

# error, Vektonn (status, errorMessages, extra headers), dataset API (status, error_code, message, details,
# extra headers); an error outside the dataset API's contract answers there as an unexpected one.
CASES: list[tuple[ShoalError, tuple[int, list[str], dict[str, str]], tuple[Any, ...]]] = [
    (ValidationError("k must be positive"),
     (400, ["invalid input, nothing written: k must be positive"], {}),
     (400, "VALIDATION_ERROR", "invalid input, nothing written: k must be positive",
      {"problems": ["k must be positive"]}, {})),
    (InvalidNameError("names are lower case"),
     (400, ["invalid name: names are lower case"], {}),
     (400, "VALIDATION_ERROR", "invalid name: names are lower case", {"problems": ["names are lower case"]}, {})),
    (AuthenticationError("no API key"),
     (401, ["no API key"], {"www-authenticate": "ApiKey"}),
     (401, "UNAUTHORIZED", "no API key", {}, {"www-authenticate": "ApiKey"})),
    (PermissionDeniedError("readers cannot write"),
     (403, ["readers cannot write"], {}),
     (403, "FORBIDDEN", "readers cannot write", {}, {})),
    (NotFoundError("no such thing"),
     (404, ["no such thing"], {}),
     (404, "DATASET_NOT_FOUND", "no such thing", {}, {})),
    (AlreadyExistsError("taken"),
     (409, ["taken"], {}),
     (409, "DATASET_ALREADY_EXISTS", "taken", {}, {})),
    (ReindexConflictError("a reindex runs"),
     (409, ["a reindex runs"], {}),
     (*INTERNAL, {})),
    (BackpressureError("indexes lag", 7),
     (429, ["indexes lag"], {"retry-after": "7"}),
     (429, "TOO_MANY_REQUESTS", "indexes lag", {}, {"retry-after": "7"})),
    (ConfigurationError("Postgres is down"),
     (503, ["Postgres is down"], {}),
     (503, "SERVICE_UNAVAILABLE", "Postgres is down", {}, {})),
    (CapacityError("over budget"),
     (503, ["over budget"], {}),
     (503, "SERVICE_UNAVAILABLE", "over budget", {}, {})),
    # A race lost: 409 as Vektonn's routes always answered it; the dataset API has no such 409, and says retry.
    (ConflictError("index i/1: compactions kept overtaking; retry"),
     (409, ["index i/1: compactions kept overtaking; retry"], {}),
     (503, "SERVICE_UNAVAILABLE", "index i/1: compactions kept overtaking; retry", {}, {"retry-after": "1"})),
    # Nodes that did not answer: a retry may find them back.
    (ShardsUnavailableError("shards 2, 3 answered from no node", [3, 2], 5),
     (503, ["shards 2, 3 answered from no node"], {"x-shoal-missing-shards": "2,3", "retry-after": "5"}),
     (503, "SERVICE_UNAVAILABLE", "shards 2, 3 answered from no node", {},
      {"x-shoal-missing-shards": "2,3", "retry-after": "5"})),
    # Shards this process is not placed to serve: no retry mends that, so no Retry-After.
    (ShardsUnavailableError("this process does not serve shard 1", [1]),
     (503, ["this process does not serve shard 1"], {"x-shoal-missing-shards": "1"}),
     (503, "SERVICE_UNAVAILABLE", "this process does not serve shard 1", {}, {"x-shoal-missing-shards": "1"})),
    (CommitError("gave up"),
     (500, ["gave up"], {}),
     (*INTERNAL, {})),
    # Its message names a storage path: neither shape shows it.
    (CorruptSegmentError("segment tenants/t/sources/s/1/log/x.parquet referenced by the catalog is missing"),
     (500, ["internal error"], {}),
     (*INTERNAL, {})),
    (CorruptArtifactError("tenants/t/indexes/i/1/gen-1/shard-0/u/rows.parquet referenced by its manifest is missing"),
     (500, ["internal error"], {}),
     (*INTERNAL, {})),
    (DatasetError(ErrorCode.INVALID_DIMENSIONS, "expected 2 values", {"expected": 2}),
     (400, ["expected 2 values"], {}),
     (400, "INVALID_DIMENSIONS", "expected 2 values", {"expected": 2}, {})),
    (DatasetError(ErrorCode.REINDEX_CONFLICT, "a reindex runs", {"dataset_id": "d"}),
     (409, ["a reindex runs"], {}),
     (409, "REINDEX_CONFLICT", "a reindex runs", {"dataset_id": "d"}, {})),
]


@pytest.mark.parametrize(("error", "vektonn", "dataset"), CASES, ids=lambda c: type(c).__name__ if
                         isinstance(c, Exception) else "")
def test_each_core_error_in_both_shapes(
    served: tuple[str, Settings], monkeypatch: pytest.MonkeyPatch, error: ShoalError,
    vektonn: tuple[int, list[str], dict[str, str]], dataset: tuple[Any, ...],
) -> None:
    def fail(*_: Any, **__: Any) -> None:
        raise error

    monkeypatch.setattr(Shoal, "get_data_source", fail)  # GET /api/v1/data-sources/{name}/{version}
    monkeypatch.setattr(DatasetService, "get", fail)  # GET /api/v1/datasets/{id}
    url, settings = served
    with httpx.Client(base_url=f"{url}/api/v1", timeout=30) as http:
        r = http.get("/data-sources/docs/1")
        status, messages, headers = vektonn
        assert (r.status_code, r.json()) == (status, {"errorMessages": messages})
        assert r.headers["content-type"] == "application/json"
        for name, value in headers.items():
            assert r.headers[name] == value
        assert "retry-after" in headers or "retry-after" not in r.headers
        assert "www-authenticate" in headers or "www-authenticate" not in r.headers

        r = http.get("/datasets/docs")
        status, code, message, details, headers = dataset
        body = {"success": False, "error_code": code, "message": message, "details": details}
        got = r.json()
        # Every dataset error's details also name the caller's tenant and what to do (issue 15).
        assert got["details"].pop("tenant_id") == settings.tenant
        action = got["details"].pop("action")
        # A 503 an operator must mend says so, rather than "retry after Retry-After" with no such header.
        operator = isinstance(error, (ConfigurationError, CapacityError)) or (
            isinstance(error, ShardsUnavailableError) and error.retry_after is None)
        assert ("retrying will not help" in action) == operator
        assert (r.status_code, got) == (status, body)
        assert r.headers["content-type"] == "application/json"
        for name, value in headers.items():
            assert r.headers[name] == value
        assert "retry-after" in headers or "retry-after" not in r.headers
        assert "www-authenticate" in headers or "www-authenticate" not in r.headers


def test_stats_read_the_log_through_the_checked_reader(served: tuple[str, Settings]) -> None:
    """A log segment whose bytes no longer match its recorded checksum (though still valid Parquet) fails
    /stats (500, logged) instead of being counted: the dataset service reads the log through the standard
    reader, which verifies checksums."""
    url, settings = served
    with httpx.Client(base_url=f"{url}/api/v1", timeout=30) as http:
        assert http.post("/datasets", json={"name": "docs", "dimensions": 2, "index_type": "flat"}).status_code == 201
        vectors = [{"id": "a", "values": [1.0, 0.0], "metadata": {"k": 1}}, {"id": "b", "values": [0.0, 1.0]}]
        assert http.post("/datasets/docs/vectors", json={"vectors": vectors}).status_code == 200
        stats = http.get("/datasets/docs/stats")
        assert stats.status_code == 200 and stats.json()["vector_count"] == 2

        log_dir = Path(settings.storage_uri) / "tenants" / settings.tenant / "sources" / "docs" / "1" / "log"
        [segment] = log_dir.glob("*.parquet")
        # Valid Parquet with one entry fewer: an unchecked read would answer 1 vector.
        pq.write_table(pq.read_table(segment).slice(0, 1), segment)
        r = http.get("/datasets/docs/stats")
        assert (r.status_code, r.json()) == (500, {"success": False, "error_code": "INTERNAL_ERROR",
                                                   "message": "internal error",
                                                   "details": {"tenant_id": settings.tenant,
                                                               "action": "retry later; report the error if it "
                                                                         "persists"}})
