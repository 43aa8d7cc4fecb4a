"""``qwen-scope steer``: generate with and without SAE feature steering, side by side with token probabilities.

Examples::

    qwen-scope steer --model Qwen/Qwen3.5-2B --release qwen-scope-3.5-2b-base-w32k-l50 \\
        --layer 12 --feature 6159 --strength -20 --prompt "Tell me about the moon."
    qwen-scope steer ... --edit 12:6159:clamp:0 --edit 14:77:add:5:unit@generated     # several edits
    qwen-scope steer ... --layer 12 --feature 6159 --sweep -100,-20,0,20,100          # strength sweep
"""
from __future__ import annotations

import argparse
import json

from qwen_scope.commands._scope_args import add_scope_arguments, build_scope, positive_int

NAME = "steer"
HELP = "steer generation with SAE features (add / clamp / ablate) and show baseline vs steered text"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_scope_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt to continue, without and with steering")
    p.add_argument("--layer", type=int, default=None, help="layer of --feature")
    p.add_argument("--feature", type=int, action="append", default=[], help="feature id (repeatable)")
    p.add_argument("--strength", default="20", help="add: strength or light/medium/strong (5/20/100); clamp: value")
    p.add_argument("--mode", default="add", choices=("add", "clamp", "ablate"),
                   help="add the decoder direction (default), clamp the feature's code to --strength, or ablate it")
    p.add_argument("--scale", default="raw", choices=("raw", "unit", "norm"),
                   help="add: raw decoder column (Qwen demo), unit direction, or fraction of the residual norm")
    p.add_argument("--positions", default="all", help="all, prompt, generated, or e.g. 0,2,5-8 (may add ,generated)")
    p.add_argument("--edit", action="append", default=[],
                   help="LAYER:FEATURE:MODE[:VALUE[:SCALE]][@POSITIONS], repeatable, e.g. 12:6159:add:-20@generated")
    p.add_argument("--sweep", default=None,
                   help="comma-separated strengths for one --layer/--feature, e.g. -100,-20,0,20,100")
    p.add_argument("--max-new-tokens", type=positive_int, default=40, help="tokens generated per run (default 40)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0, help="torch seed set before each generation (default 0)")
    p.add_argument("--top-n", type=positive_int, default=5, help="candidate tokens kept per step (JSON output)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the result as JSON to this file")


def parse_edit(spec: str):
    """``"12:6159:add:-20:unit@generated"`` -> FeatureEdit."""
    from qwen_scope.steering import FeatureEdit, PRESETS

    body, _, positions = spec.partition("@")
    parts = body.split(":")
    if len(parts) < 3:
        raise SystemExit(f"bad --edit {spec!r}: expected LAYER:FEATURE:MODE[:VALUE[:SCALE]][@POSITIONS]")
    try:
        layer, feature, mode = int(parts[0]), int(parts[1]), parts[2]
        value = 0.0 if len(parts) < 4 else PRESETS.get(parts[3], None) or float(parts[3])
        return FeatureEdit(layer, feature, mode, value, parts[4] if len(parts) > 4 else "raw", positions or "all")
    except ValueError as e:
        raise SystemExit(f"bad --edit {spec!r}: {e}") from None


def _number(text: str, option: str) -> float:
    from qwen_scope.steering import PRESETS

    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"bad {option} {text!r}: expected a number (or for --strength one of "
                         f"{sorted(PRESETS)})") from None


def _edits(args) -> list:
    from qwen_scope.steering import FeatureEdit, PRESETS

    edits = [parse_edit(s) for s in args.edit]
    if args.feature:
        if args.layer is None:
            raise SystemExit("--feature needs --layer")
        value = 0.0 if args.mode == "ablate" else PRESETS.get(args.strength) or _number(args.strength, "--strength")
        edits += [FeatureEdit(args.layer, f, args.mode, value, args.scale, args.positions) for f in args.feature]
    if not edits and not args.sweep:
        raise SystemExit("nothing to steer: pass --layer/--feature or --edit")
    return edits


def _generation_json(g) -> dict:
    return {"text": g.text, "tokens": g.tokens, "probs": g.probs.tolist(),
            "top": [list(zip(toks, ps)) for toks, ps in zip(g.top_tokens, g.top_probs.tolist())]}


def run(args: argparse.Namespace) -> int:
    from qwen_scope.steering import FeatureEdit, steer, sweep

    edits = [] if args.sweep else _edits(args)
    layers = sorted({e.layer for e in edits} | ({args.layer} if args.sweep else set()))
    if args.sweep and (args.layer is None or len(args.feature) != 1):
        raise SystemExit("--sweep needs --layer and exactly one --feature")
    if args.sweep and args.mode == "ablate":
        raise SystemExit("--sweep varies an add strength or a clamp value; use --mode add or --mode clamp")
    strengths = [_number(s, "--sweep value") for s in args.sweep.split(",") if s.strip()] if args.sweep else []
    for s in strengths:
        # The same checks sweep() makes, before the model loads.
        FeatureEdit(args.layer, args.feature[0], "clamp" if args.mode == "clamp" else "add", s, args.scale,
                    args.positions)
    scope = build_scope(args, layers)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, seed=args.seed, template=args.template,
               top_n=args.top_n)
    if args.sweep:
        result = sweep(scope, args.prompt, args.layer, args.feature[0], strengths,
                       mode="clamp" if args.mode == "clamp" else "add", scale=args.scale, positions=args.positions,
                       **gen)
        print(result.table())
        payload = {"baseline": _generation_json(result.baseline),
                   "runs": [{"strength": s, **_generation_json(g)} for s, g in zip(result.strengths, result.runs)]}
    else:
        result = steer(scope, args.prompt, edits, **gen)
        print(result.side_by_side())
        payload = {"edits": [e.__dict__ for e in edits], "fired": result.fired,
                   "baseline": _generation_json(result.baseline), "steered": _generation_json(result.steered)}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"prompt": args.prompt, **payload}, f, indent=1, default=str)
    return 0
