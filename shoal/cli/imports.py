"""`shoal import`: bulk-import a file through shoal.intake.bulk, with a progress bar and a report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from shoal.cli.common import Name, Tenant, Version, err, fail, load_settings, open_shoal, out, split_pairs
from shoal.cli.formatting import count
from shoal.errors import BatchIdReusedError, ValidationError
from shoal.intake.bulk import DEFAULT_BATCH_SIZE, BatchOutcome, ImportResult, is_npy, plan_import, run_import


def _check_file_options(file: Path, vectors_column: str | None, attributes: Path | None) -> None:
    # plan_import refuses these too; here they are usage errors (exit 2) naming the option.
    if is_npy(file):
        if attributes is None:
            raise typer.BadParameter("a .npy file of vectors needs --attributes FILE.parquet", param_hint="FILE")
        if vectors_column is not None:
            raise typer.BadParameter(
                "only for Parquet files; a .npy file is all vectors", param_hint="--vectors-column"
            )
    elif attributes is not None:
        raise typer.BadParameter("only with a .npy file of vectors", param_hint="--attributes")


def _attribute_map(values: list[str] | None) -> dict[str, str]:
    """--attr-map COLUMN=ATTRIBUTE items as {column: attribute}; a column or an attribute named twice is a usage
    error (one of the two entries would otherwise be dropped without a word)."""
    mapping: dict[str, str] = {}
    for column, attribute in split_pairs(values, "=", "COLUMN=ATTRIBUTE", "--attr-map"):
        if column in mapping:
            raise typer.BadParameter(
                f"column {column!r} is mapped twice ({column}={mapping[column]}, {column}={attribute})",
                param_hint="--attr-map",
            )
        twice = [c for c, a in mapping.items() if a == attribute]
        if twice:
            raise typer.BadParameter(
                f"attribute {attribute!r} is mapped from two columns ({twice[0]}={attribute}, {column}={attribute})",
                param_hint="--attr-map",
            )
        mapping[column] = attribute
    return mapping


def _progress_bar() -> Progress:
    # On stderr: stdout keeps only the report, for scripts.
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("points"),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
    )


def _report(result: ImportResult, file: Path, name: str, version: str) -> None:
    rate = result.points / max(result.seconds, 1e-9)
    # "Imported" counts what this run wrote; a re-run that finds every batch committed before wrote nothing.
    out.print(
        f"Imported {count(result.new_points)} points from {file.name} into {name}/{version} in "
        f"{result.seconds:.2f} s (read {count(result.points)}, {count(int(rate))} points/s)."
    )
    if result.skipped_batches:
        out.print(
            f"{count(result.skipped_points)} points in {result.skipped_batches} of {result.batches} batches "
            "were imported before (same batch ids) and were not written again."
        )
    out.print(f"Last write token: {result.token}")


def import_file(
    name: Name,
    version: Version,
    file: Annotated[
        Path,
        typer.Argument(
            help="A Parquet file (attribute columns plus a vector column), or a .npy file of vectors "
            "with --attributes.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ],
    vectors_column: Annotated[
        str | None,
        typer.Option("--vectors-column", help="Parquet column holding the vectors (list of numbers); default: vector."),
    ] = None,
    attributes: Annotated[
        Path | None,
        typer.Option(
            "--attributes",
            help="With a .npy FILE: the Parquet file of attribute columns, row i belonging to vector i.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    attr_map: Annotated[
        list[str] | None,
        typer.Option("--attr-map", help="COLUMN=ATTRIBUTE: read the attribute from a column of another name."),
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="Points per uploaded batch.")
    ] = DEFAULT_BATCH_SIZE,
    limit: Annotated[int | None, typer.Option("--limit", min=0, help="Import only the first N rows.")] = None,
    batch_prefix: Annotated[
        str | None,
        typer.Option("--batch-prefix", help="Prefix of the batch ids (default: import:FILE-NAME:FILE-SIZE; a name "
                     "over 60 characters as its first 40 plus a hash of the whole name)."),
    ] = None,
    tenant: Tenant = None,
) -> None:
    """Bulk-import a Parquet file, or a .npy file of vectors plus a Parquet file of attributes.

    Attribute columns are found by the data source's attribute names (or --attr-map); other columns are
    ignored. Vectors may be float16, float32 or float64; they are stored as float32.

    Re-running is safe: each batch is uploaded with the id PREFIX:OFFSET+COUNT, PREFIX being
    import:FILE-NAME:FILE-SIZE (plus the --attributes file's name and size; a name over 60 characters
    shortened to its first 40 and a hash of the whole name), and a batch id the data source has committed
    before writes nothing. So an import that stopped half way resumes where it stopped, and a repeated one
    adds no log entries. Keep the same --batch-size and --limit to match the earlier batches. Two different
    files with the same name and size (or a file rewritten with the same size) would share ids: a batch id
    met again with other rows is refused, and the other file needs its own --batch-prefix.
    """
    _check_file_options(file, vectors_column, attributes)
    mapping = _attribute_map(attr_map)
    settings = load_settings()
    if batch_size > settings.max_batch_points:
        raise ValidationError(
            f"--batch-size {batch_size} exceeds the largest batch allowed (SHOAL_MAX_BATCH_POINTS="
            f"{settings.max_batch_points})"
        )
    with open_shoal(tenant, settings, existing=True) as shoal:
        # Made first: run_import judges which batches are new against the head this producer saw.
        producer = shoal.producer(name, version)
        plan = plan_import(
            producer.spec, file, attributes=attributes, vectors_column=vectors_column, attr_map=mapping,
            limit=limit, batch_prefix=batch_prefix,
        )
        if plan.rows == 0:
            out.print(f"Nothing to import from {file.name}.")
            return
        err.print(
            f"Importing {count(plan.rows)} rows of {file.name} into {name}/{version} (tenant "
            f"{producer.source.tenant!r}); vectors from {plan.vector_column or file.name}, batches of "
            f"{count(batch_size)}",
            soft_wrap=True,
        )
        try:
            with _progress_bar() as progress:
                task = progress.add_task("import", total=plan.rows)

                def advance(outcome: BatchOutcome) -> None:
                    progress.update(task, advance=outcome.points)

                result = run_import(producer, plan, batch_size, on_batch=advance)
        except BatchIdReusedError as exc:
            # The batch ids are the file's name and size: a file rewritten with the same size, or another file of
            # the same name and size, meets the ids of an earlier import.
            fail(f"{exc}; an earlier import used these batch ids for other rows (a file with the same name and "
                 "size): import this one under its own --batch-prefix")
    _report(result, file, name, version)
