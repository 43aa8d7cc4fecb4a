"""``qwen-scope eval``: evaluate SAEs spliced into the model, a steering edit against controls, or explain features.

Examples::

    qwen-scope eval sae                                   # the nano model's six SAEs on its corpus sample
    qwen-scope eval sae --model Qwen/Qwen3.5-2B-Base --release qwen-scope-3.5-2b-base-w32k-l50 --layers 6,12,18 \\
        --corpus HuggingFaceFW/fineweb-edu --max-tokens 1000000 --context-len 1024 --out runs/eval   # resumable
    qwen-scope eval steer --layer 5 --feature 992 --strength 4 --prompt "Example:\\n\\n" --sweep 0,2,4,8,16
    qwen-scope eval explain --db runs/db --explainer Qwen/Qwen3-0.6B --features 348,949
    qwen-scope eval explain --db runs/db --endpoint http://localhost:8000/v1 --explainer Qwen/Qwen3-8B
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwen_scope.commands._scope_args import add_scope_arguments, build_scope, model_layers, parse_layers

NAME = "eval"
HELP = "evaluate SAEs spliced into the model (FVE, L0, CE recovered, KL), steering against controls, explanations"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    sae = sub.add_parser("sae", help="SAE reconstruction and spliced next-token loss per layer")
    add_scope_arguments(sae)
    sae.add_argument("--layers", default=None, help="e.g. 12, 10,12 or 0-5 (default: all six nano layers)")
    sae.add_argument("--corpus", default="nano", help="'nano' (the bundled sample), a store directory, local "
                                                       "json/jsonl/parquet/text files or a hub dataset id")
    sae.add_argument("--split", default="train")
    sae.add_argument("--text-column", default="text")
    sae.add_argument("--max-tokens", type=int, default=65536)
    sae.add_argument("--context-len", type=int, default=256)
    sae.add_argument("--batch-size", type=int, default=8)
    sae.add_argument("--out", default=None, help="directory for sae_eval.json / .html and the resume state")
    sae.add_argument("--overwrite", action="store_true", help="start over instead of resuming --out")
    steer = sub.add_parser("steer", help="KL, feature activation, perplexity of a steering edit vs controls")
    add_scope_arguments(steer)
    steer.add_argument("--layer", type=int, required=True)
    steer.add_argument("--feature", type=int, required=True)
    steer.add_argument("--strength", type=float, default=4.0, help="add strength (or clamp value with --mode clamp)")
    steer.add_argument("--mode", default="add", choices=("add", "clamp", "ablate"))
    steer.add_argument("--scale", default="raw", choices=("raw", "unit", "norm"))
    steer.add_argument("--positions", default="all")
    steer.add_argument("--prompt", action="append", required=True, help="repeatable; \\n is a line break")
    steer.add_argument("--max-new-tokens", type=int, default=24)
    steer.add_argument("--controls", type=int, default=2, help="random directions and random features, each")
    steer.add_argument("--sweep", default=None, help="comma-separated strengths: the effect curve and a suggestion")
    steer.add_argument("--json", dest="json_out", default=None, help="also write the result as JSON here")
    ex = sub.add_parser("explain", help="explain features of a feature database and score them by detection")
    ex.add_argument("--db", required=True, help="a feature database directory (`qwen-scope explore` writes one)")
    ex.add_argument("--explainer", required=True, help="a local chat model (path or hub id), or with --endpoint "
                                                       "the served model's name")
    ex.add_argument("--endpoint", default=None, help="an OpenAI-compatible base URL, e.g. http://localhost:8000/v1")
    ex.add_argument("--tokenizer", default=None, help="the studied model's tokenizer (default: the database's "
                                                      "model, else the nano one)")
    ex.add_argument("--features", default=None, help="comma-separated ids (default: the 20 strongest)")
    ex.add_argument("--n-explain", type=int, default=10)
    ex.add_argument("--n-holdout", type=int, default=6)
    ex.add_argument("--batch-size", type=int, default=8)
    ex.add_argument("--device", default=None)
    ex.add_argument("--overwrite", action="store_true", help="explain again features this explainer explained")


def _corpus(args):
    from qwen_scope.collect import load_corpus
    from qwen_scope.nano import nano_corpus

    if args.corpus == "nano":
        return nano_corpus()
    path = Path(args.corpus)
    if path.is_file() and path.stat().st_size == 0:
        raise SystemExit(f"--corpus {path} is an empty file: there is nothing to evaluate on; pass a file with "
                         f"documents, a store directory, a hub dataset id or 'nano'")
    if path.is_dir() and ((path / "manifest.json").exists() or (path / "rank000").is_dir()):
        return path
    return load_corpus(args.corpus, split=args.split, streaming=not path.exists())


def _run_sae(args) -> int:
    from qwen_scope.evals import EvalConfig, evaluate_saes

    if args.model is not None and args.layers is None:
        raise SystemExit("--model needs --layers (the SAE layers to evaluate, e.g. --layers 6,12,18)")
    layers = model_layers(args, parse_layers(args.layers)) if args.layers else list(range(6))
    config = EvalConfig(context_len=args.context_len, batch_size=args.batch_size, max_tokens=args.max_tokens,
                        text_column=args.text_column)
    scope = build_scope(args, layers)
    result = evaluate_saes(scope, _corpus(args), layers, config=config, out=args.out, overwrite=args.overwrite)
    if result.meta.get("release_mismatch"):
        print(f"note: {result.meta['release_mismatch']}")
    print(result.table())
    if args.out:
        print(f"-> {Path(args.out) / 'sae_eval.json'}, {Path(args.out) / 'sae_eval.html'}")
    return 0


def _strengths(args) -> list[float]:
    if not args.sweep:
        return []
    if args.mode == "ablate":
        raise SystemExit("--sweep varies an add strength or a clamp value; use --mode add or --mode clamp")
    try:
        return [float(s) for s in args.sweep.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"bad --sweep {args.sweep!r}: expected comma-separated numbers like 0,2,4,8") from None


def _run_steer(args) -> int:
    from qwen_scope.evals import evaluate_steering, sweep_strength
    from qwen_scope.steering import FeatureEdit

    prompts = [p.replace("\\n", "\n") for p in args.prompt]
    strengths = _strengths(args)
    value = 0.0 if args.mode == "ablate" else args.strength
    edit = FeatureEdit(args.layer, args.feature, args.mode, value, args.scale, args.positions)
    scope = build_scope(args, [args.layer])
    ev = evaluate_steering(scope, prompts, edit, max_new_tokens=args.max_new_tokens, n_controls=args.controls,
                           template=args.template)
    print(ev.summary())
    payload = {"edit": edit.__dict__, "base_perplexity": ev.base_perplexity, "arms": [a.__dict__ for a in ev.arms]}
    if strengths:
        sw = sweep_strength(scope, prompts, args.layer, args.feature, strengths, mode=args.mode, scale=args.scale,
                            positions=args.positions, max_new_tokens=args.max_new_tokens, template=args.template)
        print(sw.table())
        payload["sweep"] = {k: v for k, v in sw.__dict__.items() if k != "arms"}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(payload, indent=1, default=str))
    return 0


def _run_explain(args) -> int:
    from transformers import AutoTokenizer

    from qwen_scope.evals import OpenAIChat, TransformersChat, explain_features
    from qwen_scope.explore import FeatureDatabase
    from qwen_scope.nano import NANO_DIR

    features = None
    if args.features:
        try:
            features = [int(f) for f in args.features.split(",") if f.strip()]
        except ValueError:
            raise SystemExit(f"--features expects comma-separated ids like 1,5,9; got {args.features!r}") from None
    db = FeatureDatabase.load(args.db)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or db.meta.get("model") or NANO_DIR))
    chat = (OpenAIChat(args.endpoint, args.explainer) if args.endpoint
            else TransformersChat(args.explainer, device=args.device))
    out = explain_features(db, features, chat, decode=tokenizer, n_explain=args.n_explain, n_holdout=args.n_holdout,
                           batch_size=args.batch_size, overwrite=args.overwrite)
    for f, e in out.items():
        score = "-" if e.detection_auroc is None else f"{e.detection_auroc:.2f}"
        print(f"#{f}\tAUROC {score}\t{e.text}")
    print(f"{len(out)} explanation(s) stored in {db.path / 'labels.json'}")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"sae": _run_sae, "steer": _run_steer, "explain": _run_explain}[args.what](args)
