"""An upload as an Arrow IPC stream: a `vector` column of float lists, one column per attribute and an optional
boolean `is_deleted` column, decoded to the validated batch table column-wise (no JSON, no per-point object).

The control columns may also be named `__vector` and `__is_deleted` (no attribute name starts with `__`), and must
be when the data source has an attribute named `vector` or `is_deleted`: a plain name is the attribute's column
whenever the data source has that attribute (`control_column`), except for the flags of a body with no vector
column, which can hold tombstones only: a plain boolean `is_deleted` is taken as the flags there, as earlier
releases wrote them (`deleted_flags_column`).

The body limit bounds what a request holds only if decoding cannot make more of it than it carries, so every
IPC message is looked at before any is decoded (`_check_messages`): compressed buffers (zstd, lz4) are refused,
the record batches may declare at most `max_points` rows together, and no column (or child of one) may declare
more values than its message's body could hold (a null-typed list child costs no byte per value).
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shoal.errors import BatchTooLargeError, Problem, ValidationError
from shoal.log.records import DataSourceSpec
from shoal.log.validation import columns_to_table, dictionary_structure
from shoal.vektonn.runs import runs

ARROW = "application/vnd.apache.arrow.stream"
VECTOR_COLUMN = "vector"  # fixed-size (or equal-length) list of float per row
DELETED_COLUMN = "is_deleted"  # optional: true rows are tombstones (the key decides)
# The same control columns under names no attribute can have (ATTRIBUTE_NAME_RE refuses a leading `__`).
RESERVED_VECTOR_COLUMN = "__vector"
RESERVED_DELETED_COLUMN = "__is_deleted"


def decode_arrow_upload(spec: DataSourceSpec, body: bytes, max_points: int, max_bytes: int | None = None
                        ) -> pa.Table:
    """An Arrow IPC stream body (`vector` column of float lists, one column per attribute, optional boolean
    `is_deleted`; either also named with a leading `__`, see `control_column`) as the validated batch table, order
    kept; ValidationError naming what is wrong. `max_bytes` (default: the body's own size) bounds what a
    dictionary-encoded text column may decode to: the most a request could send plain (SHOAL_MAX_BODY_BYTES)."""
    try:
        return _decode(spec, body, max_points, max_bytes)
    except pa.ArrowException as exc:
        # A stream that read but whose buffers do not hold what its headers declare, met while its columns are
        # taken apart: a malformed body (400), never a server error or a consumer crash.
        raise ValidationError(f"not an Arrow IPC stream: {exc}") from None


def _decode(spec: DataSourceSpec, body: bytes, max_points: int, max_bytes: int | None) -> pa.Table:
    buffer = pa.py_buffer(body)
    try:
        _check_messages(buffer, max_points)  # before any buffer is decoded: nothing past the limits is made
        table = pa.ipc.open_stream(buffer).read_all()
        table.validate()  # buffer sizes and offsets against the declared lengths (cheap: no pass over values)
        names = table.column_names  # decoded from the schema's bytes: a name need not be UTF-8
    except (pa.ArrowException, OSError, UnicodeDecodeError, IndexError) as exc:
        # Any malformed stream (an integer of 5 bits, a buffer sliced past its end, a column name that is no
        # UTF-8 ...): pyarrow raises many kinds, and any other than ValidationError is a 500 over HTTP and
        # crashed `shoal consume` for every redelivery of the message.
        what = "a column name is not valid UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise ValidationError(f"not an Arrow IPC stream: {what}") from None
    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        # Looked up by name below (pyarrow raises KeyError for a repeated one, which kombu takes for a lost
        # connection: the message would come back for ever instead of going to the dead letters).
        raise ValidationError([Problem("the column appears more than once: send each column once", attribute=name)
                               for name in repeated])
    if not table.num_rows:
        raise ValidationError("the message holds no data point")
    _check_dictionaries(table, len(body) if max_bytes is None else max(max_bytes, len(body)))
    if spec.vectors_are_sparse:
        raise ValidationError("the Arrow form carries dense vectors only: send sparse vectors as JSON")
    vector_column = control_column(spec, names, VECTOR_COLUMN, RESERVED_VECTOR_COLUMN, "vectors")
    deleted_column = deleted_flags_column(spec, table)
    deleted = np.zeros(table.num_rows, dtype=bool)
    if deleted_column in names:
        col = table[deleted_column]
        if not pa.types.is_boolean(col.type) or col.null_count:
            raise ValidationError(Problem("must be a boolean column without nulls", attribute=deleted_column))
        deleted = col.to_numpy(zero_copy_only=False).astype(bool)
        table = table.drop_columns([deleted_column])
    # Runs of upserts and of tombstones, in message order: later entries win over earlier ones for a key.
    parts = []
    for start, end in runs(deleted):
        try:
            parts.append(_run_table(spec, table.slice(start, end - start), bool(deleted[start]), max_points,
                                    vector_column))
        except ValidationError as exc:
            # A run's problems count points from the run's start: named by their place in the message instead.
            raise type(exc)([replace(p, position=p.position + start) if p.position is not None else p
                             for p in exc.problems]) from None
    out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if out.num_rows > max_points:
        raise ValidationError(f"the message holds {out.num_rows} points, more than the {max_points} allowed")
    return out


def control_column(spec: DataSourceSpec, names: list[str], plain: str, reserved: str, what: str) -> str:
    """The name of the column that carries a control value (`what`: the vectors, the tombstone flags) in a body
    with columns `names`, or the name to ask for when there is none: `reserved` (`__vector`) when given, else
    `plain` (`vector`) unless the data source has an attribute of that name, whose column it then is (so such an
    attribute is uploaded as any other). Both given while `plain` is no attribute: ValidationError naming them."""
    if plain in spec.attribute_types:
        return reserved
    if reserved in names and plain in names:
        raise ValidationError(
            f"the columns '{reserved}' and '{plain}' both carry the {what} (the data source has no attribute "
            f"'{plain}'): send one of them"
        )
    return plain if plain in names else reserved if reserved in names else plain


def deleted_flags_column(spec: DataSourceSpec, table: pa.Table) -> str:
    """The name of the column that carries the tombstone flags in `table` (or the name to ask for when there is
    none), as `control_column` chooses it, but for a body that can hold tombstones only: one with no vector
    column (neither `vector` nor `__vector`) and no `__is_deleted` takes a plain boolean `is_deleted` as the flags
    even when the data source has a non-key attribute of that name."""
    names = table.column_names
    chosen = control_column(spec, names, DELETED_COLUMN, RESERVED_DELETED_COLUMN, "tombstone flags")
    if chosen in names or DELETED_COLUMN not in names or DELETED_COLUMN in spec.permanent_attributes:
        # A key named `is_deleted` keeps its column: a tombstone needs the key's value (encode_arrow then sends
        # the flags as `__is_deleted`).
        return chosen
    if VECTOR_COLUMN in names or RESERVED_VECTOR_COLUMN in names or not pa.types.is_boolean(table[DELETED_COLUMN].type):
        return chosen
    # Earlier releases' encode_arrow (Publisher.publish_columns) always wrote the flags as plain `is_deleted`, and
    # today's still does for tombstones only (the columns name no `is_deleted` then): read as the attribute, the
    # body would be upserts without vectors, refused, and the deletes of a queued message lost.
    return DELETED_COLUMN


def _run_table(spec: DataSourceSpec, part: pa.Table, deleted: bool, max_points: int,
               vector_column: str) -> pa.Table:
    """One run of upserts, or of tombstones, validated (positions counted from the run's first row); the vectors
    are the column `vector_column`."""
    attrs = {name: part[name].combine_chunks() for name in part.column_names if name != vector_column}
    if deleted:
        # Every column goes to the validation, as a tombstone's attributes do on every other write path: the key
        # columns alone, or every attribute (Vektonn's form, or a message that also upserts: the non-key values'
        # types are checked, nulls allowed, and only the key kept); an unknown column or a part of the other
        # attributes is refused, never dropped unread.
        return columns_to_table(spec, None, attrs, max_points, delete=True)
    return columns_to_table(spec, _arrow_vectors(part, spec.vector_dimension, vector_column), attrs, max_points)


def _check_dictionaries(table: pa.Table, limit: int) -> None:
    """Refuse a dictionary-encoded column that decodes to more than `limit` bytes: each row takes its value
    whole when the column is decoded, so one large value referenced by every row would make a batch of hundreds
    of megabytes from a small body (the body limit bounds what a request sends plain). A dictionary of values
    of a fixed width (numbers, timestamps, fixed-size binary) decodes to that width a row; one of nested values
    is no attribute's type, refused before anything is decoded."""
    for name in table.column_names:
        column = table[name]
        if not pa.types.is_dictionary(column.type):
            continue
        kind = column.type.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind)):
            try:
                width = (kind.bit_width + 7) // 8  # fixed-width types only; raises for the others
            except ValueError:
                raise ValidationError(Problem(f"a dictionary of {kind} values is no attribute's type",
                                              attribute=name)) from None
            decoded = width * len(column)
            if decoded > limit:
                raise ValidationError(Problem(
                    f"the dictionary-encoded column decodes to {decoded:,} bytes, more than the {limit:,} a "
                    "message may hold (SHOAL_MAX_BODY_BYTES): send fewer points per message", attribute=name))
            continue
        decoded = 0
        for chunk in column.chunks:
            try:
                # Indices in range before they index anything here. Text that is not UTF-8 is left to the
                # attribute's check, which names the points that hold it.
                dictionary_structure(chunk).validate(full=True)
            except pa.ArrowInvalid as exc:
                raise ValidationError(Problem(f"not a valid Arrow column: {exc}", attribute=name)) from None
            lengths = pc.binary_length(chunk.dictionary).fill_null(0).to_numpy(zero_copy_only=False)
            indices = chunk.indices.fill_null(0).to_numpy(zero_copy_only=False)
            decoded += int(lengths.astype(np.int64)[indices].sum()) if len(lengths) else 0
        if decoded > limit:
            raise ValidationError(Problem(
                f"the dictionary-encoded column decodes to {decoded:,} bytes, more than the {limit:,} a message "
                "may hold (SHOAL_MAX_BODY_BYTES): send fewer points per message", attribute=name))


