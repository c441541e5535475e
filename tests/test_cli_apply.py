"""`shoal apply DIR` against a real Postgres: a malformed or inconsistent Vektonn configuration folder is refused
with one line naming the file and what is wrong, and nothing of the folder is written; a good one is applied.

The command runs in process (Typer's CliRunner) with the SHOAL_* variables of `make_settings`: the session's
catalog, a fresh tenant per test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Connection, text
from typer.testing import CliRunner, Result

from shoal import Shoal
from shoal.catalog.db import make_engine
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.log.records import DataSourceSpec, IndexSpec

runner = CliRunner()

SOURCE = "vectorDimension: 2\npermanentAttributes: [id]\nattributeValueTypes: {id: int64}\n"
INDEX = "dataSourceId: {name: A.src, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2}\nidAttributes: [id]\n"


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings on a fresh tenant, set as the SHOAL_* environment the command reads."""
    made = make_settings("local")
    monkeypatch.chdir(tmp_path)  # no stray ./shoal.toml is read
    for name, value in made.child_env().items():
        if name.startswith("SHOAL_"):
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("SHOAL_CONFIG", raising=False)
    return made


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    """Lay out `files` (relative path -> text or bytes) under `root`; return `root`."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def shoal_apply(folder: Path, code: int = 0) -> Result:
    """Run `shoal apply FOLDER`; assert the exit code, no traceback, and an error as one `error:` line."""
    result = runner.invoke(app, ["apply", str(folder)])
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    if code == 1:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
        assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result


def stored(settings: Settings) -> tuple[list[str], list[str]]:
    """The tenant's data sources and indexes, as NAME/VERSION."""
    with Shoal(settings, notify=False) as shoal:
        return (
            [f"{r.spec.name}/{r.spec.version}" for r in shoal.list_data_sources()],
            [f"{r.spec.name}/{r.spec.version}" for r in shoal.list_indexes()],
        )


@pytest.mark.parametrize(
    ("bad_file", "content", "message"),
    [
        ("indices/A.idx/1.yaml", "dataSourceId: foo\nindexAlgorithm: {type: FaissIndex.L2}\n",
         "dataSourceId must be a mapping, got a string"),
        ("indices/A.idx/1.yaml", "dataSourceId: {name: A.src, version: '1'}\nindexAlgorithm: [a]\n",
         "indexAlgorithm must be a mapping, got a list"),
        ("indices/A.idx/1.yaml",
         "dataSourceId: {name: A.src, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2, params: [1, 2]}\n",
         "indexAlgorithm.params must be a mapping, got a list"),
        ("indices/A.idx/1.yaml", "dataSourceId: {name: [A.src], version: '1'}\nindexAlgorithm: {type: x}\n",
         "dataSourceId.name must be text, got a list"),
        ("data-sources/B.src/1.yaml", SOURCE.encode() + b"# \xff\xfe\n", "is not UTF-8 text"),
        ("data-sources/B.src/1.yaml", "vectorDimension: [2]\nattributeValueTypes: {id: int64}\n",
         "vectorDimension must be an integer, got a list"),
        ("data-sources/B.src/1.yaml", "- 1\n", "expected a mapping at the top, got a list"),
        ("indices/A.idx/2.yaml/", "", "is a directory"),
    ],
)
def test_malformed_values_name_the_file_and_field(
    settings: Settings, tmp_path: Path, bad_file: str, content: str | bytes, message: str
) -> None:
    """Bug 1: a value of the wrong shape is one error line naming the file and the field, not a traceback."""
    folder = write(tmp_path / "cfg", {"data-sources/A.src/1.yaml": SOURCE})
    if bad_file.endswith("/"):  # a directory named like a YAML file
        (folder / bad_file).mkdir(parents=True)
    else:
        write(folder, {bad_file: content})
    result = shoal_apply(folder, code=1)
    assert str(folder / bad_file.rstrip("/")) in result.stderr and message in result.stderr, result.stderr
    assert stored(settings) == ([], [])


