"""Import, apply and demo input checks, against a real catalog, broker and storage.

- `shoal demo` run again with other --points deletes the sample's deleted packages again (an upload batch that is
  new writes them back, so the deletion message must be new too), and leaves no read-your-writes point behind.
- A datetime value with a nanosecond part is refused naming the attribute and the row, not floored (two keys
  333 ns apart were merged into one point); whole microseconds given in nanoseconds still pass.
- A Parquet file holding a column to read twice is refused with one line naming the file and the column.
- `shoal apply` refuses a YAML key given twice (at any level) naming the file and the key.
- A `shoal apply` refused at the check stage leaves no tenant behind; a good one still makes it.
- A .npy coordinate past float32's range is named as such, with no numpy warning.

CLI commands run in process (Typer's CliRunner) on the SHOAL_* variables of `module_cli_env`; the demo runs as a
child process on a data directory of its own, as in test_cli_index.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import module_cli_env
from typer.testing import CliRunner, Result

from shoal import Shoal
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.demo import DEMO_SPEC, load_demo
from shoal.errors import Problem, ValidationError
from shoal.log.records import DataSourceSpec
from shoal.searcher.consistency import Consistency

runner = CliRunner()
SUB_MICRO = "has sub-microsecond precision; datetimes are stored in microseconds"
T0_NS = 1_717_243_200_000_000_000  # 2024-06-01T12:00:00Z in nanoseconds


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for this module: a fresh data dir and storage; servers stopped at teardown."""
    with module_cli_env(tmp_path_factory, "importapply") as data_dir:
        yield data_dir


