"""Index version manifests as typed, immutable values.

A version's manifest (stored as JSON in `index_versions.manifest`) names the index segments the version is
made of, with each segment's splits, files, checksums and deletions, and the watermark it is exact at:

    {"generation": 1, "watermark": 120, "segments": [
        {"id": "<uuid>", "dir": "tenants/.../shard-0/<uuid>", "rows": 100, "min_seq": 1, "max_seq": 120,
         "rows_checksum": "sha256:...",
         "splits": [{"key": "...", "values": {...}, "start": 0, "end": 100, "file": "split-0.bin",
                     "checksum": "sha256:..."}],
         "deleted": null | {"path": "...", "count": 3, "checksum": "sha256:..."},
         "keys_checksum": "sha256:..."}]}

("quick" and "keys_checksum" appear only when set: entries written before they existed read unchanged.)

`from_json` reads that form and `to_json` writes it back key for key, so rows written before these classes
existed load unchanged and new rows look the same: no migration. Code reads manifests only through these
classes; the dict form lives in the catalog and at the edges (`of` accepts either).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

ROWS_FILE = "rows.parquet"  # a segment's rows table, in its folder
KEYS_FILE = "keys.parquet"  # its key column alone, in row order (segments written since session 12)


# Postgres' JSON (jsonb) holds no NUL character: a split value or key holding one is stored as its UTF-8 bytes in
# hex under this one key (attribute values are scalars, so no value is ever such an object by itself).
NUL_TEXT = "text_hex"


def stored_text(value: Any) -> Any:
    """`value` as a manifest can store it: a string holding NUL as {NUL_TEXT: hex}, anything else unchanged."""
    if isinstance(value, str) and "\x00" in value:
        return {NUL_TEXT: value.encode("utf-8", "surrogatepass").hex()}
    return value


def read_text(value: Any) -> Any:
    """The value `stored_text` stored."""
    if isinstance(value, Mapping) and set(value) == {NUL_TEXT}:
        return bytes.fromhex(value[NUL_TEXT]).decode("utf-8", "surrogatepass")
    return value


@dataclass(frozen=True)
class SplitEntry:
    """One split of a segment: its split-attribute values, its row range and its engine file."""

    key: str
    values: Mapping[str, Any]  # split attribute -> value as JSON stores it (datetimes as ISO text)
    start: int
    end: int
    file: str  # relative to the segment's folder
    checksum: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SplitEntry:
        """The split a manifest's JSON entry describes."""
        return cls(
            str(read_text(data["key"])), {a: read_text(v) for a, v in data["values"].items()}, int(data["start"]),
            int(data["end"]), str(data["file"]), str(data["checksum"]),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON entry, as stored."""
        return {
            "key": stored_text(self.key),
            "values": {a: stored_text(v) for a, v in self.values.items()},
            "start": self.start,
            "end": self.end,
            "file": self.file,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class DeletionEntry:
    """The deleted row numbers a version records for a segment: one immutable file."""

    path: str  # full storage path (not relative to the segment)
    count: int
    checksum: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeletionEntry:
        """The deletions a manifest's JSON entry describes."""
        return cls(str(data["path"]), int(data["count"]), str(data["checksum"]))

    def to_json(self) -> dict[str, Any]:
        """The JSON entry, as stored."""
        return {"path": self.path, "count": self.count, "checksum": self.checksum}


@dataclass(frozen=True)
class SegmentEntry:
    """One index segment as a version uses it: the immutable folder plus the version's deletions in it."""

    id: str
    dir: str
    rows: int
    min_seq: int
    max_seq: int
    rows_checksum: str
    splits: tuple[SplitEntry, ...]
    deleted: DeletionEntry | None = None
    # Built quickly (a low ef_construction) to keep up with ingest; merges rebuild it at the index's own
    # parameters once the shard has no backlog. Stored only when true, so other entries keep their old form.
    quick: bool = False
    # The checksum of KEYS_FILE, the rows' keys alone: builds read a segment's keys (to mark the rows newer entries
    # replace) from it rather than from the whole rows file. None for segments written before it existed; stored
    # only when set, so those entries keep their old form.
    keys_checksum: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SegmentEntry:
        """The segment a manifest's JSON entry describes."""
        deleted = data.get("deleted")
        return cls(
            id=str(data["id"]),
            dir=str(data["dir"]),
            rows=int(data["rows"]),
            min_seq=int(data["min_seq"]),
            max_seq=int(data["max_seq"]),
            rows_checksum=str(data["rows_checksum"]),
            splits=tuple(SplitEntry.from_json(s) for s in data["splits"]),
            deleted=DeletionEntry.from_json(deleted) if deleted else None,
            quick=bool(data.get("quick", False)),
            keys_checksum=str(data["keys_checksum"]) if data.get("keys_checksum") else None,
        )

    @classmethod
    def of(cls, entry: SegmentEntry | Mapping[str, Any]) -> SegmentEntry:
        """`entry` itself, or the segment its JSON form describes."""
        return entry if isinstance(entry, SegmentEntry) else cls.from_json(entry)

    def to_json(self) -> dict[str, Any]:
        """The JSON entry, as stored (key for key what `build_segment` always wrote)."""
        return {
            "id": self.id,
            "dir": self.dir,
            "rows": self.rows,
            "min_seq": self.min_seq,
            "max_seq": self.max_seq,
            "rows_checksum": self.rows_checksum,
            "splits": [s.to_json() for s in self.splits],
            "deleted": self.deleted.to_json() if self.deleted else None,
        } | ({"quick": True} if self.quick else {}) | (
            {"keys_checksum": self.keys_checksum} if self.keys_checksum else {})

    @property
    def deleted_count(self) -> int:
        """How many of the segment's rows this version deletes."""
        return self.deleted.count if self.deleted else 0

    @property
    def rows_path(self) -> str:
        """Storage path of the segment's rows table."""
        return f"{self.dir}/{ROWS_FILE}"

    @property
    def keys_path(self) -> str | None:
        """Storage path of the segment's keys file; None when it was written without one."""
        return f"{self.dir}/{KEYS_FILE}" if self.keys_checksum else None

    def split_path(self, split: SplitEntry) -> str:
        """Storage path of one split's engine file."""
        return f"{self.dir}/{split.file}"

    def files(self) -> list[str]:
        """Every storage path the entry references: rows, keys if any, engine files, then the deletions file if
        any."""
        files = [self.rows_path, *([self.keys_path] if self.keys_path else []),
                 *(self.split_path(s) for s in self.splits)]
        if self.deleted:
            files.append(self.deleted.path)
        return files

    def with_deletions(self, deleted: DeletionEntry | None) -> SegmentEntry:
        """The same segment with other deletions (None: no row deleted)."""
        return replace(self, deleted=deleted)


@dataclass(frozen=True)
class Manifest:
    """An index version's content: its segments, in the order they were added, and its watermark."""

    generation: int
    watermark: int
    segments: tuple[SegmentEntry, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """The manifest a version's stored JSON describes."""
        return cls(
            int(data["generation"]),
            int(data["watermark"]),
            tuple(SegmentEntry.from_json(e) for e in data.get("segments", ())),
        )

    @classmethod
    def of(cls, manifest: Manifest | Mapping[str, Any]) -> Manifest:
        """`manifest` itself, or the manifest its JSON form describes."""
        return manifest if isinstance(manifest, Manifest) else cls.from_json(manifest)

    def to_json(self) -> dict[str, Any]:
        """The JSON to store, key for key what versions always stored."""
        return {
            "generation": self.generation,
            "watermark": self.watermark,
            "segments": [e.to_json() for e in self.segments],
        }

    def files(self) -> set[str]:
        """Every storage path the version's segments reference."""
        return {p for e in self.segments for p in e.files()}


def segments_of(manifest: Manifest | Mapping[str, Any]) -> tuple[SegmentEntry, ...]:
    """The segment entries of a manifest in either form (a JSON form without "segments" has none).

    Unlike `Manifest.of` it needs no generation or watermark, so it reads any JSON that lists segments.
    """
    if isinstance(manifest, Manifest):
        return manifest.segments
    return tuple(SegmentEntry.from_json(e) for e in manifest.get("segments", ()))


def all_files(manifests: Iterable[Manifest | Mapping[str, Any]]) -> set[str]:
    """Every storage path the segments of these manifests reference."""
    return {p for m in manifests for e in segments_of(m) for p in e.files()}
