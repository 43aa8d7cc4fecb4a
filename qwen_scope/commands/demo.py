"""``qwen-scope demo``: the offline tour on the bundled nano model (or any model + Qwen-Scope release).

Examples::

    qwen-scope demo                                   # nano model + its SAE set, offline, ~15 s on 2 CPU cores
    qwen-scope demo --out /tmp/tour --layer 4 --text "import os"
    qwen-scope demo --model Qwen/Qwen3.5-2B-Base --release qwen-scope-3.5-2b-base-w32k-l50 --layer 12 --device cuda \\
        --corpus my_texts.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwen_scope.commands._scope_args import positive_int

NAME = "demo"
HELP = "offline tour: nano model + SAE -> collect -> feature database -> HTML dashboard -> report + steering"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="qwen-scope-demo", help="output directory (default ./qwen-scope-demo)")
    p.add_argument("--model", default=None, help="model hub id or directory (default: the bundled nano model)")
    p.add_argument("--release", default=None, help="SAE release id / repo / directory (needed with --model)")
    p.add_argument("--layer", type=int, default=None, help="SAE layer to explore (default: the middle layer)")
    p.add_argument("--corpus", default=None,
                   help="a .txt (one document per blank-line-separated block) or .jsonl with a 'text' field "
                        "(default: the bundled stdlib corpus slice)")
    p.add_argument("--tokens", type=positive_int, default=24_000, help="tokens to collect (default 24000)")
    p.add_argument("--text", default=None, help="sample text whose top features are reported")
    p.add_argument("--prompt", default=None, help="prompt of the steering comparison")
    p.add_argument("--strength", type=float, default=1.0,
                   help="steering strength in units of the feature's largest corpus activation (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def read_corpus(path: str) -> tuple[str, ...]:
    """Texts from a .jsonl (``text`` field) or a plain-text file (blank-line-separated documents)."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--corpus {path}: no such file; pass a .txt or .jsonl file")
    raw = file.read_text(encoding="utf-8")
    if file.suffix == ".jsonl":
        try:
            docs = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"--corpus {path}: every line must be a JSON object with a 'text' field ({e})") from None
    else:
        docs = [d for d in raw.split("\n\n") if d.strip()]
    if not docs:
        raise SystemExit(f"--corpus {path}: no documents found")
    return tuple(docs)


def run(args: argparse.Namespace) -> int:
    from qwen_scope.demo import DemoConfig, run_demo

    kwargs = {}
    if args.text is not None:
        kwargs["text"] = args.text
    if args.prompt is not None:
        kwargs["steer_prompt"] = args.prompt
    config = DemoConfig(out_dir=args.out, model=args.model, release=args.release, layer=args.layer,
                        corpus=read_corpus(args.corpus) if args.corpus else None, tokens=args.tokens,
                        strength=args.strength, device=args.device, **kwargs)
    result = run_demo(config)
    total = sum(result.seconds.values())
    print(f"\ndone in {total:.0f} s: report {result.out_dir / 'report.txt'}"
          + (f", dashboard {result.dashboard}" if result.dashboard else ""))
    return 0
