"""Bulk import of files into a data source: a Parquet file, or a .npy file of vectors plus a Parquet file
of attributes (row i belonging to vector i).

`plan_import` checks the files against the data source's definition and uploads nothing; `run_import`
uploads a plan in batches whose ids depend only on the files and the batch bounds, so a re-run (after a
crash, or by mistake) skips every batch that committed before and writes only what is missing. Nothing
here prints: progress goes to an optional per-batch callback.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shoal.errors import Problem, ShoalError, ValidationError
from shoal.log.records import AttributeType, DataSourceSpec, WriteToken
from shoal.log.validation import ARROW_TYPES, to_float32

if TYPE_CHECKING:  # the client sits above ingest; only its type is needed here
    from shoal.intake.producer import Producer

DEFAULT_VECTOR_COLUMN = "vector"
DEFAULT_BATCH_SIZE = 10_000
PREFIX_NAME_CHARS = 60  # a file name up to this long is kept whole in the default batch prefix
PREFIX_NAME_KEPT = 40  # ... a longer one keeps this many characters, plus a hash of the whole name


@dataclass(frozen=True)
class ImportPlan:
    """What an import will read, checked against the data source's definition; nothing is uploaded yet."""

    spec: DataSourceSpec
    path: Path  # the Parquet file, or the .npy file of vectors
    attributes_path: Path | None  # with a .npy file: the Parquet file of attributes
    vector_column: str | None  # the Parquet column of vectors; None: they come from the .npy file
    columns: Mapping[str, str]  # data source attribute -> file column
    rows: int  # rows to import: the first `rows` of the file(s)
    batch_prefix: str

    def batch_id(self, offset: int, count: int) -> str:
        """The id of the batch of `count` rows starting at file row `offset`: PREFIX:OFFSET+COUNT."""
        return f"{self.batch_prefix}:{offset}+{count}"


@dataclass(frozen=True)
class ImportBatch:
    """A batch read from the file(s): float32 vectors [n, dim] and one column per attribute."""

    offset: int  # file row of the batch's first point
    vectors: np.ndarray
    attributes: dict[str, pa.Array]


@dataclass(frozen=True)
class BatchOutcome:
    """What became of one uploaded batch; passed to run_import's `on_batch`."""

    offset: int
    points: int
    batch_id: str
    token: WriteToken
    written: bool  # False: the batch id had committed before, so nothing was written


@dataclass
class ImportResult:
    """What run_import did: points and batches in all, how many were new, the highest write token."""

    points: int = 0
    new_points: int = 0
    batches: int = 0
    skipped_batches: int = 0
    seconds: float = 0.0
    token: WriteToken | None = None

    @property
    def skipped_points(self) -> int:
        """Points in batches that had committed before (same batch ids) and were not written again."""
        return self.points - self.new_points


def is_npy(path: Path) -> bool:
    """True when `path` names a NumPy .npy file (vectors only), else it is taken for Parquet."""
    return path.suffix.lower() == ".npy"


def default_batch_prefix(path: Path, attributes_path: Path | None = None) -> str:
    """import:NAME:SIZE of the file(s): stable across re-runs, different for another or a changed file.

    A NAME longer than PREFIX_NAME_CHARS is shortened to its first PREFIX_NAME_KEPT characters, `~` and a hash
    of the whole name, so that two files whose long names differ only at the end still get other ids (and
    the ids stay within the 200 characters a batch id may have)."""
    parts = [f"{_name_in_prefix(p.name)}:{p.stat().st_size}" for p in (path, attributes_path) if p is not None]
    return "import:" + ":".join(parts)


def _name_in_prefix(name: str) -> str:
    if len(name) <= PREFIX_NAME_CHARS:
        return name  # as before: a re-run of an import started by an earlier release finds its batch ids
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return f"{name[:PREFIX_NAME_KEPT]}~{digest}"


