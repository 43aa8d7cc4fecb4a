"""The interactive explorer: the same views in the browser (``qwen-scope app``, Gradio) and in Jupyter
(``scope.explore(text)``), computed by UI-free functions that are tested without any UI library.

    from qwen_scope.app import AppSession
    session = AppSession(nano_scope([3]))
    session.analyze("def close(self):").features       # the top feature per token
    session.card(42)                                   # a FeatureCard (database or live from the prompt)

Modules: ``session`` (state and the callbacks), ``bench`` (the steering bench and the sweep), ``render`` (HTML and
table rows, every text escaped), ``gradio_ui`` (the browser app; gradio imported only there), ``jupyter`` (the
widget, and the static HTML it falls back to).
"""
from qwen_scope.app.bench import SideView, SteeringBench, SteerView, parse_features
from qwen_scope.app.session import AppSession, FeatureRow, PromptView

__all__ = ["AppSession", "FeatureRow", "PromptView", "SideView", "SteerView", "SteeringBench", "parse_features"]
