"""`shoal search`: k nearest data points of an index for one or more query vectors, at a chosen consistency."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from shoal.cli.common import AsJson, Tenant, open_shoal, out, split_pairs
from shoal.cli.formatting import cell, count, echo_json
from shoal.cli.indexes import IndexName, IndexVersion
from shoal.engines.metrics import Metric, higher_is_nearer
from shoal.errors import Problem, QueryError, ValidationError
from shoal.log.records import AttributeType, DataSourceSpec, SparseVector, WriteToken
from shoal.log.validation import SUB_MICROSECOND, sub_microsecond_text
from shoal.searcher.consistency import Consistency
from shoal.searcher.execute import Hit

SHOWN_COORDINATES = 4  # of a vector in a table cell


def parse_consistency(text: str) -> Consistency:
    """eventual, strong or at_least:SEQ; SEQ may be a whole write token, NAME/VERSION@SEQ, as imports print,
    and then the search is refused (QueryError) unless the index is over that data source."""
    text = text.strip()
    if text.startswith("at_least:") and "@" in text:
        # The token's data source is kept: a seq counts one data source's log, so another's token must be
        # refused by the searcher, not taken as a seq of the searched index's log.
        source, _, seq = text.removeprefix("at_least:").rpartition("@")
        name, slash, version = source.partition("/")
        if not slash or not name or not version or not (seq.isascii() and seq.isdigit()):
            raise typer.BadParameter(
                f"{text[:120]!r} is not at_least:SEQ or at_least:NAME/VERSION@SEQ (a write token)",
                param_hint="--consistency",
            )
        try:
            return Consistency.at_least(WriteToken(int(seq), name, version))
        except ValidationError as exc:  # a seq past the bigint range
            raise typer.BadParameter("; ".join(map(str, exc.problems)), param_hint="--consistency") from None
    try:
        return Consistency.parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--consistency") from None


def parse_dense(text: str) -> list[float]:
    """A dense query vector written as numbers separated by commas or blanks."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [float(p) for p in parts]
    except ValueError:
        raise typer.BadParameter(
            f"{text[:40]!r} is not a list of numbers like 0.1,0.2,0.3", param_hint="--query"
        ) from None


def parse_sparse(text: str) -> SparseVector:
    """A sparse query vector written as INDEX:VALUE pairs separated by commas or blanks."""
    indices, values = [], []
    for item in text.replace(",", " ").split():
        left, found, right = item.partition(":")
        try:
            if not found:
                raise ValueError
            indices.append(int(left))
            values.append(float(right))
        except ValueError:
            raise typer.BadParameter(
                f"{item!r} is not INDEX:VALUE (the index holds sparse vectors; write e.g. 3:0.5,17:0.25)",
                param_hint="--query",
            ) from None
    return SparseVector(indices, values)


def load_query_file(path: Path, sparse: bool, dimension: int | None = None) -> list[Any]:
    """Query vectors from a .npy file: one vector [d] or one per row [n, d] (sparse: the non-zeros of each row).

    For a sparse index, `dimension` is its data source's: a row of another width is a QueryError, as the
    searcher's for a dense query of the wrong dimension (a sparse query keeps only its non-zeros, whose
    indices alone cannot tell a narrower row from a right one).
    """
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(f"cannot read {path.name} as .npy: {exc}", param_hint="--query-file") from None
    if array.ndim == 1:
        array = array[None, :]
    # Real numbers only: np.number takes complex too, whose imaginary part the cast below would silently drop.
    if array.ndim != 2 or array.dtype.kind not in "fiu":
        raise typer.BadParameter(
            f"{path.name} must hold real numbers (floats or integers) shaped [d] or [n, d], not {array.dtype} "
            f"{list(array.shape)}",
            param_hint="--query-file",
        )
    # float64, which holds every number a .npy file may (float16..64, ints): the searcher casts to float32 and
    # names a coordinate past float32's range, where a cast here would have made it an infinity.
    rows = np.asarray(array, dtype=np.float64)
    if sparse and dimension is not None and rows.shape[1] != dimension:
        raise QueryError(f"--query-file {path.name}: wrong query dimension: expected {dimension}, got {rows.shape[1]}")
    if sparse:
        return [SparseVector(np.flatnonzero(r).tolist(), r[np.flatnonzero(r)].tolist()) for r in rows]
    return list(rows)


