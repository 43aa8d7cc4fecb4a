"""``qwen-scope classify``: filter a corpus with a few-seed SAE-feature rule into kept / rejected JSONL.

The rule is a ``FeatureClassifier`` saved with ``to_json()`` (``--rule``), or is fitted here from two seed files
(``--positives`` / ``--negatives``: jsonl rows or one text per line of a .txt) and saved beside the output. The corpus
(a datasets hub id or local files, streamed) is scored a batch at a time; each row goes to ``kept.jsonl`` (the rule
fires) or ``rejected.jsonl`` with its rule scores added under ``_scores``.

Examples::

    qwen-scope classify data/*.jsonl --rule toxic.rule.json --out filtered/ \\
        --model Qwen/Qwen3.5-2B-Base --release qwen-scope-3.5-2b-base-w32k-l50
    qwen-scope classify corpus.jsonl --positives code_seeds.txt --negatives prose_seeds.txt --layers 3,4 --out out/
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qwen_scope.commands._scope_args import add_scope_arguments, build_scope, model_layers, parse_layers

NAME = "classify"
HELP = "filter a corpus into kept / rejected JSONL with a few-seed SAE-feature rule (fit from seeds or loaded)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("corpus", help="datasets hub id, or local json/jsonl/parquet/csv/txt file, directory or glob")
    p.add_argument("--out", required=True, help="output directory: kept.jsonl, rejected.jsonl (and rule.json)")
    p.add_argument("--rule", default=None, help="a rule saved with FeatureClassifier.to_json()")
    p.add_argument("--positives", default=None, help="seed texts of the class to keep (.jsonl rows or .txt lines)")
    p.add_argument("--negatives", default=None, help="seed texts of the rest (.jsonl rows or .txt lines)")
    p.add_argument("--layers", default=None, help="SAE layers to search when fitting, e.g. 3,4 or 2-5")
    p.add_argument("--n-features", type=int, default=4, help="rule size when fitting (default 4)")
    p.add_argument("--text-column", default="text", help="the corpus's (and seed jsonl's) text field")
    p.add_argument("--split", default="train", help="corpus split (default train)")
    p.add_argument("--batch-size", type=int, default=32, help="rows scored per forward (default 32)")
    p.add_argument("--limit", type=int, default=None, help="stop after this many rows")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_scope_arguments(p)


def _seeds(path: str, text_column: str) -> list[str]:
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"seed file {path} does not exist")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if file.suffix == ".jsonl":
        return [str(json.loads(line)[text_column]) for line in lines]
    return lines


def _classifier(args):
    from qwen_scope.applications import FeatureClassifier

    if args.rule is not None:
        if args.positives or args.negatives:
            raise ValueError("pass either --rule or --positives/--negatives, not both")
        data = json.loads(Path(args.rule).read_text())
        layers = sorted({int(r["layer"]) for r in data.get("rules", [])})
        if not layers:
            raise ValueError(f"{args.rule} holds no rules; save one with FeatureClassifier.to_json()")
        return FeatureClassifier.from_json(Path(args.rule).read_text(), build_scope(args, layers))
    if not (args.positives and args.negatives):
        raise ValueError("no rule: pass --rule rule.json, or both --positives and --negatives seed files to fit one")
    if not args.layers:
        raise ValueError("fitting a rule needs --layers (the SAE layers to search), e.g. --layers 3,4")
    layers = model_layers(args, parse_layers(args.layers))
    scope = build_scope(args, layers)
    clf = FeatureClassifier.fit(scope, _seeds(args.positives, args.text_column),
                                _seeds(args.negatives, args.text_column), layers=layers, n_features=args.n_features,
                                template=args.template)
    return clf


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from qwen_scope.applications.scoring import iter_document_scores
    from qwen_scope.collect import load_corpus

    clf = _classifier(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rule.json").write_text(clf.to_json())
    print(clf.explain(), file=sys.stderr)
    corpus = load_corpus(args.corpus, split=args.split, streaming=True)
    rows = (r for i, r in enumerate(corpus) if args.limit is None or i < args.limit)
    kept = rejected = 0
    bar = tqdm(total=args.limit, unit="doc", disable=args.no_progress, file=sys.stderr)
    with open(out / "kept.jsonl", "w") as fk, open(out / "rejected.jsonl", "w") as fr:
        for batch, scores in iter_document_scores(clf.scope, rows, clf.layers, text_column=args.text_column,
                                                  batch_size=args.batch_size, template=clf.template):
            cols = clf.rule_scores(scores)
            fired = (cols > clf.thresholds).any(1)
            for row, s, f in zip(batch, cols.tolist(), fired.tolist()):
                record = dict(row) if isinstance(row, dict) else {args.text_column: row}
                record["_scores"] = [round(v, 4) for v in s]
                (fk if f else fr).write(json.dumps(record) + "\n")
            kept += int(fired.sum())
            rejected += int((~fired).sum())
            bar.update(len(batch))
            bar.set_postfix(kept=kept, rejected=rejected)
    bar.close()
    print(f"kept {kept}, rejected {rejected} of {kept + rejected} rows -> {out}/kept.jsonl, {out}/rejected.jsonl")
    return 0
