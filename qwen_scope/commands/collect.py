"""``qwen-scope collect``: activations / SAE codes of a corpus into a sharded, resumable store.

Examples::

    qwen-scope collect Qwen/Qwen3.5-2B-Base data/*.jsonl --out acts/ --tokens 10M --context-len 1024 \\
        --sae-layers 6,12,18 --release qwen-scope-3.5-2b-base-w32k-l100
    torchrun --nproc-per-node 8 -m qwen_scope collect Qwen/Qwen3.5-2B-Base HuggingFaceFW/fineweb-edu \\
        --streaming --out acts/ --tokens 1B --points resid_post.12
"""
from __future__ import annotations

import argparse
import math
import os

NAME = "collect"
HELP = "collect activations and/or SAE codes of a corpus into a sharded, resumable store (torchrun-aware)"

_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


def _count(text: str, flag: str = "--tokens") -> int:
    """``"10M"`` -> 10_000_000; plain integers pass through. Raises ``ValueError`` for anything but a count >= 1."""
    clean = text.strip().upper().replace("_", "")
    try:
        value = float(clean[:-1]) * _SUFFIX[clean[-1]] if clean and clean[-1] in _SUFFIX else int(clean)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(f"{flag} expects a whole token count >= 1 like 1000000 or 10M, got {text!r}")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model id or local directory (its tokenizer is loaded from the same place)")
    p.add_argument("corpus", help="datasets hub id, or local json/jsonl/parquet/csv/txt file, directory or glob")
    p.add_argument("--out", required=True, help="store directory (rerun the same command to resume)")
    p.add_argument("--points", default="", help="comma-separated hook points stored dense, e.g. resid_post.12")
    p.add_argument("--sae-layers", default=None, help="comma-separated layers (or 'all') to store SAE codes at")
    p.add_argument("--release", default=None, help="SAE release id, hub repo or local release directory")
    p.add_argument("--tokens", required=True, help="token budget over all ranks (e.g. 10M)")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    p.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--store-dtype", default="bfloat16", help="on-disk dtype of dense activations and code values")
    p.add_argument("--text-column", default="text")
    p.add_argument("--split", default="train")
    p.add_argument("--name", default=None, help="hub dataset config name")
    p.add_argument("--streaming", action="store_true", help="stream the hub dataset instead of downloading it")
    p.add_argument("--packing", choices=("concat", "document"), default="concat")
    p.add_argument("--no-separator", action="store_true", help="do not append EOS after each document")
    p.add_argument("--bos-id", type=int, default=None, help="token id put at position 0 of every row")
    p.add_argument("--shard-tokens", default=None, help="tokens per shard (default: ~1 GiB shards)")
    p.add_argument("--device", default=None)
    p.add_argument("--overwrite", action="store_true", help="discard a store of another config in --out")
    p.add_argument("--repair", action="store_true",
                   help="recompute the shards of --out found missing or damaged (without it such a store is an error)")
    p.add_argument("--no-progress", action="store_true")
    kernels = p.add_mutually_exclusive_group()
    kernels.add_argument("--gdn-kernels", dest="gdn_kernels", action="store_const", const=True, default=None,
                         help="run Qwen3.5 / Qwen3-Next GDN layers on the fused layer of flashqla_kernels even off "
                              "Hopper (default: on a Hopper GPU with tilelang installed)")
    kernels.add_argument("--no-gdn-kernels", dest="gdn_kernels", action="store_const", const=False,
                         help="keep the model's GDN layers as transformers runs them")


def run(args: argparse.Namespace) -> int:
    from qwen_scope.collect import _DTYPES, collect, load_corpus

    def dtype(name):
        if name is None:
            return None
        if name not in _DTYPES:
            raise SystemExit(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[name]

    sae_layers = None
    if args.sae_layers and args.sae_layers != "all":
        sae_layers = [int(n) for n in args.sae_layers.split(",") if n.strip()]
    if args.sae_layers and not args.release:
        raise SystemExit("--sae-layers needs --release (an SAE release id, hub repo or local directory)")
    if args.release and not args.sae_layers:
        raise SystemExit(f"--release {args.release} needs --sae-layers (e.g. 6,12 or all) to store SAE codes")
    tokens = _count(args.tokens)
    shard_tokens = None if args.shard_tokens is None else _count(args.shard_tokens, "--shard-tokens")
    corpus = load_corpus(args.corpus, split=args.split, name=args.name, streaming=args.streaming)
    summary = collect(
        args.model, corpus, points=[p.strip() for p in args.points.split(",") if p.strip()] or None,
        sae_layers=sae_layers, release=args.release if args.sae_layers else None, token_budget=tokens,
        context_len=args.context_len, out_dir=args.out, batch_size=args.batch_size, dtype=dtype(args.dtype),
        store_dtype=dtype(args.store_dtype), text_column=args.text_column, packing=args.packing,
        separator_id=None if args.no_separator else "eos", prepend_bos_id=args.bos_id,
        shard_tokens=shard_tokens, device=args.device, overwrite=args.overwrite, repair=args.repair,
        progress=not args.no_progress, corpus_id=f"{args.corpus}:{args.name}:{args.split}" if args.streaming else None,
        gdn_kernels=args.gdn_kernels)
    # With a progress bar, collect() already printed the summary (rank 0).
    if args.no_progress and int(os.environ.get("RANK", "0")) == 0:
        print(summary)
    return 0