def test_invalid_index_writes_nothing(settings: Settings, tmp_path: Path) -> None:
    """Bug 2: every file is checked (an index against its data source, too) before anything is created."""
    folder = write(tmp_path / "cfg", {
        "data-sources/B.src/1.yaml": SOURCE,
        "indices/A.idx/1.yaml": "dataSourceId: {name: B.src, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2}\n"
                                "idAttributes: [nope]\n",
    })
    result = shoal_apply(folder, code=1)
    assert stored(settings) == ([], []) and "created" not in result.stdout
    assert str(folder / "indices/A.idx/1.yaml") in result.stderr
    assert "'nope'" in result.stderr and "permanent attribute" in result.stderr


def test_index_of_unknown_source_writes_nothing(settings: Settings, tmp_path: Path) -> None:
    """Bug 2: an index whose data source is neither in the folder nor in the catalog is refused up front."""
    folder = write(tmp_path / "cfg", {
        "data-sources/A.src/1.yaml": SOURCE,
        "indices/A.idx/1.yaml": "dataSourceId: {name: Missing, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2}\n",
    })
    result = shoal_apply(folder, code=1)
    assert stored(settings) == ([], [])
    assert str(folder / "indices/A.idx/1.yaml") in result.stderr and "'Missing'" in result.stderr


def test_index_over_a_catalog_source(settings: Settings, tmp_path: Path) -> None:
    """An index may name a data source the tenant holds already (checked against the stored definition)."""
    shoal_apply(write(tmp_path / "first", {"data-sources/A.src/1.yaml": SOURCE}))
    result = shoal_apply(write(tmp_path / "second", {"indices/A.idx/1.yaml": INDEX}))
    assert "index A.idx/1: created" in result.stdout
    assert stored(settings) == (["A.src/1"], ["A.idx/1"])
    bad = write(tmp_path / "third", {"indices/B.idx/1.yaml": INDEX + "splitAttributes: [other]\n"})
    assert "'other'" in shoal_apply(bad, code=1).stderr
    assert stored(settings) == (["A.src/1"], ["A.idx/1"])


def test_scalar_where_a_list_belongs(settings: Settings, tmp_path: Path) -> None:
    """Bug 3: `permanentAttributes: id` is refused as what it is, not read as an empty list."""
    folder = write(tmp_path / "cfg", {
        "data-sources/E.src/1.yaml": "vectorDimension: 2\npermanentAttributes: id\nattributeValueTypes: {id: int64}\n",
    })
    result = shoal_apply(folder, code=1)
    assert str(folder / "data-sources/E.src/1.yaml") in result.stderr
    assert "permanentAttributes must be a list of attribute names, got a string" in result.stderr
    bad_index = write(tmp_path / "cfg2", {
        "data-sources/A.src/1.yaml": SOURCE,
        "indices/A.idx/1.yaml": "dataSourceId: {name: A.src, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2}\n"
                                "idAttributes: id\n",
    })
    assert "idAttributes must be a list of attribute names, got a string" in shoal_apply(bad_index, code=1).stderr
    assert stored(settings) == ([], [])


