"""`shoal apply DIR` against a real Postgres: a malformed or inconsistent Vektonn configuration folder is refused
with one line naming the file and what is wrong, and nothing of the folder is written; a good one is applied.

The command runs in process (Typer's CliRunner) with the SHOAL_* variables of `make_settings`: the session's
catalog, a fresh tenant per test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from shoal import Shoal
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

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
