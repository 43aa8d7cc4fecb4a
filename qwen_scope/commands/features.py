"""``qwen-scope features``: the SAE features of a text, per token and per layer, and its reconstruction quality.

Examples::

    qwen-scope features --model Qwen/Qwen3.5-2B-Base --release qwen-scope-3.5-2b-base-w32k-l50 \\
        --layers 12 --text "The Eiffel Tower is in Paris."
    qwen-scope features --model Qwen/Qwen3.5-2B --release qwen-scope-3.5-2b-base-w32k-l50 --layers 10-13 \\
        --text "I love this film." --versus "I hate this film."      # demo-style feature comparison
"""
from __future__ import annotations

import argparse
import json

from qwen_scope.commands._scope_args import add_scope_arguments, build_scope, model_layers, parse_layers

NAME = "features"
HELP = "top SAE features of a text per token and layer (or compare two texts with --versus)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_scope_arguments(p)
    p.add_argument("--layers", required=True, help="SAE layers, e.g. 12 or 10,12 or 10-13 (sae-lens ids layer12 too)")
    p.add_argument("--text", required=True, help="the text to analyse")
    p.add_argument("--versus", default=None, help="a second text: rank features by activation-rate difference")
    p.add_argument("--top", type=int, default=5, help="features shown per token (default 5)")
    p.add_argument("--summary", type=int, default=10, help="features shown for the whole text (default 10)")
    p.add_argument("--by", default="max", choices=("max", "mean", "rate", "count"), help="summary ranking")
    p.add_argument("--include-first", action="store_true", help="count position 0 in statistics")
    p.add_argument("--json", dest="json_out", default=None, help="also write the result as JSON to this file")


def _features(scope, args, layers) -> dict:
    feats = scope.features(args.text, layers, skip_first=not args.include_first, template=args.template)
    result = {"text": args.text, "tokens": feats.tokens, "layers": {}}
    for n in layers:
        print(feats.table(n, args.top))
        print(f"  top {args.summary} features by {args.by}:")
        top = feats.top(n, args.summary, by=args.by)
        for s in top:
            print(f"    #{s.feature:<7} max {s.max:8.3f}  mean {s.mean:8.3f}  rate {s.rate:5.2f}")
        result["layers"][n] = {"fve": feats[n].fve, "cosine": feats[n].cosine,
                               "per_token": [feats.token_top(n, t, args.top) for t in range(len(feats.tokens))],
                               "top": [s.__dict__ for s in top]}
    return result


def _compare(scope, args, layers) -> dict:
    cmp = scope.compare(args.text, args.versus, layers, skip_first=not args.include_first, template=args.template)
    print(cmp.table(args.summary))
    return {"text_a": args.text, "text_b": args.versus,
            "layers": {n: [{**d.__dict__, "diff": d.diff} for d in cmp[n].ranked(args.summary)] for n in layers}}


def run(args: argparse.Namespace) -> int:
    layers = model_layers(args, parse_layers(args.layers))
    scope = build_scope(args, layers)
    result = _compare(scope, args, layers) if args.versus is not None else _features(scope, args, layers)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
