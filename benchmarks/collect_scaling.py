"""Collection across GPUs: ``torchrun --nproc-per-node W -m``-style runs of ``qwen_scope.collect`` at several world
sizes W on one host, the same corpus and token budget each time; tokens/s per GPU, scaling efficiency against W = 1,
and every store compared with the W = 1 store as a set of token rows and codes.

Model: the Qwen3.5-2B-shaped random bf16 model of ``collect_throughput.py`` (the same seed on every rank), random
32K-wide TopK SAEs (k = 100) at one layer (``--layers 12``) or at all 24 (``--layers all``), codes only. Corpus: random
token documents of exactly ``--context-len`` tokens, one a row (``packing="document"``), so a token's row, and with it
its activations, is the same whichever rank collects it; the token budget is the whole corpus, so every store holds
every token and the stores can be compared as sets (keyed by document and position).

Timing: each world size's collect call as a user runs it, from ``torchrun`` starting the ranks to every rank returning
(the summary's tokens/s: this run's tokens over the slowest rank's seconds); one warm-up call first at each W
(kernels compiled, caches warm; not in the dry run), then the timed one into a fresh directory. Efficiency(W) =
tokens/s(W) / (W x tokens/s(1)). The bar: >= 90% at 2 GPUs and >= 85% at 8, one SAE layer.

Comparison with W = 1: the token ids of every (document, position) exactly; per point, the fraction of (token,
feature) code indices both stores hold, and the largest relative difference of their values (rows batched with
other documents may round differently on a GPU).

Usage (GPU host): ``python benchmarks/collect_scaling.py --out benchmarks/results [--world-sizes 1,2,8]
[--layers 12|all] [--tokens 4M]`` writes ``collect_scaling.json`` and ``.md``. ``--tiny`` runs world sizes 1 and 2 of
a tiny model on CPU (gloo): a dry run of every step.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _shape(tiny: bool) -> dict:
    return dict(context_len=64, batch_size=2, d_sae=256, k=8) if tiny else dict(
        context_len=4096, batch_size=8, d_sae=32768, k=100)


def _corpus(n_docs: int, length: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, vocab, (length,), generator=g).tolist()} for _ in range(n_docs)]


def _saes(layers: list[int], d_model: int, d_sae: int, k: int, device: str) -> dict:
    from saes import TopKSAE

    out = {}
    for layer in layers:
        g = torch.Generator(device=device).manual_seed(100 + layer)
        w = torch.randn(d_sae, d_model, generator=g, device=device) / d_model ** 0.5
        b = 0.01 * torch.randn(d_sae, generator=g, device=device)
        out[layer] = TopKSAE(w.bfloat16(), w.T.contiguous().bfloat16(), b.bfloat16(),
                             torch.zeros(d_model, device=device).bfloat16(), k=k,
                             compute_dtype=torch.bfloat16).requires_grad_(False)
    return out


def worker(args) -> None:
    """One rank of one world size: build the model, SAEs and corpus, collect, and (rank 0) write the summary."""
    import collect_throughput as ct

    from qwen_scope.collect import collect

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    shape = _shape(args.tiny)
    ct.DEVICE = device
    model = ct.build_model(args.tiny)
    cfg = model.config
    layers = list(range(cfg.num_hidden_layers)) if args.layers == "all" else [
        min(int(x), cfg.num_hidden_layers - 1) for x in args.layers.split(",")]
    saes = _saes(layers, cfg.hidden_size, shape["d_sae"], shape["k"], device)
    docs = _corpus(args.tokens // shape["context_len"], shape["context_len"], cfg.vocab_size)
    kw = dict(saes=saes, token_budget=len(docs) * shape["context_len"], context_len=shape["context_len"],
              batch_size=shape["batch_size"], packing="document", separator_id=None, progress=False,
              corpus_id="scaling", overwrite=True)
    summary = collect(model, docs, out_dir=args.store, **kw)
    if rank == 0:
        Path(args.summary).write_text(json.dumps({
            "world": summary.world_size, "n_tokens": summary.n_tokens, "seconds": summary.seconds,
            "tokens_per_s": summary.tokens_per_s, "complete": summary.complete, "shards": summary.n_shards,
            "layers": layers}))


def _run_world(world: int, store: Path, summary: Path, args) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--worker", "--store", str(store), "--summary", str(summary),
           "--layers", args.layers, "--tokens", str(args.tokens)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"world size {world} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(summary.read_text()), "wall_s": wall}


def _by_token(store) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's tokens ordered by (document, position): (order, token ids in that order)."""
    key = store.doc_index().long() * (int(store.positions().max()) + 1) + store.positions().long()
    order = torch.argsort(key)
    return order, store.token_ids()[order]


