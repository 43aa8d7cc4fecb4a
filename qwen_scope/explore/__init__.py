"""Feature exploration: a feature database mined from a collection run, per-feature views, plotly figures,
self-contained HTML dashboards and Neuronpedia-like JSON export.

    db = build_feature_database(store_chunks(ActivationStore("runs/store"), "resid_post.3"), d_sae=sae.d_sae)
    db.save("runs/db")
    feature_card(db, 123, scope=scope)            # in Jupyter: the card
    write_dashboard(db, "runs/dashboard", scope=scope)
"""
from qwen_scope.explore.builder import Chunk, FeatureDatabaseBuilder, build_feature_database, store_chunks
from qwen_scope.explore.card import DecodedExample, FeatureCard, feature_card
from qwen_scope.explore.database import Cooccurrence, DatabaseConfig, Example, FeatureDatabase, QuantileBin
from qwen_scope.explore.export import feature_json, write_feature_json
from qwen_scope.explore.figures import (comparison_figure, density_figure, histogram_figure, layer_range_figure,
                                        logit_lens_figure, prompt_heatmap, token_features_figure)
from qwen_scope.explore.html import HtmlView, feature_card_html, feature_on_text, write_dashboard
from qwen_scope.explore.views import (FeatureView, LogitLens, decoder_norms, feature_views, logit_lens, make_decoder,
                                      nearest_features)

__all__ = [
    "Chunk", "Cooccurrence", "DatabaseConfig", "DecodedExample", "Example", "FeatureCard", "FeatureDatabase",
    "FeatureDatabaseBuilder", "FeatureView", "HtmlView", "LogitLens", "QuantileBin", "build_feature_database",
    "comparison_figure", "decoder_norms", "density_figure", "feature_card", "feature_card_html", "feature_json",
    "feature_on_text", "feature_views", "histogram_figure", "layer_range_figure", "logit_lens", "logit_lens_figure",
    "make_decoder", "nearest_features", "prompt_heatmap", "store_chunks", "token_features_figure",
    "write_dashboard", "write_feature_json",
]
