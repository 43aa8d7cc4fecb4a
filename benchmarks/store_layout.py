"""Activation-store layout on CPU: bytes a code and read speed of format version 2 (bf16 values + uint16 indices)
against version 1 (int32 indices), on the bundled nano model.

One real store: ``qwen_scope.collect`` of the nano model with its SAE at every layer (6 points, d_sae 1024, k 16) over
the shipped corpus slice (``nano_corpus()``, deterministic), in several shards. Then a version-1 copy of the same
store: every shard's tensors with the indices widened to int32, written by the store's own ``ShardWriter`` under the
config a version-1 writer recorded (no ``index_layout``), its progress file marked version 1 and the manifest merged
again, so ``ActivationStore(..., verify=True)`` opens it as it opens a store that old writer left.

Checked first: both layouts give the same codes at every point, the same feature index and the same shuffled batches.
Then, per layout, the two layouts taking turns run by run:
  - bytes: shard bytes / codes and / tokens, split exactly into code tensors (values + indices), the per-token
    tensors (token_ids int32, doc_index int64, positions int32: 16 bytes a token) and the safetensors headers;
  - full read: ``store.sae_codes(point)`` over every point, codes/s. Cold: a new ``ActivationStore`` each run with the
    shard files dropped from the page cache (``posix_fadvise(DONTNEED)``, best effort); warm: one store object, read
    again. Median of ``--runs``;
  - feature index: ``store.feature_index(point, cache=False)`` over every point (the one pass that mines every
    feature's top activations), codes/s;
  - random feature lookup: ``store.feature_index(point).top(f, 10)`` for ``--lookups`` random live (point, feature)
    pairs, then the codes of those 10 tokens read back from the store (``sae_codes(point, o, o + 1)``), lookups/s;
  - ``store.iter_shuffled(point, kind="sae")`` over every point, codes/s.

Usage: ``python benchmarks/store_layout.py --out benchmarks/results`` (~20 s on 2 cores) writes ``store_layout.json``
and ``store_layout.md``; ``--smoke`` is a few-second run of every path on a small store.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_scope.collect import collect  # noqa: E402
from qwen_scope.nano import NANO_DIR, NANO_RELEASE_DIR, nano_corpus  # noqa: E402
from qwen_scope.store import ActivationStore  # noqa: E402
from qwen_scope.store_files import atomic_write_json  # noqa: E402
from qwen_scope.store_writer import ShardWriter, merge_manifest, pack_indices, unpack_indices  # noqa: E402

# 64K tokens: at 16K a warm read of every point takes about a millisecond and the run-to-run spread (~6%) hid the
# layouts' difference
FULL = {"tokens": 65536, "context_len": 256, "batch_size": 8, "shard_tokens": 16384, "runs": 15, "lookups": 200}
SMOKE = {"tokens": 1024, "context_len": 128, "batch_size": 4, "shard_tokens": 512, "runs": 2, "lookups": 8}
LOOKUP_TOP = 10
META_KEYS = ("token_ids", "doc_index", "positions")


# ---------------------------------------------------------------------------------------------- the two stores
def collect_store(root: Path, settings: dict) -> Path:
    """The version-2 store ``collect`` writes: SAE codes of the nano model at every layer."""
    collect(str(NANO_DIR), nano_corpus(), release=str(NANO_RELEASE_DIR), token_budget=settings["tokens"],
            context_len=settings["context_len"], batch_size=settings["batch_size"],
            shard_tokens=settings["shard_tokens"], out_dir=root, device="cpu", progress=False, overwrite=True)
    return root


def write_version_1(src: Path, dst: Path) -> Path:
    """A copy of the store at ``src`` as format version 1 wrote it: int32 indices, no ``index_layout``."""
    from safetensors import safe_open

    store = ActivationStore(src)
    config = json.loads(json.dumps(store.manifest["config"]))
    layouts = {}
    for point, info in config["points"].items():
        if info["sae"]:
            layouts[point] = info["sae"].pop("index_layout")
    assert {s["rank"] for s in store.shards} == {0}, "collect ran on one rank"
    writer = ShardWriter(dst, config, overwrite=True)
    for record in store.shards:
        with safe_open(str(src / record["file"]), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for point, layout in layouts.items():
            indices = unpack_indices(tensors.pop(f"sae.{point}.indices"),
                                     tensors.pop(f"sae.{point}.indices_high", None), layout)
            tensors.update({f"sae.{point}.{k}": v for k, v in pack_indices(indices, "int32").items()})
        writer.write(tensors, n_rows=record["n_rows"], n_pad=record["n_pad"], cursor=record["cursor"])
    writer.finish(store.manifest["rank_stats"][0])
    progress = writer.progress_path
    state = json.loads(progress.read_text())
    atomic_write_json(progress, {**state, "version": 1}, root=dst, owner=progress.parent.name)
    merge_manifest(dst)
    return dst


# ---------------------------------------------------------------------------------------------- what is measured
def sae_points(store: ActivationStore) -> list[str]:
    return [p for p in store.points if store.point_info(p)["sae"]]


def layout_bytes(store: ActivationStore) -> dict:
    """Shard bytes split exactly into code tensors, per-token tensors and headers, per code and per token."""
    parts = {"shard_bytes": 0, "code_tensor_bytes": 0, "meta_tensor_bytes": 0, "header_bytes": 0}
    for record in store.shards:
        path = store.root / record["file"]
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
        parts["shard_bytes"] += path.stat().st_size
        parts["code_tensor_bytes"] += sum(v for k, v in sizes.items() if k.startswith("sae."))
        parts["meta_tensor_bytes"] += sum(sizes[k] for k in META_KEYS)
        parts["header_bytes"] += 8 + n
    n_tokens = store.n_tokens
    n_codes = n_tokens * sum(store.point_info(p)["sae"]["k"] for p in sae_points(store))
    return {**parts, "n_tokens": n_tokens, "n_codes": n_codes, "codes_per_token": n_codes // n_tokens,
            "bytes_per_code": parts["shard_bytes"] / n_codes, "bytes_per_token": parts["shard_bytes"] / n_tokens,
            "code_bytes_per_code": parts["code_tensor_bytes"] / n_codes,
            "meta_bytes_per_token": parts["meta_tensor_bytes"] / n_tokens,
            "header_bytes_per_token": parts["header_bytes"] / n_tokens}


def drop_page_cache(store: ActivationStore) -> bool:
    """Ask the kernel to drop the shard files' cached pages (no root needed); False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for record in store.shards:
        fd = os.open(store.root / record["file"], os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_all(store: ActivationStore) -> int:
    """Codes read by ``sae_codes`` over every point."""
    return sum(store.sae_codes(p).values.numel() for p in sae_points(store))


def timed_arms(store: ActivationStore, targets: list[tuple[str, int]]) -> dict:
    """What is timed on one layout: each callable does one run and returns what it counted (codes or lookups)."""
    path, n_codes = store.root, read_all(store)
    for p in sae_points(store):
        store.feature_index(p)  # built and cached on disk once, as a user's first query does

    def cold() -> int:
        drop_page_cache(store)
        return read_all(ActivationStore(path))

    def index() -> int:
        for p in sae_points(store):
            store.feature_index(p, cache=False)
        return n_codes

    return {"read_cold_codes_per_s": cold, "read_warm_codes_per_s": lambda: read_all(store),
            "index_codes_per_s": index, "lookups_per_s": lambda: sum(1 for p, f in targets if lookup(store, p, f)),
            "iterator_codes_per_s": lambda: sum(b.values.numel() for b in shuffled(store))}


def rates(stores: dict[str, ActivationStore], targets: list[tuple[str, int]], runs: int) -> dict[str, dict]:
    """Median rate of every arm per layout, the layouts taking turns run by run (neither gets the quieter moments
    of a shared machine); the slower arms (index, lookups, iterator) run a third as often."""
    arms = {name: timed_arms(store, targets) for name, store in stores.items()}
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in stores}
    for metric in next(iter(arms.values())):
        n = runs if metric.startswith("read") else max(1, runs // 3)
        for r in range(n):
            for name in (list(stores) if r % 2 == 0 else list(stores)[::-1]):
                t = time.perf_counter()
                count = arms[name][metric]()
                samples[name].setdefault(metric, []).append(count / (time.perf_counter() - t))
    return {name: {k: statistics.median(v) for k, v in by.items()} for name, by in samples.items()}


def lookup_targets(store: ActivationStore, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` random live (point, feature) pairs, the same for both layouts (they hold the same codes)."""
    g = torch.Generator().manual_seed(seed)
    live = [(p, f) for p in sae_points(store) for f in torch.nonzero(store.feature_index(p).counts).flatten().tolist()]
    return [live[i] for i in torch.randint(len(live), (n,), generator=g).tolist()]


def lookup(store: ActivationStore, point: str, feature: int) -> list[tuple[int, float, float]]:
    """The feature's top activations from the index, each checked against the codes read back from the store:
    ``(offset, indexed value, stored value)``."""
    offsets, values = store.feature_index(point).top(feature, LOOKUP_TOP)
    out = []
    for o, v in zip(offsets.tolist(), values.tolist()):
        codes = store.sae_codes(point, o, o + 1)
        out.append((o, v, float(codes.values[codes.indices == feature].float().sum())))
    return out


def shuffled(store: ActivationStore, seed: int = 0):
    for p in sae_points(store):
        yield from store.iter_shuffled(p, batch_size=1024, buffer_tokens=1 << 14, seed=seed, kind="sae")


def check_same_codes(v2: ActivationStore, v1: ActivationStore, targets: list[tuple[str, int]]) -> dict:
    """Both layouts hold the same codes: every point, the feature index, the shuffled batches, the lookups."""
    assert sae_points(v2) == sae_points(v1) and v2.n_tokens == v1.n_tokens
    same_codes = all(torch.equal(a, b) for p in sae_points(v2)
                     for a, b in zip(v2.sae_codes(p), v1.sae_codes(p)))
    same_index = all(torch.equal(getattr(v2.feature_index(p, cache=False), k), getattr(v1.feature_index(p), k))
                     for p in sae_points(v2) for k in ("counts", "top_values", "top_offsets"))
    same_batches = all(torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)
                       for a, b in zip(shuffled(v2), shuffled(v1)))
    found = [lookup(v2, p, f) for p, f in targets]
    return {"same_codes": same_codes, "same_feature_index": same_index, "same_shuffled_batches": same_batches,
            "same_lookups": found == [lookup(v1, p, f) for p, f in targets],
            "lookups_match_stored_codes": all(v == s for hits in found for _, v, s in hits),
            "index_dtypes": {"v2": v2.sae_codes(sae_points(v2)[0], 0, 1).indices.dtype == torch.long,
                             "v1": v1.sae_codes(sae_points(v1)[0], 0, 1).indices.dtype == torch.long},
            "versions": [v2.manifest["version"], v1.manifest["version"]]}


# ---------------------------------------------------------------------------------------------- the run
def environment() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "load_average_1min": os.getloadavg()[0], "torch": torch.__version__, "python": platform.python_version(),
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def measure(work: Path, settings: dict) -> dict:
    t = time.perf_counter()
    v2_path = collect_store(work / "v2", settings)
    v1_path = write_version_1(v2_path, work / "v1")
    setup_s = time.perf_counter() - t
    v2, v1 = ActivationStore(v2_path, verify=True), ActivationStore(v1_path, verify=True)
    v1.verify()
    targets = lookup_targets(v2, settings["lookups"])
    checks = check_same_codes(v2, v1, targets)
    failed = [k for k, v in checks.items() if v is False or (isinstance(v, dict) and not all(v.values()))]
    if failed or checks["versions"] != [2, 1]:
        raise SystemExit(f"the two layouts disagree: {failed or checks['versions']}; timing them would mean nothing")
    stores = {"v2": ActivationStore(v2_path), "v1": ActivationStore(v1_path)}
    timed = rates(stores, targets, settings["runs"])
    layouts = {name: {"version": store.manifest["version"], **layout_bytes(store), **timed[name]}
               for name, store in stores.items()}
    ratio_keys = ("bytes_per_code", "bytes_per_token", "read_cold_codes_per_s", "read_warm_codes_per_s",
                  "index_codes_per_s", "lookups_per_s", "iterator_codes_per_s")
    return {"layouts": layouts, "v2_over_v1": {k: layouts["v2"][k] / layouts["v1"][k] for k in ratio_keys},
            "checks": checks, "setup_s": setup_s}


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_layout.json").write_text(json.dumps(result, indent=1))
    e, s, rows = result["env"], result["settings"], result["layouts"]
    v2 = rows["v2"]
    lines = [f"# Activation-store layout, v2 (uint16 indices) against v1 (int32) ({e['date']})", "",
             f"CPU {e['cpu']}, {e['cores']} cores ({e['torch_threads']} torch threads; load average "
             f"{e['load_average_1min']:.2f} before, {e['load_average_1min_after']:.2f} after), torch {e['torch']}, "
             f"Python {e['python']}, commit {e['commit']}. Store: `collect` of the nano model, SAE codes at "
             f"{len(result['points'])} points (k {result['k']}, d_sae {result['d_sae']}), {v2['n_tokens']:,} tokens "
             f"in {result['n_shards']} shards, {v2['n_codes']:,} codes. Median of {s['runs']} runs (index, lookups, "
             f"iterator: {max(1, s['runs'] // 3)}); {s['lookups']} random lookups of the top {LOOKUP_TOP}.", "",
             "| layout | bytes/code | bytes/token | read codes/s cold | read codes/s warm | index codes/s "
             "| lookups/s | iterator codes/s |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} (version {r['version']}) | {r['bytes_per_code']:.4f} | {r['bytes_per_token']:.1f} | "
                     f"{r['read_cold_codes_per_s']:,.0f} | {r['read_warm_codes_per_s']:,.0f} | "
                     f"{r['index_codes_per_s']:,.0f} | {r['lookups_per_s']:,.0f} | {r['iterator_codes_per_s']:,.0f} |")
    q = result["v2_over_v1"]
    lines.append(f"| v2 / v1 | {q['bytes_per_code']:.3f} | {q['bytes_per_token']:.3f} | "
                 f"{q['read_cold_codes_per_s']:.2f} | {q['read_warm_codes_per_s']:.2f} | "
                 f"{q['index_codes_per_s']:.2f} | "
                 f"{q['lookups_per_s']:.2f} | {q['iterator_codes_per_s']:.2f} |")
    lines += ["", "Bytes/code = shard bytes / codes = code tensors (v2: 2 + 2, v1: 2 + 4 bytes a code) + "
              "16 bytes a token of token_ids, doc_index and positions + the safetensors headers:", ""]
    lines += [f"- {name}: {r['code_bytes_per_code']:g} + {r['meta_bytes_per_token']:g} / {r['codes_per_token']} + "
              f"{r['header_bytes']:,} header bytes / {r['n_codes']:,} codes" for name, r in rows.items()]
    lines += ["", "Cold: a new `ActivationStore` each run (its sha256 check finds the hash remembered: a `stat`), the "
              "shard files dropped from the page cache first (`posix_fadvise(DONTNEED)`); warm: the same store object "
              "read again.", "", "Checks:", ""]
    lines += [f"- {k}: {v}" for k, v in result["checks"].items()]
    (out / "store_layout.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--smoke", action="store_true", help="a few-second run of every path on a small store")
    parser.add_argument("--tokens", type=int, help="tokens collected (shards of a quarter of them)")
    parser.add_argument("--runs", type=int, help="timed runs of each read (median)")
    parser.add_argument("--lookups", type=int, help="random feature lookups")
    parser.add_argument("--work", type=Path, help="where the two stores go (default: a temporary folder)")
    args = parser.parse_args(argv)
    settings = dict(SMOKE if args.smoke else FULL)
    settings.update({k: v for k, v in (("runs", args.runs), ("lookups", args.lookups)) if v is not None})
    if args.tokens:
        settings.update(tokens=args.tokens, shard_tokens=max(1, args.tokens // 4))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    env = environment()
    print(json.dumps(env))
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        measured = measure(Path(work), settings)
        store = ActivationStore(Path(work) / "v2")
        sae = store.point_info(sae_points(store)[0])["sae"]
        env["load_average_1min_after"] = os.getloadavg()[0]
        result = {"env": env, "settings": {**settings, "smoke": args.smoke}, "points": sae_points(store),
                  "k": sae["k"], "d_sae": sae["d_sae"], "n_shards": len(store.shards), **measured}
    write(args.out, result)
    print((args.out / "store_layout.md").read_text())
    return result


if __name__ == "__main__":
    main()