@pytest.mark.parametrize("subfolders", [[], ["data-sources", "indices"]])
def test_folder_without_configuration(settings: Settings, tmp_path: Path, subfolders: list[str]) -> None:
    """Bug 4: a folder without any data source or index file is refused (most likely the wrong folder)."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    for name in subfolders:
        (folder / name).mkdir()
    result = shoal_apply(folder, code=1)
    assert "holds no Vektonn configuration" in result.stderr
    assert "data-sources/" in result.stderr and "indices/" in result.stderr


def test_help_says_what_an_error_names() -> None:
    """Bug 5: the help promised the catalog's AlreadyExistsError named the difference (it names none); it now
    says what apply itself reports."""
    help_text = " ".join(runner.invoke(app, ["apply", "--help"]).output.split())
    assert "AlreadyExistsError names any difference" not in help_text
    assert "the fields that differ" in help_text and "before anything is written" in help_text


def test_existing_definition_differs(settings: Settings, tmp_path: Path) -> None:
    """Bugs 5 and 2: a definition differing from the stored one is refused naming the file and the fields that
    differ (as the help says), and nothing else of the folder is written either."""
    first = shoal_apply(write(tmp_path / "v1", {"data-sources/A.src/1.yaml": SOURCE, "indices/A.idx/1.yaml": INDEX}))
    assert "data source A.src/1: created" in first.stdout and "index A.idx/1: created" in first.stdout
    again = shoal_apply(tmp_path / "v1")
    assert again.stdout.count("unchanged") == 2

    source_differs = write(tmp_path / "v2", {
        "data-sources/A.src/1.yaml": SOURCE.replace("vectorDimension: 2", "vectorDimension: 3"),
        "data-sources/New.src/1.yaml": SOURCE,
    })
    result = shoal_apply(source_differs, code=1)
    assert stored(settings) == (["A.src/1"], ["A.idx/1"])
    assert str(source_differs / "data-sources/A.src/1.yaml") in result.stderr
    assert "vectorDimension: 3 here, 2 in the catalog" in result.stderr

    index_differs = write(tmp_path / "v3", {
        "data-sources/New.src/1.yaml": SOURCE,
        "indices/A.idx/1.yaml": INDEX.replace("FaissIndex.L2", "FaissIndex.IP"),
    })
    result = shoal_apply(index_differs, code=1)
    assert stored(settings) == (["A.src/1"], ["A.idx/1"])  # New.src/1 was not created either
    assert str(index_differs / "indices/A.idx/1.yaml") in result.stderr and "metric" in result.stderr



def index_spec(settings: Settings, name: str) -> IndexSpec:
    """The stored (resolved) definition of index NAME/1."""
    with Shoal(settings, notify=False) as shoal:
        return shoal.get_index(name, "1").spec


def test_vektonn_hnsw_parameter_names(settings: Settings, tmp_path: Path) -> None:
    """Vektonn's index reads HNSW's parameters as Hnsw_M, Hnsw_EfConstruction and Hnsw_EfSearch
    (Vektonn.Index IndexParamsKeys): `shoal apply` refused them as unknown parameters. They make an HNSW index
    now; the short names (M, EfConstruction, EfSearch) stay accepted, and still come all or none."""

    def with_params(params: str) -> str:
        return INDEX.replace("{type: FaissIndex.L2}", f"{{type: FaissIndex.L2, params: {params}}}")

    folder = write(tmp_path / "cfg", {
        "data-sources/A.src/1.yaml": SOURCE,
        "indices/A.idx/1.yaml": with_params("{Hnsw_M: 16, Hnsw_EfConstruction: 200, Hnsw_EfSearch: 64}"),
    })
    assert "index A.idx/1: created" in shoal_apply(folder).stdout
    spec = index_spec(settings, "A.idx")
    assert (spec.algorithm, spec.metric, spec.params) == (
        "hnsw", "l2_squared", {"M": 16, "ef_construction": 200, "ef_search": 64})
    assert shoal_apply(folder).stdout.count("unchanged") == 2
    for i, (params, says) in enumerate((
        ("{Hnsw_M: 16, Hnsw_EfConstruction: 200}", "all or none: missing Hnsw_EfSearch"),
        ("{Hnsw_M: 16, M: 16, Hnsw_EfConstruction: 200, Hnsw_EfSearch: 64}", "HNSW parameter Hnsw_M is given twice"),
        ("{Hnsw_Nope: 1}", "does not take parameter(s) 'Hnsw_Nope'"),
    )):
        bad = write(tmp_path / f"bad{i}", {"indices/B.idx/1.yaml": with_params(params)})
        assert says in shoal_apply(bad, code=1).stderr
    assert stored(settings) == (["A.src/1"], ["A.idx/1"])


SHARDED_SOURCE = ("vectorDimension: 2\nattributeValueTypes: {Id: Int64, Region: String, ShopId: Int64}\n"
                  "permanentAttributes: [Id, Region, ShopId]\nshardersByAttributeKey:\n  Region:\n"
                  "    numberOfShards: 2\n")
UNSHARDED_INDEX = ("dataSourceId: {name: S.src, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2}\n"
                   "idAttributes: [Id]\n")
SHARDED_INDEX = (UNSHARDED_INDEX + "shardsById:\n"
                 "  ShardA:\n    shardsByAttributeKey:\n      ShopId: {numberOfShards: 2, shardValues: [0]}\n"
                 "  ShardB:\n    shardsByAttributeKey:\n      ShopId: {numberOfShards: 2, shardValues: [1]}\n")


def test_an_index_is_sharded_by_its_own_shard_attributes(settings: Settings, tmp_path: Path) -> None:
    """An index's shard attributes are the keys of its own `shardsById.*.shardsByAttributeKey` (Vektonn's
    IndexMeta.ShardAttributes), else the default (its id attributes). They came from the data source's sharders
    instead, and only when the source's file was in the folder: the same index file applied with and without
    it made different indexes, and applying it alone after the whole folder failed ("exists with another
    definition")."""
    whole = write(tmp_path / "whole", {"data-sources/S.src/1.yaml": SHARDED_SOURCE,
                                       "indices/S.idx/1.yaml": SHARDED_INDEX,
                                       "indices/S.plain/1.yaml": UNSHARDED_INDEX})
    shoal_apply(whole)
    assert (index_spec(settings, "S.idx").shard_attributes, index_spec(settings, "S.idx").shard_count) == (
        ("ShopId",), 2)
    assert index_spec(settings, "S.plain").shard_attributes == ("Id",)
    alone = write(tmp_path / "alone", {"indices/S.idx/1.yaml": SHARDED_INDEX})
    assert "index S.idx/1: unchanged" in shoal_apply(alone).stdout
    bad = write(tmp_path / "bad", {"indices/S.bad/1.yaml": UNSHARDED_INDEX + "shardsById:\n  ShardA: [x]\n"})
    assert "shardsById.ShardA must be a mapping, got a list" in shoal_apply(bad, code=1).stderr


ORDERED_INDEX = "dataSourceId: {name: O.src, version: '1'}\nindexAlgorithm: {type: FaissIndex.L2}\nidAttributes: [id]\n"


def ordered_source(*attributes: str) -> str:
    """A data source file listing its attributes (id an int64, the others strings) in the order given."""
    types = ", ".join(f"{a}: {'int64' if a == 'id' else 'string'}" for a in attributes)
    return f"vectorDimension: 2\npermanentAttributes: [id]\nattributeValueTypes: {{{types}}}\n"


def test_attribute_order_does_not_break_a_reapply(settings: Settings, tmp_path: Path) -> None:
    """An index was checked against the folder's copy of its data source, the catalog against the stored one:
    with the attributes in another order there (equal definitions for a data source), the index's default
    payload attributes came out in another order, and the second apply of the same folder failed ("exists
    with another definition: payload_attributes"). Same when only the folder's order changed between applies."""
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec(name="O.src", version="1", vector_dimension=2,
                                                attribute_types={"payload": "string", "lang": "string",
                                                                 "id": "int64"},
                                                permanent_attributes=["id"]))
    folder = write(tmp_path / "cfg", {"data-sources/O.src/1.yaml": ordered_source("id", "lang", "payload"),
                                      "indices/O.idx/1.yaml": ORDERED_INDEX})
    first = shoal_apply(folder)
    assert "data source O.src/1: unchanged" in first.stdout and "index O.idx/1: created" in first.stdout
    assert shoal_apply(folder).stdout.count("unchanged") == 2
    assert index_spec(settings, "O.idx").payload_attributes == ("payload", "lang", "id")  # the stored order

    # A new data source and index from one folder, then the same with the attributes reordered.
    write(tmp_path / "v1", {"data-sources/P.src/1.yaml": ordered_source("id", "lang", "payload"),
                            "indices/P.idx/1.yaml": ORDERED_INDEX.replace("O.src", "P.src")})
    write(tmp_path / "v2", {"data-sources/P.src/1.yaml": ordered_source("payload", "id", "lang"),
                            "indices/P.idx/1.yaml": ORDERED_INDEX.replace("O.src", "P.src")})
    assert shoal_apply(tmp_path / "v1").stdout.count("created") == 2
    assert shoal_apply(tmp_path / "v2").stdout.count("unchanged") == 2