@pytest.fixture
def tenant(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh tenant, set as SHOAL_TENANT for the in-process commands."""
    name = "ia" + uuid.uuid4().hex[:12]
    monkeypatch.setenv("SHOAL_TENANT", name)
    return name


def shoal_cli(*args: str, code: int = 0) -> Result:
    """Run `shoal ARGS` in process; assert the exit code, no traceback, and an error as one last `error:` line."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    if code == 1:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
        # `shoal import` shows its plan and progress on stderr first; the error is its last line, and one line.
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and sum("error" in line for line in lines) == 1, result.stderr
    return result


def fold(tenant: str, name: str, version: str = "1") -> pa.Table:
    with Shoal(Settings(tenant=tenant), notify=False) as client:
        return client.fold(name, version)


def tenants() -> list[str]:
    return [row["name"] for row in json.loads(shoal_cli("tenant", "list", "--json").stdout)]


# -- shoal demo ---------------------------------------------------------------------------------------------


def test_demo_with_other_points_deletes_the_sample_ids_again(demo_dir: Path) -> None:
    # The demo's own data dir only: no catalog of other tests, whose shards its worker's beat would sweep.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "COLUMNS"}
    env |= {"SHOAL_DATA_DIR": str(demo_dir)}
    shoal_bin = Path(sys.executable).parent / "shoal"
    command = [str(shoal_bin)] if shoal_bin.exists() else [sys.executable, "-m", "shoal.cli"]

    def demo(points: int) -> str:
        done = subprocess.run([*command, "demo", "--points", str(points)], capture_output=True, text=True,
                              timeout=180, check=False, env=env, cwd=demo_dir.parent)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    demo(1)
    # Another --points: its upload batch (demo:0+2) is new and writes id 0 again; so it must delete id 0 again.
    second = demo(2)
    assert "(2 new)" in second and "and deleted ids 0" in second, second
    assert "shoal-demo-point (distance 0.0000)" in second

    settings = Settings(data_dir=demo_dir, database_url=None, redis_url=None, storage_uri=None, tenant="default")
    vectors, table = load_demo(2)
    deleted = vectors[table["id"].to_pylist().index(0)][None, :]
    with Shoal(settings, notify=False) as client:
        # The deleted package stays deleted, and the read-your-writes point was removed again.
        assert sorted(client.fold(DEMO_SPEC.name, DEMO_SPEC.version)["id"].to_pylist()) == [1]
        searcher = client.searcher(follow=False)
        try:
            hits = searcher.search("debian.packages.hnsw", "1.0", deleted, 5, consistency=Consistency.strong())[0]
        finally:
            searcher.close()
    assert [hit.attributes["id"] for hit in hits] == [1]


# -- datetimes below a microsecond --------------------------------------------------------------------------


def test_import_refuses_a_datetime_key_with_nanoseconds(tenant: str, tmp_path: Path) -> None:
    shoal_cli("source", "create", "Events", "1", "--dim", "2", "--attr", "at:datetime", "--permanent", "at")
    vectors = pa.array([[1, 0], [0, 1]], pa.list_(pa.float32()))
    # Two keys 333 ns apart: floored to microseconds they were one key, and one point of two was kept.
    pq.write_table(pa.table({"at": pa.array([T0_NS, T0_NS + 333], pa.timestamp("ns", tz="UTC")),
                             "vector": vectors}), tmp_path / "ns.parquet")
    refused = shoal_cli("import", "Events", "1", str(tmp_path / "ns.parquet"), code=1)
    assert f"point 1, attribute 'at': {SUB_MICRO}" in refused.stderr
    assert "point 0" not in refused.stderr  # a whole microsecond is fine
    assert fold(tenant, "Events").num_rows == 0

    # Whole microseconds written in nanoseconds import as they are.
    pq.write_table(pa.table({"at": pa.array([T0_NS, T0_NS + 1_000], pa.timestamp("ns", tz="UTC")),
                             "vector": vectors}), tmp_path / "us.parquet")
    shoal_cli("import", "Events", "1", str(tmp_path / "us.parquet"))
    t0 = dt.datetime(2024, 6, 1, 12, tzinfo=dt.UTC)
    assert sorted(fold(tenant, "Events")["at"].to_pylist()) == [t0, t0 + dt.timedelta(microseconds=1)]


def test_upload_columns_refuses_datetimes_with_nanoseconds(make_shoal: Callable[..., Shoal]) -> None:
    client = make_shoal()
    client.create_data_source(DataSourceSpec(name="Events", version="1", vector_dimension=2,
                                             attribute_types={"at": "datetime"}, permanent_attributes=["at"]))
    producer = client.producer("Events", "1")
    ns = pa.timestamp("ns", tz="UTC")
    with pytest.raises(ValidationError) as refused:
        producer.upload_columns(np.eye(2, dtype=np.float32), {"at": pa.array([T0_NS, T0_NS + 333], ns)})
    assert refused.value.problems == [Problem(SUB_MICRO, 1, "at")]
    # A deletion by such a key would delete another point than the one named: refused as well.
    with pytest.raises(ValidationError) as refused:
        producer.delete({"at": pa.array([T0_NS + 999], ns)})
    assert refused.value.problems == [Problem(SUB_MICRO, 0, "at")]
    assert client.get_data_source("Events", "1").head_seq == 0

    producer.upload_columns(np.eye(2, dtype=np.float32), {"at": pa.array([T0_NS, T0_NS + 1_000], ns)})
    t0 = dt.datetime(2024, 6, 1, 12, tzinfo=dt.UTC)
    assert sorted(client.fold("Events", "1")["at"].to_pylist()) == [t0, t0 + dt.timedelta(microseconds=1)]


# -- Parquet columns of one name ----------------------------------------------------------------------------


def test_import_refuses_a_column_it_reads_given_twice(tenant: str, tmp_path: Path) -> None:
    shoal_cli("source", "create", "Dup", "1", "--dim", "3", "--attr", "id:int64", "--attr", "name:string",
              "--permanent", "id")
    vec = pa.array([[1, 0, 0], [0, 1, 0]], pa.list_(pa.float32()))
    ids, names = pa.array([1, 2]), pa.array(["a", "b"])

    def write(file: str, arrays: list[pa.Array], columns: list[str]) -> str:
        pq.write_table(pa.Table.from_arrays(arrays, names=columns), tmp_path / file)
        return str(tmp_path / file)

    attr = write("attr.parquet", [ids, pa.array([3, 4]), names, vec], ["id", "id", "name", "vector"])
    assert "attr.parquet has 2 columns named 'id'" in shoal_cli("import", "Dup", "1", attr, code=1).stderr
    vector = write("vec.parquet", [ids, names, vec, vec], ["id", "name", "vector", "vector"])
    assert "vec.parquet has 2 columns named 'vector'" in shoal_cli("import", "Dup", "1", vector, code=1).stderr
    np.save(tmp_path / "v.npy", np.eye(2, 3, dtype=np.float32))
    attrs = write("attrs.parquet", [ids, names, names], ["id", "name", "name"])
    refused = shoal_cli("import", "Dup", "1", str(tmp_path / "v.npy"), "--attributes", attrs, code=1)
    assert "attrs.parquet has 2 columns named 'name'" in refused.stderr
    assert fold(tenant, "Dup").num_rows == 0

    # A repeated column that is not read is no matter.
    extra = write("extra.parquet", [ids, names, vec, pa.array([0, 0]), pa.array([0, 0])],
                  ["id", "name", "vector", "x", "x"])
    shoal_cli("import", "Dup", "1", extra)
    assert sorted(fold(tenant, "Dup")["id"].to_pylist()) == [1, 2]


# -- shoal apply --------------------------------------------------------------------------------------------


def layout(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    ("rel", "text", "message"),
    [
        ("data-sources/D/1.yaml", "vectorDimension: 3\nvectorDimension: 4\npermanentAttributes: [id]\n"
         "attributeValueTypes: {id: int64}\n", "key 'vectorDimension' is given twice (lines 1 and 2)"),
        ("data-sources/D/1.yaml", "vectorDimension: 3\npermanentAttributes: [id]\n"
         "attributeValueTypes:\n  id: int64\n  id: string\n", "key 'id' is given twice (lines 4 and 5)"),
        ("data-sources/D/1.yaml", "vectorDimension: 3\npermanentAttributes: [id]\n"
         "attributeValueTypes: {id: int64, id: string}\n", "key 'id' is given twice (line 3)"),
        ("indices/I/1.yaml", "dataSourceId:\n  name: X\n  name: D\n  version: '1'\n"
         "indexAlgorithm: {type: FaissIndex.L2}\n", "key 'name' is given twice (lines 2 and 3)"),
    ],
    ids=["top-level", "nested", "flow-mapping", "index-file"],
)
def test_apply_refuses_a_key_given_twice(tenant: str, tmp_path: Path, rel: str, text: str, message: str) -> None:
    folder = layout(tmp_path, {"data-sources/D/1.yaml": "vectorDimension: 3\npermanentAttributes: [id]\n"
                               "attributeValueTypes: {id: int64}\n"})
    layout(folder, {rel: text})
    refused = shoal_cli("apply", str(folder), code=1)
    assert f"{folder / rel}: {message}" in refused.stderr
    assert tenant not in tenants()  # nothing written, not even the tenant


def test_a_refused_apply_leaves_no_tenant_and_a_good_one_makes_it(tenant: str, tmp_path: Path) -> None:
    source = "vectorDimension: 2\npermanentAttributes: [id]\nattributeValueTypes: {id: int64}\n"
    # Valid files, but the index names a data source neither the folder nor the (new) tenant holds.
    bad = layout(tmp_path / "bad", {"indices/I/1.yaml": "dataSourceId: {name: Nope, version: '1'}\n"
                                    "indexAlgorithm: {type: FaissIndex.L2}\n"})
    refused = shoal_cli("apply", str(bad), code=1)
    assert f"neither in {bad / 'data-sources'} nor in tenant '{tenant}'" in refused.stderr
    assert tenant not in tenants()

    good = layout(tmp_path / "good", {"data-sources/D/1.yaml": source,
                                      "indices/I/1.yaml": "dataSourceId: {name: D, version: '1'}\n"
                                      "indexAlgorithm: {type: FaissIndex.L2}\nidAttributes: [id]\n"})
    assert "data source D/1: created" in shoal_cli("apply", str(good)).stdout
    assert tenant in tenants()
    # Checked against what the tenant holds now: unchanged; another definition is refused naming the field.
    assert "index I/1: unchanged" in shoal_cli("apply", str(good)).stdout
    layout(good, {"data-sources/D/1.yaml": source.replace("2", "3")})
    assert "vectorDimension: 3 here, 2 in the catalog" in shoal_cli("apply", str(good), code=1).stderr


# -- .npy past float32 --------------------------------------------------------------------------------------


def test_npy_coordinate_past_float32_is_named_without_a_warning(
    tenant: str, tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    shoal_cli("source", "create", "Ovf", "1", "--dim", "3", "--attr", "id:int64", "--permanent", "id")
    vectors = np.eye(3)
    vectors[1, 1] = 1e300
    np.save(tmp_path / "ovf.npy", vectors)
    pq.write_table(pa.table({"id": [1, 2, 3]}), tmp_path / "ids.parquet")
    refused = shoal_cli("import", "Ovf", "1", str(tmp_path / "ovf.npy"), "--attributes",
                        str(tmp_path / "ids.parquet"), code=1)
    assert "point 1, attribute 'vector': coordinates must be finite float32 values: 1e+300 at index 1 is past " \
           "float32's range" in refused.stderr
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]
    assert fold(tenant, "Ovf").num_rows == 0
