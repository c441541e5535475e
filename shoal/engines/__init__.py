"""kNN index engines behind one small interface (see `base.Engine`).

Algorithms: `flat` (exact, dense), `flat_sparse` (exact, sparse), `hnsw` (hnswlib), `ivf` (faiss IVF-Flat).
Importing this package registers all of them in `ENGINES`.
"""

from shoal.engines import flat, flat_sparse, hnsw, ivf  # noqa: F401  (each module registers its engine)
from shoal.engines.base import ENGINES, Engine, available_cores, get_engine
from shoal.engines.metrics import Metric, exact_distances, exact_top_k, higher_is_nearer
from shoal.engines.sparse import SparseRows
from shoal.vektonn.algorithms import from_vektonn

__all__ = [
    "ENGINES",
    "Engine",
    "Metric",
    "SparseRows",
    "available_cores",
    "exact_distances",
    "exact_top_k",
    "from_vektonn",
    "get_engine",
    "higher_is_nearer",
]