def split_value(kind: AttributeType, name: str, text: str) -> Any:
    """A split filter value written on the command line, as the attribute's type wants it."""
    try:
        if kind is AttributeType.INT64:
            return int(text)
        if kind is AttributeType.FLOAT64:
            return float(text)
        if kind is AttributeType.BOOL:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if kind is AttributeType.DATETIME:
            value = dt.datetime.fromisoformat(text)
            if sub_microsecond_text(text):  # fromisoformat dropped the digits: it would name another instant
                raise ValidationError(Problem(f"{text!r} {SUB_MICROSECOND}", attribute=name))
            return value
    except ValueError:
        raise ValidationError(Problem(f"{text!r} is not a {kind.value} value", attribute=name)) from None
    return text  # string and guid (checked by the searcher)


def split_items(values: list[str] | None, names: Collection[str]) -> list[str]:
    """--split options as NAME=VALUE items: one option may hold several, separated by commas, but a comma
    followed by anything other than NAME=... (NAME one of `names`) belongs to the value (`city=Paris, France`)."""
    items: list[str] = []
    for value in values or []:
        first = len(items)
        for part in value.split(","):
            if not part.strip():
                continue  # `lang=en,` as `lang=en`, as other comma-separated options read it
            left, found, _ = part.partition("=")
            if len(items) > first and not (found and left.strip() in names):
                items[-1] += "," + part
            else:
                items.append(part)
    return items


def parse_split_filter(values: list[str] | None, source: DataSourceSpec) -> dict[str, Any]:
    """--split NAME=VALUE items as a split filter with typed values."""
    wanted: dict[str, Any] = {}
    items = split_items(values, source.attribute_types)
    for name, text in split_pairs(items, "=", "NAME=VALUE", "--split", commas=False):
        kind = source.attribute_types.get(name)
        wanted[name] = split_value(kind, name, text) if kind is not None else text
    return wanted


def _vector_text(vector: Any) -> str:
    if vector is None:
        return "-"
    if isinstance(vector, SparseVector):
        pairs = [f"{i}:{v:.3g}" for i, v in zip(vector.indices[:SHOWN_COORDINATES], vector.values, strict=False)]
        more = ", …" if len(vector.indices) > SHOWN_COORDINATES else ""
        return f"{{{', '.join(pairs)}{more}}} ({len(vector.indices)} non-zero)"
    values = list(vector)
    shown = ", ".join(f"{v:.3g}" for v in values[:SHOWN_COORDINATES])
    more = ", …" if len(values) > SHOWN_COORDINATES else ""
    return f"[{shown}{more}] ({len(values)}-d)"


def _vector_json(vector: Any) -> Any:
    if isinstance(vector, SparseVector):
        return {"indices": list(vector.indices), "values": list(vector.values)}
    return None if vector is None else [float(v) for v in vector]


def parse_search_params(items: list[str]) -> dict[str, int]:
    """--param NAME=INTEGER options as a dict; the engine checks names and ranges."""
    params: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            params[name.strip()] = int(value)
        except ValueError:
            raise typer.BadParameter(f"expected NAME=INTEGER, got {item!r}", param_hint="--param") from None
    return params