def plan_import(
    spec: DataSourceSpec,
    path: Path,
    *,
    attributes: Path | None = None,
    vectors_column: str | None = None,
    attr_map: Mapping[str, str] | None = None,
    limit: int | None = None,
    batch_prefix: str | None = None,
) -> ImportPlan:
    """Check the file(s) against `spec` and return what run_import will upload; read only the metadata.

    `path` is a Parquet file with attribute columns and a vector column (`vectors_column`, default
    "vector"; lists of numbers), or a .npy file [n, dim] of vectors with the attribute columns in the
    Parquet file `attributes`. Attribute columns are found by name, or through `attr_map` {file column:
    attribute}; other columns are ignored. `limit` keeps the first rows only. `batch_prefix` defaults to
    default_batch_prefix. Raises ValidationError naming what does not fit (sparse data sources included:
    their vectors are not columns of numbers).
    """
    if spec.vectors_are_sparse:
        raise ValidationError("bulk import supports dense data sources only; upload sparse vectors as DataPoints")
    if limit is not None and limit < 0:
        raise ValidationError(f"limit must not be negative, got {limit}")
    if is_npy(path):
        if attributes is None:
            raise ValidationError(f"{path.name} holds only vectors: give the Parquet file of attributes")
        if vectors_column is not None:
            raise ValidationError(f"{path.name} is all vectors: a vectors column is only for Parquet files")
    elif attributes is not None:
        raise ValidationError("a separate attributes file goes only with a .npy file of vectors")
    with _reading(path):
        if attributes is not None:
            rows, columns = _plan_npy(spec, path, attributes, attr_map or {})
        else:
            vectors_column = vectors_column or DEFAULT_VECTOR_COLUMN
            rows, columns = _plan_parquet(spec, path, vectors_column, attr_map or {})
        prefix = batch_prefix if batch_prefix is not None else default_batch_prefix(path, attributes)
    rows = rows if limit is None else min(limit, rows)
    return ImportPlan(spec, path, attributes, vectors_column, columns, rows, prefix)


def read_batches(plan: ImportPlan, size: int) -> Iterator[ImportBatch]:
    """The plan's rows in batches of exactly `size` (the last may be shorter), vectors widened to float32
    and attribute columns cast to the data source's types where the cast is lossless.

    Batch bounds depend only on `size` and the plan's rows, never on the file's row groups, so batch ids
    stay stable. Raises ValidationError for unreadable data, positions counted from the batch's start.
    """
    if size < 1:
        raise ValidationError(f"batch size must be at least 1, got {size}")
    return _read(plan, size)


def _read(plan: ImportPlan, size: int) -> Iterator[ImportBatch]:
    kinds = plan.spec.attribute_types
    dim = plan.spec.vector_dimension
    # The Parquet file is where reading can fail after planning; a memory-mapped .npy is only sliced.
    with _reading(plan.attributes_path or plan.path):
        if plan.attributes_path is not None:
            vectors = _load_npy(plan.path)
            source = pq.ParquetFile(plan.attributes_path)
            wanted = sorted(set(plan.columns.values()))
        else:
            vectors = None
            source = pq.ParquetFile(plan.path)
            assert plan.vector_column is not None
            wanted = sorted({*plan.columns.values(), plan.vector_column})
        offset = 0
        for table in _rebatch(source.iter_batches(batch_size=size, columns=wanted), size, plan.rows):
            n = table.num_rows
            if vectors is not None:
                block = _float32_or_given(np.asarray(vectors[offset : offset + n]))
            else:
                assert plan.vector_column is not None
                block = _vectors(table[plan.vector_column], dim, plan.vector_column)
            yield ImportBatch(offset, block, {a: _coerce(table[c], kinds[a]) for a, c in plan.columns.items()})
            offset += n


def run_import(
    producer: Producer,
    plan: ImportPlan,
    batch_size: int = DEFAULT_BATCH_SIZE,
    *,
    on_batch: Callable[[BatchOutcome], None] | None = None,
) -> ImportResult:
    """Upload the plan through `producer` in batches of `batch_size`, in file order; call `on_batch` after each.

    Every batch is all or nothing and carries the id PREFIX:OFFSET+COUNT: a batch whose id the data source
    committed before writes nothing and counts as skipped (judged against the head the producer saw when
    it was made, so make the producer just before). On a bad batch it raises ValidationError naming the
    file row; the batches before it stay committed, and a re-run with the same plan and batch size skips
    them.
    """
    if not producer.spec.same_definition(plan.spec):
        raise ValidationError(
            f"the plan was made for another definition than {producer.spec.name}/{producer.spec.version}'s"
        )
    batches = read_batches(plan, batch_size)
    head = producer.source.head_seq
    result = ImportResult()
    started = time.perf_counter()
    while True:
        offset = result.points  # batches are contiguous: the next one starts where the last ended
        try:
            batch = next(batches, None)
            if batch is None:
                break
            n = len(batch.vectors)
            batch_id = plan.batch_id(offset, n)
            token = producer.upload_columns(batch.vectors, batch.attributes, batch_id=batch_id)
        except ValidationError as exc:
            raise _at_file_row(exc, plan.path, offset) from exc
        outcome = BatchOutcome(offset, n, batch_id, token, written=token.seq > head)
        result.points += n
        result.batches += 1
        result.new_points += n if outcome.written else 0
        result.skipped_batches += 0 if outcome.written else 1
        result.token = token if result.token is None or token.seq > result.token.seq else result.token
        if on_batch is not None:
            on_batch(outcome)
    result.seconds = time.perf_counter() - started
    return result


