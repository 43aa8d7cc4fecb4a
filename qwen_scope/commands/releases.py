"""``qwen-scope releases``: the 14 Qwen-Scope SAE sets, their sizes, and how many layers are already cached.

Examples::

    qwen-scope releases
    qwen-scope releases --model qwen3.5-2b --json
"""
from __future__ import annotations

import argparse
import json
import os

NAME = "releases"
HELP = "list the Qwen-Scope SAE releases (sae-lens ids, repos, sizes, cached layers)"

_COLUMNS = ("id", "trained_on", "layers", "d_model", "d_sae", "k", "file", "total", "cached")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # dest model_filter: a filter, not a model to load (the CLI checks an args.model can be loaded).
    parser.add_argument("--model", dest="model_filter", default=None,
                        help="only sets whose base model id contains this (e.g. qwen3.5-2b)")
    parser.add_argument("--trained-on", choices=("base", "instruct"), default=None, help="only base / instruct sets")
    parser.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    parser.add_argument("--cache-dir", default=None, help="hub cache to look in (default: HF_HUB_CACHE)")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.1f} GB"


def _cached_layers(release, cache_dir) -> int:
    from huggingface_hub import try_to_load_from_cache

    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    return sum(isinstance(try_to_load_from_cache(release.repo_id, release.filename(n), cache_dir=cache_dir), str)
               for n in release.layers)


def records(model: str | None = None, trained_on: str | None = None, cache_dir: str | None = None) -> list[dict]:
    """One dict per release: registry fields plus ``file_bytes``, ``total_bytes`` and ``cached_layers``."""
    from saes import list_releases

    out = []
    for r in list_releases(model=model, trained_on=trained_on):
        out.append(dict(id=r.id, repo_id=r.repo_id, model_id=r.model_id, trained_on=r.trained_on,
                        n_layers=r.n_layers, d_model=r.d_model, d_sae=r.d_sae, k=r.k, file_bytes=r.file_bytes,
                        total_bytes=r.total_bytes, cached_layers=_cached_layers(r, cache_dir)))
    return out


def format_table(rows: list[dict]) -> str:
    """The aligned text table ``qwen-scope releases`` prints."""
    cells = [_COLUMNS] + [(r["id"], r["trained_on"], str(r["n_layers"]), str(r["d_model"]), str(r["d_sae"]),
                           str(r["k"]), _gb(r["file_bytes"]), _gb(r["total_bytes"]),
                           f"{r['cached_layers']}/{r['n_layers']}") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = records(args.model_filter, args.trained_on, args.cache_dir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no release matches; run `qwen-scope releases` for all 14")
        return 1
    print(format_table(rows))
    print("\nRepos are huggingface.co/<repo_id> (Qwen/SAE-Res-...), files layer{n}.sae.pt in fp32. All sets are trained "
          "on -Base models except qwen-scope-3.5-27b-* (instruct).\nLicense: see each repo's LICENSE; the model cards "
          "forbid non-scientific use that interferes with model capabilities or produces harmful content.")
    return 0
