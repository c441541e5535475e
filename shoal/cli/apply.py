"""`shoal apply DIR`: create, or check, the data sources and indexes a Vektonn configuration folder declares."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shoal.cli.common import Tenant, open_shoal, out
from shoal.vektonn.yaml_config import read_folder


def apply(
    folder: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="Holds data-sources/ and indices/.")],
    tenant: Tenant = None,
) -> None:
    """Read `data-sources/{name}/{version}.yaml` and `indices/{name}/{version}.yaml`; create what is missing and
    check that what exists has the same definition (AlreadyExistsError names any difference)."""
    declared = read_folder(folder)
    with open_shoal(tenant) as shoal:
        for spec in declared.sources:
            existed = any(
                (r.spec.name, r.spec.version) == (spec.name, spec.version) for r in shoal.list_data_sources()
            )
            shoal.create_data_source(spec, exist_ok=True)
            out.print(f"data source {spec.name}/{spec.version}: {'unchanged' if existed else 'created'}")
        for index in declared.indexes:
            existed = any((r.spec.name, r.spec.version) == (index.name, index.version) for r in shoal.list_indexes())
            shoal.create_index(index, exist_ok=True)
            out.print(f"index {index.name}/{index.version}: {'unchanged' if existed else 'created'}")