# -- planning -------------------------------------------------------------------------------------------


def _plan_npy(
    spec: DataSourceSpec, path: Path, attributes: Path, attr_map: Mapping[str, str]
) -> tuple[int, dict[str, str]]:
    dim = spec.vector_dimension
    vectors = _load_npy(path)
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise ValidationError(f"{path.name} holds an array of shape {list(vectors.shape)}; expected [n, {dim}]")
    if not (np.issubdtype(vectors.dtype, np.floating) or np.issubdtype(vectors.dtype, np.integer)):
        raise ValidationError(f"{path.name} holds {vectors.dtype} values; expected numbers")
    with _reading(attributes):
        meta = pq.ParquetFile(attributes)
        if meta.metadata.num_rows != vectors.shape[0]:
            raise ValidationError(
                f"{attributes.name} has {meta.metadata.num_rows:,} rows but {path.name} holds "
                f"{vectors.shape[0]:,} vectors; row i must belong to vector i"
            )
        return vectors.shape[0], _match_columns(spec, meta.schema_arrow, attr_map, attributes)


def _plan_parquet(
    spec: DataSourceSpec, path: Path, vector_column: str, attr_map: Mapping[str, str]
) -> tuple[int, dict[str, str]]:
    meta = pq.ParquetFile(path)
    schema = meta.schema_arrow
    if vector_column not in schema.names:
        raise ValidationError(
            f"{path.name} has no vector column {vector_column!r} (its columns: {', '.join(schema.names)}); "
            "name it as the vectors column (shoal import: --vectors-column)"
        )
    _refuse_repeated(schema, [vector_column], path)  # before schema.field, which cannot pick one of two
    _check_vector_type(schema.field(vector_column).type, spec.vector_dimension, vector_column)
    return meta.metadata.num_rows, _match_columns(spec, schema, attr_map, path)


def _load_npy(path: Path) -> np.ndarray:
    # Memory-mapped: a file larger than memory is read one batch at a time.
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _match_columns(
    spec: DataSourceSpec, schema: pa.Schema, attr_map: Mapping[str, str], path: Path
) -> dict[str, str]:
    """Data source attribute -> file column: mapped ones first, then same-named columns."""
    names = set(schema.names)
    columns: dict[str, str] = {}
    for column, attribute in attr_map.items():
        if attribute not in spec.attribute_types:
            raise ValidationError(f"attribute map {column}={attribute}: the data source has no attribute {attribute!r}")
        if column not in names:
            raise ValidationError(f"attribute map {column}={attribute}: {path.name} has no column {column!r}")
        if attribute in columns:  # else the last column would win without a word
            raise ValidationError(
                f"attribute map {column}={attribute}: attribute {attribute!r} is mapped from column "
                f"{columns[attribute]!r} already"
            )
        columns[attribute] = column
    for attribute in spec.attribute_types:
        # A mapped-away column keeps its own name free: `key=id` does not also read a column `key` as key.
        if attribute not in columns and attribute in names and attribute not in attr_map:
            columns[attribute] = attribute
    missing = [a for a in spec.attribute_types if a not in columns]
    if missing:
        raise ValidationError(
            f"{path.name} has no column for attribute(s) {', '.join(missing)} (its columns: "
            f"{', '.join(schema.names)}); map columns to them with attr_map (shoal import: --attr-map COLUMN=ATTRIBUTE)"
        )
    _refuse_repeated(schema, list(columns.values()), path)
    return columns


def _refuse_repeated(schema: pa.Schema, wanted: list[str], path: Path) -> None:
    """ValidationError naming the first of the `wanted` columns that `schema` holds more than once: a column is
    read by name, and which of two same-named columns is meant cannot be told. A repeated column no one reads
    is no matter."""
    for name in wanted:
        found = len(schema.get_all_field_indices(name))
        if found > 1:
            raise ValidationError(
                f"{path.name} has {found} columns named {name!r}; the column read for it must be the only one "
                "of that name (rename or drop the others)"
            )


# -- reading --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Report an unreadable or malformed file as a ValidationError naming it, not as a library error."""
    try:
        yield
    except ShoalError:
        raise
    except (OSError, pa.ArrowInvalid, ValueError) as exc:
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise ValidationError(f"cannot read {path.name}: {reason}") from exc


