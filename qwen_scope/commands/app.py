"""``qwen-scope app``: the interactive explorer in the browser (a local Gradio app, bound to 127.0.0.1).

Type a prompt and see its tokens coloured by their top features; click a token for its features and a feature for
its card (from --db when given, else computed from the prompt); steer generations with features picked by id or by
searching labels, baseline and steered side by side as they stream, and sweep a strength; compare two texts; read
the release's evaluation table (--eval). Needs the optional extra: pip install 'qwen-scope[app]'.

Examples::

    qwen-scope app                                            # the bundled nano model and its SAEs, offline
    qwen-scope app --model Qwen/Qwen3.5-2B-Base --release qwen-scope-3.5-2b-base-w32k-l50 --layers 12 \\
        --db runs/dashboard/database --eval runs/eval --device cuda
    qwen-scope app --port 8080 --host 0.0.0.0                 # reachable from other machines: only when asked
"""
from __future__ import annotations

import argparse

from qwen_scope.commands._scope_args import add_scope_arguments, model_layers, parse_layers

NAME = "app"
HELP = "the interactive explorer in the browser: features per token, cards, steering bench, compare (Gradio)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_scope_arguments(p)
    p.add_argument("--layers", default=None,
                   help="SAE layers to load, e.g. 12, 10,12 or 10-13 (default: the --db layer, else all nano layers; "
                        "required with --model and no --db)")
    p.add_argument("--db", default=None,
                   help="feature database directory (from `qwen-scope explore`: OUT/database) for cards, labels "
                        "and search; default: cards computed from the prompt")
    p.add_argument("--eval", dest="evaluation", default=None,
                   help="an SAE evaluation (sae_eval.json or its directory, from `qwen-scope eval sae --out`) "
                        "shown in the Evaluation tab")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1, this machine only; 0.0.0.0 serves every network)")
    p.add_argument("--port", type=int, default=7860, help="port to serve on (default 7860)")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")


def _layers(args: argparse.Namespace, db) -> list[int]:
    if args.layers is not None:
        return model_layers(args, parse_layers(args.layers))
    if db is not None and "layer" in db.meta:
        return [int(db.meta["layer"])]
    if args.model is not None:
        raise SystemExit("--model needs --layers (the SAE layers to explore, e.g. --layers 12) or a --db that "
                         "names its layer")
    return list(range(6))


def run(args: argparse.Namespace) -> int:
    from qwen_scope.app.gradio_ui import gradio_missing

    # Before any model loads: without the extra there is nothing to serve.
    missing = gradio_missing()
    if missing:
        raise SystemExit(missing)
    if not 0 < args.port < 65536:
        raise SystemExit(f"--port must be in 1..65535, got {args.port}")
    from qwen_scope.app.gradio_ui import build_app, launch
    from qwen_scope.app.session import AppSession
    from qwen_scope.commands._scope_args import build_scope
    from qwen_scope.explore.database import FeatureDatabase

    db = FeatureDatabase.load(args.db) if args.db else None
    scope = build_scope(args, _layers(args, db))
    session = AppSession(scope, db, evaluation=args.evaluation, template=args.template)
    print(f"qwen-scope app: {scope.model_name} with SAEs at layers {scope.layers} on http://{args.host}:{args.port}"
          " (Ctrl+C stops it)", flush=True)
    launch(build_app(session), host=args.host, port=args.port, share=args.share)
    return 0