def test_a_shoal_type_in_yaml_is_refused(settings: Settings, tmp_path: Path) -> None:
    """`indexAlgorithm.type` took Shoal's own algorithm names (flat, hnsw, ivf), with metric cosine and params
    read as text, so `type: hnsw` with `M: 16` failed as "must be an integer". Vektonn refuses any type but its
    own: so does apply, naming the field and the Vektonn types."""
    folder = write(tmp_path / "cfg", {
        "data-sources/A.src/1.yaml": SOURCE,
        "indices/A.idx/1.yaml": INDEX.replace("{type: FaissIndex.L2}",
                                              "{type: hnsw, params: {M: 16, EfConstruction: 200, EfSearch: 64}}"),
    })
    result = shoal_apply(folder, code=1)
    assert str(folder / "indices/A.idx/1.yaml") in result.stderr
    assert ("indexAlgorithm.type 'hnsw' is not a Vektonn index type; known: FaissIndex.L2, FaissIndex.IP, "
            "SparnnIndex.Cosine") in result.stderr
    assert stored(settings) == ([], [])


def test_hidden_files_are_skipped_and_yml_warned(settings: Settings, tmp_path: Path) -> None:
    """An Emacs lock link (`.#1.yaml`, dangling) or macOS' `._1.yaml` beside a definition aborted the apply
    ("is not a regular file", "is not UTF-8 text"): files and folders named `.*` are skipped now. A `*.yml`
    file was ignored without a word: it is still not read, and a warning names it."""
    folder = write(tmp_path / "cfg", {
        "data-sources/A.src/1.yaml": SOURCE,
        "data-sources/A.src/._1.yaml": b"\x00\x05\x16\x07\x00\x02\x00\x00\xff\xfe",
        "data-sources/.trash/1.yaml": "not: [a, definition\n",
        "indices/A.idx/1.yaml": INDEX,
        "indices/Y.idx/1.yml": INDEX,
    })
    (folder / "data-sources/A.src/.#1.yaml").symlink_to("user@host.12345:1700000000")
    result = runner.invoke(app, ["apply", str(folder)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("created") == 2
    assert result.stderr.strip() == (f"warning: {folder / 'indices/Y.idx/1.yml'} is not read: only .yaml files "
                                     "are (rename it to .yaml to apply it)")
    assert stored(settings) == (["A.src/1"], ["A.idx/1"])

    only_yml = write(tmp_path / "yml", {"data-sources/A.src/1.yml": SOURCE})
    result = shoal_apply(only_yml, code=1)
    assert "holds no Vektonn configuration" in result.stderr.splitlines()[-1]
    assert f"it has .yml files, which are not read: {only_yml / 'data-sources/A.src/1.yml'}" in result.stderr


APPLY_LOCK = "hashtextextended('shoal apply ' || :tenant, 0)"  # the advisory lock key of `shoal apply`


def _waiting_applies(conn: Connection, tenant: str) -> int:
    """How many sessions wait for the advisory lock `shoal apply` takes on `tenant`."""
    return int(conn.scalar(text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        f"AND ((classid::bigint << 32) | objid::bigint) = {APPLY_LOCK}"), {"tenant": tenant}))


def _conflicting_folders(root: Path) -> dict[str, Path]:
    """Folders a and b: 20 data sources of their own (A.., B..) and 20 they share by name (S..), of dimension 3
    in a and 4 in b."""
    source = "vectorDimension: {dim}\nattributeValueTypes: {{id: Int64}}\npermanentAttributes: [id]\n"
    folders = {}
    for own, dim in (("A", 3), ("B", 4)):
        files = {f"data-sources/{own}{i:02}/1.yaml": source.format(dim=dim) for i in range(20)}
        files |= {f"data-sources/S{i:02}/1.yaml": source.format(dim=dim) for i in range(20)}
        folders[own] = write(root / own.lower(), files)
    return folders


def test_two_applies_at_once(settings: Settings, tmp_path: Path) -> None:
    """Two applies of conflicting folders at once on one tenant: each checked against a catalog the other was
    changing, and the loser failed on a conflict after writing its own data sources (half applied), naming no
    file. Applies on a tenant now run one after the other: exactly one succeeds, the other writes nothing and
    names the file at fault. Both are held at the start (the test holds their lock) so that they truly race."""
    folders = _conflicting_folders(tmp_path)
    assert settings.database_url is not None
    engine = make_engine(settings.database_url)
    env = {**os.environ, "COLUMNS": "400"}  # the fixture's SHOAL_*; every message on one line
    tenant = {"tenant": settings.tenant}
    try:
        with engine.connect() as holder, engine.connect() as probe:
            holder.execute(text(f"SELECT pg_advisory_lock({APPLY_LOCK})"), tenant)
            holder.commit()
            procs = {own: subprocess.Popen([sys.executable, "-m", "shoal.cli", "apply", str(folder)], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for own, folder in folders.items()}
            deadline = time.monotonic() + 60  # without the lock, both finish (or fail) long before
            while (_waiting_applies(probe, settings.tenant) < 2 and time.monotonic() < deadline
                   and any(p.poll() is None for p in procs.values())):
                probe.rollback()
                time.sleep(0.05)
            both_waited = _waiting_applies(probe, settings.tenant) == 2
            holder.execute(text(f"SELECT pg_advisory_unlock({APPLY_LOCK})"), tenant)
            holder.commit()
            outputs = {own: p.communicate(timeout=120) for own, p in procs.items()}
            results = {own: (procs[own].returncode, *outputs[own]) for own in procs}
    finally:
        engine.dispose()
    assert sorted(code for code, _, _ in results.values()) == [0, 1], results
    [winner] = [own for own, (code, _, _) in results.items() if code == 0]
    [loser] = [own for own in results if own != winner]
    _, loser_out, loser_err = results[loser]
    assert "created" not in loser_out, loser_out
    error = loser_err.strip().splitlines()[-1]
    assert error.startswith("error: ") and str(folders[loser] / "data-sources/S00/1.yaml") in error, loser_err
    assert "vectorDimension" in error, error
    sources, _ = stored(settings)
    assert sorted(sources) == sorted([f"{winner}{i:02}/1" for i in range(20)] + [f"S{i:02}/1" for i in range(20)])
    assert both_waited, "the applies did not wait for each other"
    assert all("waiting for another `shoal apply`" in err for _, _, err in results.values())


def test_apply_with_a_catalog_pool_of_one(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The apply lock's connection is not taken from the catalog pool: with a pool of one it would leave none
    for the apply itself, which would wait out the pool's timeout (30 s) and fail."""
    monkeypatch.setenv("SHOAL_DB_POOL_SIZE", "1")
    monkeypatch.setenv("SHOAL_DB_MAX_OVERFLOW", "0")
    folder = write(tmp_path / "cfg", {"data-sources/A.src/1.yaml": SOURCE})
    assert "data source A.src/1: created" in shoal_apply(folder).stdout
