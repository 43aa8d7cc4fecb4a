"""SAE-evaluation throughput: ``qwen_scope.evals.evaluate_saes`` beside the bare forward of the same model.

Model: the Qwen3.5-2B-shaped random bf16 model of ``collect_throughput.py`` (hidden 2048, 24 layers: 18 GDN + 6 full
attention, vocab 248320), one random 32K-wide TopK SAE (k = 50) at layer 12, rows of ``--context-len`` tokens in
batches of ``--batch-size``, ``use_cache=False``, under ``flashqla_kernels.patched_transformers(fused_layer=True)``
(the fused GDN decoder; the SAE encode dispatches to the fused TopK kernel for bf16 residuals on sm_90).

Arms:
  (a) bare forward of the causal LM with logits (what every evaluation pass is), tokens/s;
  (e) ``evaluate_saes`` over the same token count, all four splice modes: per batch one clean forward plus one per
      mode (5 forwards) and the per-token NLL / KL over the 248K vocabulary; corpus tokens/s, and the forward
      passes/s it sustains (5 x corpus tokens/s) as a fraction of (a);
  (e1) the same with ``modes=("sae",)`` (2 forwards a batch): what CE-recovered-free splicing costs.
Timing: one warm-up evaluation (compiles kernels, fills allocator caches), then the timed call, wall clock around it.

Correctness first: on one batch, the ``sae+error`` splice's loss equals the clean loss (relative 1e-3 in bf16).

Usage: ``python benchmarks/eval_throughput.py --out benchmarks/results`` on the GPU (``TILELANG_CACHE_DIR`` as for
``collect_throughput.py``); ``--smoke`` runs every code path on a tiny model on CPU in seconds.
Writes ``eval_throughput.json`` and ``eval_throughput.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import collect_throughput as ct  # noqa: E402 - the 2B-shaped model, the SAE and the environment report

LAYER, K = 12, 50


def _scope(tiny: bool):
    from qwen_scope.scope import Scope
    from saes import TopKSAE

    model = ct.build_model(tiny)
    tokenizer = type("Ids", (), {"eos_token_id": 0})()  # the corpus is token ids already
    g = torch.Generator(device=ct.DEVICE).manual_seed(0)
    w = torch.randn(ct.D_SAE, ct.D_MODEL, generator=g, device=ct.DEVICE) / ct.D_MODEL ** 0.5
    dtype = torch.bfloat16
    sae = TopKSAE(w.to(dtype), w.T.contiguous().to(dtype), torch.zeros(ct.D_SAE, device=ct.DEVICE, dtype=dtype),
                  torch.zeros(ct.D_MODEL, device=ct.DEVICE, dtype=dtype), k=min(K, ct.D_SAE))
    layer = min(LAYER, ct.N_LAYERS - 1)
    return Scope(model, tokenizer, {layer: sae.requires_grad_(False)}, model_name="random Qwen3.5-2B-shaped"), layer


def _docs(n_tokens: int, vocab: int) -> list[list[int]]:
    return [d["input_ids"] for d in ct.corpus(n_tokens, vocab)]


def _bare(scope, batch: int, context: int, steps: int) -> float:
    ids = torch.randint(1, scope.model.config.vocab_size, (batch, context), device=ct.DEVICE)
    with torch.no_grad():
        run = lambda: scope.model(input_ids=ids, use_cache=False).logits  # noqa: E731
        ct.sync_time(run, 1)
        return ct.sync_time(run, steps)


def _eval(scope, docs, config, modes) -> tuple[float, object]:
    from qwen_scope.evals import evaluate_saes

    ct.sync()
    t = time.perf_counter()
    result = evaluate_saes(scope, docs, config=config, modes=modes, progress=False)
    ct.sync()
    return time.perf_counter() - t, result


def write(out: Path, result: dict) -> None:
    (out / "eval_throughput.json").write_text(json.dumps(result, indent=1))
    v = result["env"]
    lines = [f"# SAE-evaluation throughput ({v['gpu']}, {v['date']})", "",
             f"torch {v['torch']}, transformers {v['transformers']}, tilelang {v['tilelang']}, commit {v['commit']}. "
             f"Model: {result['model']}; SAE {result['d_sae']} wide, k={result['k']}, at layer {result['layer']}; "
             f"rows of {result['context_len']} tokens, batches of {result['batch_size']}, {result['tokens']} "
             "corpus tokens timed.", "",
             "| arm | corpus tokens/s | forwards a batch | forward tokens/s | vs (a) |", "|---|---|---|---|---|"]
    for r in result["arms"]:
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:,.0f} | {r['forwards']} | {r['forward_tokens_per_s']:,.0f} | "
                     f"{100 * r['vs_a']:.1f}% |")
    lines += ["", "Checks:", ""] + [f"- {k}: {v}" for k, v in result["checks"].items()]
    (out / "eval_throughput.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--context-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4, help="batches in the timed evaluation")
    parser.add_argument("--smoke", action="store_true", help="every code path on a tiny model on CPU")
    args = parser.parse_args()
    from flashqla_kernels import patched_transformers
    from qwen_scope.evals import EvalConfig

    if args.smoke:
        ct.B, ct.T, ct.D_SAE, ct.D_MODEL, ct.N_LAYERS = 2, 64, 512, 64, 4
        ct.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        args.context_len, args.batch_size, args.batches = 64, 2, 2
    args.out.mkdir(parents=True, exist_ok=True)
    scope, layer = _scope(args.smoke)
    n_tokens = args.context_len * args.batch_size * args.batches
    config = EvalConfig(context_len=args.context_len, batch_size=args.batch_size, max_tokens=n_tokens)
    docs = _docs(n_tokens + args.context_len, scope.model.config.vocab_size)
    result = {"env": ct.versions(), "model": "Qwen3.5-2B-shaped random bf16" if not args.smoke else "tiny (smoke)",
              "d_sae": ct.D_SAE, "k": scope.sae(layer).k, "layer": layer, "context_len": args.context_len,
              "batch_size": args.batch_size, "tokens": n_tokens, "arms": [], "checks": {}}
    with patched_transformers(backend="tilelang" if ct.DEVICE == "cuda" else None, fused_layer=True):
        check = EvalConfig(context_len=args.context_len, batch_size=args.batch_size,
                           max_tokens=args.context_len * args.batch_size)
        _, first = _eval(scope, docs, check, ("sae+error",))
        e = first.layers[layer]
        rel = abs(e.loss["sae+error"] - e.loss_clean) / e.loss_clean
        result["checks"]["sae+error loss vs clean (rel.)"] = f"{rel:.2e}"
        if rel > 1e-3:
            raise SystemExit(f"the reconstruction + error splice moved the loss by {rel:.2e} (> 1e-3): not timing")
        bare = _bare(scope, args.batch_size, args.context_len, max(args.batches, 2))
        per_batch = args.batch_size * args.context_len
        result["arms"].append({"arm": "(a) bare forward", "tokens_per_s": per_batch / bare, "forwards": 1,
                               "forward_tokens_per_s": per_batch / bare, "vs_a": 1.0})
        for arm, modes in (("(e) evaluate_saes, 4 modes", ("sae", "sae+error", "zero", "mean")),
                           ("(e1) evaluate_saes, sae only", ("sae",))):
            _eval(scope, docs, check, modes)  # warm-up
            sec, res = _eval(scope, docs, config, modes)
            forwards = 1 + len(modes)
            tps = n_tokens / sec
            result["arms"].append({"arm": arm, "tokens_per_s": tps, "forwards": forwards,
                                   "forward_tokens_per_s": forwards * tps,
                                   "vs_a": forwards * tps / (per_batch / bare)})
            result["checks"][f"{arm}: CE recovered / KL"] = (f"{res.layers[layer].ce_recovered}, "
                                                            f"{res.layers[layer].kl['sae']:.4f}")
            write(args.out, result)
    write(args.out, result)
    print((args.out / "eval_throughput.md").read_text())


if __name__ == "__main__":
    main()
