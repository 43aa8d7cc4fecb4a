"""Feature exploration: a feature database mined from a collection run, per-feature views, plotly figures,
self-contained HTML dashboards and Neuronpedia-like JSON export."""
from qwen_scope.explore.builder import Chunk, FeatureDatabaseBuilder, build_feature_database, store_chunks
from qwen_scope.explore.database import Cooccurrence, DatabaseConfig, Example, FeatureDatabase, QuantileBin

__all__ = [
    "Chunk", "Cooccurrence", "DatabaseConfig", "Example", "FeatureDatabase", "FeatureDatabaseBuilder",
    "QuantileBin", "build_feature_database", "store_chunks",
]
