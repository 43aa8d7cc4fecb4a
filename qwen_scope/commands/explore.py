"""``qwen-scope explore``: the HTML feature dashboard of a collection store + SAE release.

Mines the feature database from the store's SAE codes (one streaming pass; saved under ``OUT/database`` and reused
on the next run unless ``--rebuild``), loads the model and SAE for the logit lens and nearest features, and writes
``OUT/index.html`` with one page per feature. Open it from disk.

Examples::

    qwen-scope collect ... --out runs/store                  # SAE codes at layer 12
    qwen-scope explore --store runs/store --release qwen-scope-3.5-2b-base-w32k-l50 --out runs/dashboard
    qwen-scope explore --store runs/store --release DIR --layer 3 --features 1,5,9 --out runs/d3 --no-model
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hooks import resid_post

NAME = "explore"
HELP = "mine a feature database from a collection store and write the HTML dashboard"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="activation store directory (from `qwen-scope collect`)")
    p.add_argument("--release", default=None,
                   help="SAE release id, hub repo or local directory (default: the one recorded in the store)")
    p.add_argument("--out", required=True, help="dashboard directory (index.html, features/, json/, database/)")
    p.add_argument("--layer", type=int, default=None, help="SAE layer (default: the store's only SAE layer)")
    p.add_argument("--model", default=None, help="model id or directory (default: the one recorded in the store)")
    p.add_argument("--no-model", action="store_true", help="skip loading the model (no logit lens, ids as tokens)")
    p.add_argument("--features", default=None, help="feature ids to page, e.g. 1,5,9 (default: top by max)")
    p.add_argument("--max-features", type=int, default=1000, help="pages when --features is not given")
    p.add_argument("--n-top", type=int, default=20, help="top-activating examples per feature")
    p.add_argument("--context", default="5,5", help="context tokens LEFT,RIGHT around the activating token")
    p.add_argument("--include-first", action="store_true", help="count position 0 (excluded by default)")
    p.add_argument("--chunk-tokens", type=int, default=16384, help="tokens read from the store per step")
    p.add_argument("--device", default=None, help="where the database is mined and the model runs (cpu/cuda)")
    p.add_argument("--rebuild", action="store_true", help="mine the database again even if OUT/database exists")


def _sae_point(store, layer: int | None) -> tuple[str, dict]:
    sae_points = {p: info["sae"] for p, info in store.manifest["points"].items() if info.get("sae")}
    if not sae_points:
        raise SystemExit(f"the store at {store.root} holds no SAE codes (points {store.points}); collect with "
                         f"--sae-layers and --release to explore features")
    if layer is None:
        if len(sae_points) > 1:
            raise SystemExit(f"the store has SAE codes at {sorted(sae_points)}; choose one with --layer")
        point = next(iter(sae_points))
    else:
        point = resid_post(layer)
        if point not in sae_points:
            raise SystemExit(f"the store has no SAE codes at {point}; it has {sorted(sae_points)}")
    return point, sae_points[point]


def _parse_pair(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--context expects LEFT,RIGHT token counts like 5,5; got {text!r}") from None
    return left, right


def _parse_features(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        ids = [int(f) for f in text.split(",") if f.strip()]
    except ValueError:
        raise SystemExit(f"--features expects comma-separated feature ids like 1,5,9; got {text!r}") from None
    if not ids or min(ids) < 0:
        raise SystemExit(f"--features expects non-negative feature ids like 1,5,9; got {text!r}")
    return ids


def _weights(args, model_id: str | None, release: str | None, layer: int):
    """(scope or None, sae or None) for the dashboard."""
    if release is None:
        print("no SAE release given or recorded: pages without logit lens / nearest features", file=sys.stderr)
        return None, None
    if args.no_model or model_id is None:
        from saes import load

        return None, load(release, layer, device=args.device)
    from qwen_scope.scope import Scope

    try:
        return Scope.from_pretrained(model_id, release, [layer], device=args.device), None
    except (OSError, ValueError) as err:
        raise SystemExit(f"could not load the model {model_id!r} (recorded in the store or given by --model) with "
                         f"release {release!r}: {err}\nPass --model ID_OR_DIR, or --no-model for pages without the "
                         f"logit lens") from err


def _check_reusable(db, source: dict, db_dir: Path) -> None:
    """Refuse a database mined at another point or from another store (its pages would show other features)."""
    for key, want in source.items():
        have = db.meta.get(key)
        if have is not None and want is not None and have != want:
            raise SystemExit(f"{db_dir} was mined with {key}={have!r}, this run asks for {key}={want!r} "
                             f"(store {db.meta.get('store')!r} then); use another --out, or --rebuild to mine it "
                             f"again (labels are kept for the same point and release)")


def run(args: argparse.Namespace) -> int:
    from qwen_scope.explore import FeatureDatabase, build_feature_database, store_chunks, write_dashboard
    from qwen_scope.store import ActivationStore

    features = _parse_features(args.features)
    context = _parse_pair(args.context)
    store = ActivationStore(args.store)
    point, info = _sae_point(store, args.layer)
    d_sae = int(info["d_sae"])
    too_big = [f for f in features or () if f >= d_sae]
    if too_big:
        raise SystemExit(f"--features {args.features}: {too_big[:5]} out of range for the SAE at {point} "
                         f"(d_sae {d_sae}: ids 0..{d_sae - 1})")
    layer = int(point.split(".")[1])
    release = args.release or info.get("release")
    model_id = args.model or store.manifest.get("model")
    out = Path(args.out)
    db_dir = out / "database"
    t = time.time()
    old = None
    if (db_dir / "database.json").exists():
        try:
            old = FeatureDatabase.load(db_dir)
        except (OSError, ValueError):
            if not args.rebuild:
                raise
    source = {"point": point, "store_config_hash": store.manifest.get("config_hash")}
    if old is not None and not args.rebuild:
        _check_reusable(old, source, db_dir)
        db = old
        print(f"reusing the feature database at {db_dir} (--rebuild to mine it again)")
    else:
        meta = {"model": model_id, "point": point, "layer": layer, "release": release, "store": str(args.store),
                **source}
        db = build_feature_database(store_chunks(store, point, chunk_tokens=args.chunk_tokens), int(info["d_sae"]),
                                    meta=meta, device=args.device, n_top=args.n_top,
                                    context=context, exclude_position_0=not args.include_first)
        if old is not None and old.meta.get("point") == point and old.meta.get("release") == release:
            db.labels = old.labels  # --rebuild re-mines the statistics; the user's labels of these features stay
        db.save(db_dir)
        print(f"mined {db.n_tokens} tokens at {point} in {time.time() - t:.1f}s -> {db_dir}")
    scope, sae = _weights(args, model_id, release, layer)
    t = time.time()
    index = write_dashboard(db, out, scope=scope, sae=sae, layer=layer, features=features,
                            max_features=args.max_features)
    # Counted from the selection: features/ may still hold pages of an earlier run into the same OUT.
    n_pages = len(features) if features is not None else len(db.top_features(args.max_features))
    print(f"dashboard with {n_pages} feature pages in {time.time() - t:.1f}s: {index}")
    return 0
