"""The bundled demo sample: 2,000 Debian packages with their description embeddings.

`vectors_f16.npy` holds the embeddings ([2000, 384], float16, unit length; all-MiniLM-L6-v2 over each
package's short description, cosine metric) and `packages.parquet` the attributes of the same packages, row
i belonging to vector i: id, package, section, priority, installed_size_kb, version, architecture and the
description that was embedded. No column has nulls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shoal.log.records import AttributeType, DataSourceSpec

VECTORS_FILE = "vectors_f16.npy"
ATTRIBUTES_FILE = "packages.parquet"

DEMO_SPEC = DataSourceSpec(
    name="debian.packages",
    version="1.0",
    vector_dimension=384,
    attribute_types={
        "id": AttributeType.INT64,
        "package": AttributeType.STRING,
        "section": AttributeType.STRING,
        "priority": AttributeType.STRING,
        "installed_size_kb": AttributeType.INT64,
        "version": AttributeType.STRING,
        "architecture": AttributeType.STRING,
    },
    permanent_attributes=["id"],
    description="Debian packages, embedded by their short description (shoal demo sample)",
    custom_metadata={"model": "sentence-transformers/all-MiniLM-L6-v2", "metric": "cosine"},
)


def load_demo(limit: int | None = None) -> tuple[np.ndarray, pa.Table]:
    """The demo sample: vectors as float32 [n, 384] and the attributes table with the same n rows.

    The table also holds a `description` column that DEMO_SPEC does not declare; select
    `DEMO_SPEC.attribute_types` before uploading. `limit` keeps the first rows only (at most 2,000 exist).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must not be negative, got {limit}")
    here = resources.files(__name__)
    with resources.as_file(here / VECTORS_FILE) as path:
        vectors = np.load(path, mmap_mode="r")
        vectors = np.asarray(vectors[:limit], dtype=np.float32)
    with resources.as_file(here / ATTRIBUTES_FILE) as path:
        table = pq.read_table(path)
    table = table.slice(0, vectors.shape[0])
    return vectors, table


@contextlib.contextmanager
def demo_files() -> Iterator[tuple[Path, Path]]:
    """Paths of the bundled vectors (.npy) and attributes (.parquet) files, real files while the context lasts.

    Suits shoal.intake.bulk.plan_import; the attributes file also holds the undeclared `description` column.
    """
    here = resources.files(__name__)
    # as_file: the package may be installed as a zip, where a resource has no path until extracted.
    with resources.as_file(here / VECTORS_FILE) as vectors, resources.as_file(here / ATTRIBUTES_FILE) as attributes:
        yield Path(vectors), Path(attributes)