def _rebatch(batches: Iterator[pa.RecordBatch], size: int, limit: int) -> Iterator[pa.Table]:
    """Tables of exactly `size` rows (the last may be shorter), `limit` rows in all."""
    pending: list[pa.RecordBatch] = []
    held = sent = 0
    for batch in batches:
        pending.append(batch)
        held += batch.num_rows
        while held >= size and sent < limit:
            table = pa.Table.from_batches(pending).combine_chunks()
            take = min(size, limit - sent)
            yield table.slice(0, take)
            sent += take
            rest = table.slice(take)
            pending, held = rest.to_batches(), rest.num_rows
        if sent >= limit:
            return
    if held and sent < limit:
        yield pa.Table.from_batches(pending).slice(0, limit - sent)


def _coerce(column: pa.ChunkedArray | pa.Array, kind: AttributeType) -> pa.Array:
    """The column in the attribute's Arrow type where a lossless cast exists; else as is (validated later)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    target = ARROW_TYPES[kind]
    if arr.type == target or kind is AttributeType.GUID:
        return arr
    t = arr.type
    castable = {
        AttributeType.INT64: pa.types.is_integer(t),
        AttributeType.FLOAT64: pa.types.is_floating(t) or pa.types.is_integer(t),
        AttributeType.STRING: pa.types.is_string(t) or pa.types.is_large_string(t),
        AttributeType.DATETIME: pa.types.is_timestamp(t),
        AttributeType.BOOL: False,
    }[kind]
    if castable:
        # safe=True refuses lossy casts (overflow, truncated timestamps); the values are then checked one by one.
        with contextlib.suppress(pa.ArrowInvalid):
            return pc.cast(arr, target, safe=True)
    return arr


def _check_vector_type(t: pa.DataType, dim: int, name: str) -> None:
    if not (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise ValidationError(f"vector column {name!r} must be a list of numbers, got {t}")
    if not (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)):
        raise ValidationError(f"vector column {name!r} must hold numbers, got lists of {t.value_type}")
    if pa.types.is_fixed_size_list(t) and t.list_size != dim:
        raise ValidationError(f"vector column {name!r} holds {t.list_size}-d vectors; the data source is {dim}-d")


def _vectors(column: pa.ChunkedArray | pa.Array, dim: int, name: str) -> np.ndarray:
    """A list or fixed_size_list column as float32 [n, dim] (float16 and float64 are converted; as float64 where
    a value is past float32's range, for the upload's check to name)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    _check_vector_type(arr.type, dim, name)
    if arr.null_count:
        first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValidationError(Problem(f"vector column {name!r}: value is missing (null)", position=first))
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(lengths != dim)
    if wrong.size:
        first = int(wrong[0])
        raise ValidationError(
            Problem(f"vector column {name!r}: wrong dimension: expected {dim}, got {lengths[first]}", position=first)
        )
    values = arr.flatten()
    if values.null_count:
        raise ValidationError(f"vector column {name!r}: coordinates must not be null")
    return _float32_or_given(values.to_numpy(zero_copy_only=False).reshape(len(arr), dim))


def _float32_or_given(given: np.ndarray) -> np.ndarray:
    """Numbers read from a file as float32; as float64 where a value is past float32's range (without an overflow
    warning), so that the upload's check names that number as past float32's range, not as "NaN or infinity",
    which is what the cast made of it."""
    out = to_float32(given)  # past float32's range: inf, no warning
    if given.dtype != np.float32 and not np.isfinite(out).all():
        with np.errstate(over="ignore"):  # a float128 file past float64's range: inf, named by the check
            return np.asarray(given, dtype=np.float64)
    return out


def _at_file_row(exc: ValidationError, path: Path, offset: int) -> ValidationError:
    """The same error (same class, same other attributes) with positions counted in file rows, naming the file
    and what was kept."""
    problems = [Problem(p.rule, None if p.position is None else p.position + offset, p.attribute) for p in exc.problems]
    # Not type(exc)(problems): a subclass's constructor may take other arguments (BatchIdReusedError's batch id
    # and token); ValidationError's own sets the problems and the message, the rest is copied as it was.
    shifted = type(exc).__new__(type(exc))
    shifted.__dict__.update(exc.__dict__)
    ValidationError.__init__(shifted, problems)
    kept = f"; {offset:,} rows before row {offset:,} were imported, a re-run skips them" if offset else ""
    shifted.args = (f"{path.name}, batch at row {offset:,}: {shifted.args[0]}{kept}",)
    return shifted