def _arrow_vectors(part: pa.Table, dim: int, name: str) -> np.ndarray:
    """The part's vectors (column `name`) as one [rows, dim] array of the numbers sent, not yet cast to float32
    (so that a float64 past float32's range is named as such); ValidationError naming what is wrong with it."""
    if name not in part.column_names:
        raise ValidationError(Problem("missing vector column", attribute=name))
    col = part[name].combine_chunks()
    if not (pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValidationError(Problem(f"must be a list of floats, not {col.type}", attribute=name))
    if col.null_count:
        at = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValidationError(Problem("a data point needs a vector (null found)", at, name))
    if not pa.types.is_fixed_size_list(col.type):
        lengths = pa.compute.list_value_length(col).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != dim)
        if bad.size:
            raise ValidationError(
                Problem(f"wrong vector dimension: expected {dim}, got {lengths[bad[0]]}", int(bad[0]), name)
            )
    elif col.type.list_size != dim:
        raise ValidationError(Problem(f"wrong vector dimension: expected {dim}, got {col.type.list_size}",
                                      attribute=name))
    values = col.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise ValidationError(Problem(f"coordinates must be numbers, not {values.type}", attribute=name))
    if values.null_count:
        # to_numpy would make it NaN, reported as "NaN or infinity": not what was sent.
        at = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValidationError(Problem(f"coordinates must be numbers, got null at index {at % dim}", at // dim, name))
    flat = values.to_numpy(zero_copy_only=False)
    if flat.size != len(col) * dim:
        raise ValidationError(Problem(f"wrong vector dimension: expected {dim}", attribute=name))
    return flat.reshape(len(col), dim)


# -- each IPC message's header, read before its body is decoded ----------------------------------------------
#
# pyarrow tells a record batch's row count and compression only by decoding it (decompressing every buffer), so
# `_check_messages` reads them from each message's flatbuffer header, as Arrow's format/Message.fbs lays it out:
#
#   table Message { version: short; header: MessageHeader (union: a ubyte type, then an offset); bodyLength: long;
#                   custom_metadata: [KeyValue]; }          fields 0, 1 (type), 2 (offset), 3, 4
#   union MessageHeader { NONE, Schema, DictionaryBatch, RecordBatch, Tensor, SparseTensor }    tags 0..5
#   table RecordBatch { length: long; nodes: [FieldNode]; buffers: [Buffer]; compression: BodyCompression;
#                       variadicBufferCounts: [long]; }     fields 0..4
#   struct FieldNode { length: long; null_count: long; }   16 bytes, one per column and per child, depth first
#   table DictionaryBatch { id: long; data: RecordBatch; isDelta: bool; }                      fields 0..2
#
# A flatbuffer starts with the uint32 offset of its root table; a table starts with the int32 distance back to
# its vtable (uint16 vtable size, uint16 table size, then one uint16 offset per field, 0 when absent); a field
# that is a table or a vector holds the uint32 distance to it from where it is stored; a vector starts with its
# uint32 element count. Arrow verified each header (flatbuffers' verifier) when the MessageReader read it; the
# reads below check their bounds again all the same (struct.error becomes "not an Arrow IPC stream").

_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3  # MessageHeader union tags


@dataclass(frozen=True)
class BatchHeader:
    """What a record batch (or a dictionary batch's data) declares, read from its header alone."""

    rows: int
    node_lengths: tuple[int, ...]  # values per column and per child column, depth first
    compressed: bool
    dictionary: bool  # a dictionary batch (its rows are dictionary values, not data points)


class _Table:
    """A flatbuffer table at `pos` of `buf`."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - _unpack("<i", buf, pos)
        self.vtable_size = _unpack("<H", buf, self.vtable)

    def _at(self, field: int) -> int:
        """Where field `field` is stored, 0 when absent."""
        slot = 4 + 2 * field
        if slot >= self.vtable_size:  # written before the field existed: absent
            return 0
        offset = _unpack("<H", self.buf, self.vtable + slot)
        return self.pos + offset if offset else 0

    def scalar(self, field: int, fmt: str, default: int) -> int:
        at = self._at(field)
        return _unpack(fmt, self.buf, at) if at else default

    def has(self, field: int) -> bool:
        return bool(self._at(field))

    def table(self, field: int) -> _Table | None:
        at = self._at(field)
        return _Table(self.buf, at + _unpack("<I", self.buf, at)) if at else None

    def vector(self, field: int) -> tuple[int, int]:
        """(where its first element is, how many elements), (0, 0) when absent."""
        at = self._at(field)
        if not at:
            return 0, 0
        start = at + _unpack("<I", self.buf, at)
        return start + 4, _unpack("<I", self.buf, start)


def _unpack(fmt: str, buf: bytes, at: int) -> int:
    if at < 0:
        raise struct.error("offset before the start of the message header")
    return int(struct.unpack_from(fmt, buf, at)[0])


def batch_header(metadata: bytes) -> BatchHeader | None:
    """The row count, column lengths and compression a record batch or dictionary batch message declares, from
    its flatbuffer header (`pa.ipc.Message.metadata`); None for any other message (the schema)."""
    message = _Table(metadata, _unpack("<I", metadata, 0))
    kind = message.scalar(1, "<B", 0)
    if kind not in (_RECORD_BATCH, _DICTIONARY_BATCH):
        return None
    batch = message.table(2)
    if batch is not None and kind == _DICTIONARY_BATCH:
        batch = batch.table(1)  # DictionaryBatch.data
    if batch is None:
        return BatchHeader(0, (), False, kind == _DICTIONARY_BATCH)
    start, count = batch.vector(1)
    if start + 16 * count > len(metadata):
        raise struct.error("field nodes past the end of the message header")
    lengths = tuple(_unpack("<q", metadata, start + 16 * i) for i in range(count))
    return BatchHeader(batch.scalar(0, "<q", 0), lengths, batch.has(3), kind == _DICTIONARY_BATCH)


def _check_messages(buffer: pa.Buffer, max_points: int) -> None:
    """Refuse, before any record batch is decoded, a stream whose buffers are compressed, whose record batches
    declare more than `max_points` rows together, or a column of which declares more values than its message's
    body could hold (8 per byte, as booleans): what decoding it would make would not be bounded by the body.
    The MessageReader reads each message's header and slices its body out of `buffer` without copying. Bytes
    after the stream's end-of-stream marker are refused: a second stream there would never be read."""
    rows = 0
    source = pa.BufferReader(buffer)
    for message in pa.ipc.MessageReader.open_stream(source):
        try:
            header = batch_header(message.metadata.to_pybytes())
        except struct.error as exc:
            raise ValidationError(f"not an Arrow IPC stream: unreadable message header ({exc})") from None
        if header is None:
            continue
        if header.compressed:
            raise ValidationError(
                "the Arrow stream's buffers are compressed (zstd or lz4): send it uncompressed, as the body limit "
                "(SHOAL_MAX_BODY_BYTES) is what bounds a request"
            )
        if header.rows < 0 or any(n < 0 for n in header.node_lengths):
            raise ValidationError("not an Arrow IPC stream: a record batch declares a negative length")
        if not header.dictionary:
            rows += header.rows
            if rows > max_points:
                raise BatchTooLargeError(Problem(
                    f"batch holds at least {rows} points, more than the configured maximum {max_points}"
                ))
        body = message.body.size if message.body is not None else 0
        if max(header.node_lengths, default=0) > max(max_points, 8 * body):
            raise ValidationError(
                f"the Arrow stream declares a column of {max(header.node_lengths)} values in a message of "
                f"{body} bytes: more than its buffers hold"
            )
    after = buffer.size - source.tell()
    if after:
        raise ValidationError(f"not an Arrow IPC stream: {after} bytes after its end (send one stream per body)")