def hits_table(hits: Sequence[Hit], attributes: tuple[str, ...], title: str, *, vectors: bool = False) -> Table:
    """One row per hit, nearest first: rank, distance, the attributes, and on request the vector."""
    table = Table(title=title, title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("distance", justify="right")
    for a in attributes:
        table.add_column(a, overflow="fold")
    if vectors:
        table.add_column("vector", overflow="fold")
    for rank, hit in enumerate(hits, 1):
        row = [str(rank), f"{hit.distance:.4f}", *(cell(hit.attributes.get(a)) for a in attributes)]
        if vectors:
            row.append(_vector_text(hit.vector))
        table.add_row(*row)
    return table


def search(
    index: IndexName,
    version: IndexVersion,
    query: Annotated[
        list[str] | None,
        typer.Option(
            "--query",
            "-q",
            help='A query vector: "0.1,0.2,..." (sparse indexes: "INDEX:VALUE,..."); repeat for more queries.',
        ),
    ] = None,
    query_file: Annotated[
        Path | None,
        typer.Option("--query-file", help="A .npy file of query vectors, [d] or [n, d].", exists=True,
                     dir_okay=False, readable=True),
    ] = None,
    k: Annotated[int, typer.Option("-k", "--k", min=1, help="How many nearest data points per query.")] = 10,
    split: Annotated[
        list[str] | None,
        typer.Option("--split", help="Search only splits with NAME=VALUE (a split attribute); repeat for more, or "
                     "separate them by commas (a comma not followed by NAME= is part of the value)."),
    ] = None,
    consistency: Annotated[
        str,
        typer.Option(
            "--consistency",
            help="eventual (what the index serves now), strong (every committed write) or at_least:SEQ "
            "(every write up to a write token's seq; the whole token NAME/VERSION@SEQ works too, and is refused "
            "for an index over another data source).",
        ),
    ] = "eventual",
    vectors: Annotated[bool, typer.Option("--vectors", help="Also return each hit's vector.")] = False,
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            help="A query-time parameter for this search only, NAME=INTEGER: ef_search (HNSW) or nprobe (IVF); "
            "repeat for more.",
        ),
    ] = None,
    as_json: AsJson = False,
    tenant: Tenant = None,
) -> None:
    """Search an index: the k nearest data points per query vector, nearest first.

    Stronger consistency than eventual adds an exact scan of the log entries the served index version does
    not reflect yet, so a write is found the moment its token is acknowledged.
    """
    level = parse_consistency(consistency)
    search_params = parse_search_params(param or [])
    if not query and query_file is None:
        raise typer.BadParameter("give at least one --query or a --query-file", param_hint="--query")
    with open_shoal(tenant, existing=True) as shoal:
        searcher = shoal.searcher(follow=False)
        try:
            view = searcher.view(index, version)
            source = view.source.spec
            parse = parse_sparse if source.vectors_are_sparse else parse_dense
            queries: list[Any] = [parse(q) for q in query or []]
            if query_file is not None:
                queries += load_query_file(query_file, source.vectors_are_sparse, source.vector_dimension)
            split_filter = parse_split_filter(split, source)
            results = searcher.search(
                index, version, queries, k, split_filter=split_filter, retrieve_vectors=vectors, consistency=level,
                search_params=search_params,
            )
            served = searcher.served_watermarks(index, version)
        except ValidationError as exc:
            # A search writes nothing: its broken rules (a split value of the wrong type, say) must not be
            # reported as "invalid input, nothing written".
            raise QueryError.of(exc) from None
        finally:
            searcher.close()
    if as_json:
        echo_json(
            [
                {
                    "query": qi,
                    "hits": [
                        {"rank": rank, "distance": h.distance, "attributes": h.attributes}
                        | ({"vector": _vector_json(h.vector)} if vectors else {})
                        for rank, h in enumerate(hits, 1)
                    ],
                }
                for qi, hits in enumerate(results)
            ]
        )
        return
    spec = view.index.spec
    attributes = spec.stored_attributes()
    watermarks = sorted(set(served.values()))
    nearer = "higher is nearer" if higher_is_nearer(Metric(spec.metric)) else "lower is nearer"
    out.print(
        f"{index}/{version}: {spec.algorithm}, metric {spec.metric} ({nearer}); consistency {consistency}; "
        f"served watermark {', '.join(count(w) for w in watermarks) or '-'}"
    )
    for qi, hits in enumerate(results):
        title = f"Query {qi + 1} of {len(results)}: {len(hits)} nearest"
        if not hits:
            out.print(f"{title}: no hits.")
            continue
        out.print(hits_table(hits, attributes, title, vectors=vectors))