def compare(got_dir: Path, want_dir: Path) -> dict:
    """``got`` against ``want`` as sets of token rows and codes (module doc)."""
    from qwen_scope.store import ActivationStore

    got, want = ActivationStore(got_dir, verify=True), ActivationStore(want_dir, verify=True)
    out = {"n_tokens": got.n_tokens, "want_tokens": want.n_tokens, "complete": bool(got.manifest["complete"])}
    g_order, g_ids = _by_token(got)
    w_order, w_ids = _by_token(want)
    out["token_rows_equal"] = bool(got.n_tokens == want.n_tokens and torch.equal(g_ids, w_ids))
    points = {}
    for point in want.points:
        a, b = got.sae_codes(point), want.sae_codes(point)
        ai, av = a.indices[g_order], a.values[g_order].float()
        bi, bv = b.indices[w_order], b.values[w_order].float()
        # per token, which of want's features got also holds, and the values of those held by both
        hit = (ai[:, :, None] == bi[:, None, :]) & (bv[:, None, :] != 0)
        shared = hit.any(1)
        va = (av[:, :, None] * hit).sum(1)
        diff = (va - bv).abs()[shared]
        points[point] = {"shared_indices": float(shared.sum() / (bv != 0).sum().clamp_min(1)),
                         "max_rel_value_diff": float((diff / bv.abs()[shared].clamp_min(1e-6)).max())
                         if diff.numel() else 0.0}
    out["points"] = points
    return out


def markdown(result: dict) -> str:
    e = result["env"]
    lines = [f"# Collection across GPUs ({e['gpu']} x {result['gpus']}, {e['date']})", "",
             f"torch {e['torch']}, transformers {e['transformers']}, tilelang {e['tilelang']}, commit {e['commit']}. "
             f"{result['model']}; SAE codes at layers {result['runs'][0]['layers'] if result['runs'] else '-'}; "
             f"{result['tokens']:,} tokens, documents of exactly one row; each store compared with the "
             "world-size-1 store by (document, position).", "",
             "| world size | tokens/s | per GPU | efficiency | wall s | token rows equal | codes shared (min over "
             "points) | max rel. value diff |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        c = r.get("compare") or {}
        pts = c.get("points", {})
        shared = min((p["shared_indices"] for p in pts.values()), default=float("nan"))
        rel = max((p["max_rel_value_diff"] for p in pts.values()), default=float("nan"))
        lines.append(f"| {r['world']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / r['world']:,.0f} | "
                     f"{r['efficiency']:.1%} | {r['wall_s']:.1f} | {c.get('token_rows_equal', '-')} | "
                     f"{shared:.4f} | {rel:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--world-sizes", default=None, help="comma list (default 1,2,<GPU count>; tiny 1,2)")
    parser.add_argument("--layers", default="12", help="SAE layers: comma list or 'all'")
    parser.add_argument("--tokens", type=lambda s: int(float(s.rstrip("Mm")) * (1e6 if s[-1:] in "Mm" else 1)),
                        default=None, help="tokens collected (the whole corpus), e.g. 4M (default 4M; tiny 1024)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, world sizes 1 and 2")
    parser.add_argument("--work", type=Path, default=None, help="where the stores go (default a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--summary", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.tiny else 4_000_000)
    if args.worker:
        worker(args)
        return
    import collect_throughput as ct

    ct.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    sizes = [int(x) for x in (args.world_sizes or ("1,2" if args.tiny or gpus < 2 else f"1,2,{gpus}")).split(",")]
    sizes = sorted(dict.fromkeys(sizes))
    if sizes[0] != 1:
        raise SystemExit(f"--world-sizes must start at 1 (the reference store and the efficiency's base), got {sizes}")
    if gpus and sizes[-1] > gpus:
        raise SystemExit(f"--world-sizes asks for {sizes[-1]} ranks; this host has {gpus} GPUs")
    work = args.work or Path(tempfile.mkdtemp(prefix="collect_scaling_"))
    result = {"env": ct.versions(), "gpus": gpus, "layers": args.layers, "tokens": args.tokens,
              "model": "tiny Qwen3.5 (dry run)" if args.tiny else "Qwen3.5-2B-shaped random bf16", "runs": []}
    base = None
    for world in sizes:
        if not args.tiny:  # the dry run only walks the steps
            _run_world(world, work / f"warm{world}", work / f"summary{world}.json", args)
            shutil.rmtree(work / f"warm{world}", ignore_errors=True)
        run = _run_world(world, work / f"w{world}", work / f"summary{world}.json", args)
        base = base or run["tokens_per_s"]
        run["efficiency"] = run["tokens_per_s"] / (world * base)
        if world > 1:
            run["compare"] = compare(work / f"w{world}", work / "w1")
        result["runs"].append(run)
        print(run, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "collect_scaling.json").write_text(json.dumps(result, indent=1))
        (args.out / "collect_scaling.md").write_text(markdown(result))
    print(markdown(result))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
