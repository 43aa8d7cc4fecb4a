"""Steered generation throughput: transformers' generate (as installed, and with our patches) vs the decode engine.

Model: the Qwen3.5-2B-shaped random bf16 model of ``collect_throughput.py`` (hidden 2048, 24 layers: 18 GDN and 6
full attention, vocab 248320), prompts of ``--prompt`` tokens, ``--new`` new tokens, greedy. Arms:
  hf          ``model.generate`` as installed (FLA's kernels when importable), steering by ``qwen_scope.steering``'s hook;
  hf+patches  the same inside ``flashqla_kernels.patched_transformers(fused_layer=True)``;
  engine      ``qwen_scope.engine.DecodeEngine.generate`` (prefill on the model's forward, then the captured decode
              step replayed per token on CUDA), steering from its device buffers.
Each at batch 1, 8, 32, 128 and steering none / one add (``resid_post.12``, every position) / one clamp through a
32K-wide SAE. Reported: new tokens/s (B x new / wall, prefill included), ms per decode token (wall / new), and the
weight-bandwidth floor: the bytes of the weights read once per step over 4.2 TB/s (the H200's HBM3e peak).

Sweep: ``--sweep-strengths`` strengths x ``--sweep-prompts`` prompts of one add edit (``--sweep-new`` new tokens),
as one engine batch of all rows, against the loop of one ``generate`` per (strength, prompt) that a sweep without
the engine runs. The loop is timed over its first prompt's strengths and scaled by the prompt count (the rows of a
loop cost the same; the table says so).

Correctness first: on one prompt each arm's greedy tokens are compared with the engine's (the count of identical
decisions is reported; a near-tie may split bf16 paths, the CPU tests prove the fp32 equality).

Usage: ``python benchmarks/steer_generate.py --out benchmarks/results`` on the GPU machine writes
``steer_generate.json`` and ``steer_generate.md`` after every arm (a timeout keeps what ran); ``--tiny`` runs every arm
on a tiny model (CPU is fine) as a dry run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import collect_throughput as ct  # noqa: E402 - the 2B-shaped model's config, sync and the environment report

HBM_BYTES_PER_S = 4.2e12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ct.DEVICE = DEVICE


def build_model(tiny: bool):
    import transformers as tf

    torch.manual_seed(0)
    config = ct.model_config(tiny)
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = tf.Qwen3_5ForCausalLM(config)
    dtype = torch.float32 if tiny else torch.bfloat16
    return model.to(dtype).eval().requires_grad_(False)


def random_sae(d_model: int, d_sae: int, k: int, dtype: torch.dtype):
    from saes import TopKSAE

    g = torch.Generator().manual_seed(0)
    w_dec = torch.randn(d_model, d_sae, generator=g)
    w_dec = w_dec / w_dec.norm(dim=0, keepdim=True)
    sae = TopKSAE(w_dec.T.contiguous(), w_dec, torch.zeros(d_sae), torch.zeros(d_model), k=k)
    return sae.to(DEVICE, dtype).requires_grad_(False)


def weight_floor_ms(model) -> float:
    """One decode step reads every weight once (the embedding only by row): bytes / HBM bandwidth, in ms."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    params -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return 1e3 * params / HBM_BYTES_PER_S


def edits_for(kind: str, layer: int):
    from qwen_scope.steering import add, clamp

    return {"none": [], "add": [add(layer, 7, 8.0)], "clamp": [clamp(layer, 7, 5.0)]}[kind]


def run_hf(model, saes, prompts, new: int, edits, patched: bool) -> torch.Tensor:
    import contextlib

    from flashqla_kernels import patched_transformers
    from qwen_scope.steering import steering

    ids = torch.stack(prompts)
    ctx = patched_transformers(fused_layer=True) if patched else contextlib.nullcontext()
    with torch.no_grad(), ctx, steering(model, edits, saes=saes, prompt_length=ids.shape[1]):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def run_engine(engine, prompts, new: int, edits) -> torch.Tensor:
    result = engine.generate(prompts, [edits] * len(prompts), max_new_tokens=new, stop_tokens=[])
    return torch.stack([r.token_ids for r in result.rows])


def run_sweep(model, engine, saes, layer: int, vocab: int, P: int, N: int, M: int, new: int) -> dict:
    """N strengths x M prompts of one add edit: one engine batch against the loop of generate calls."""
    from qwen_scope.steering import add

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, vocab, (P,), generator=g).to(DEVICE) for _ in range(M)]
    strengths = torch.linspace(-16.0, 16.0, N).tolist()
    rows = [(p, [add(layer, 7, s)]) for p in prompts for s in strengths]
    engine_wall, engine_tokens = timed(lambda: torch.stack([r.token_ids for r in engine.generate(
        [p for p, _ in rows], [e for _, e in rows], max_new_tokens=new, stop_tokens=[]).rows]))
    loop_wall, loop_tokens = timed(lambda: torch.cat([run_hf(model, saes, [p], new, e, patched=False)
                                                      for p, e in rows[:N]]),
                                   warm=lambda: run_hf(model, saes, [rows[0][0]], 4, rows[0][1], patched=False))
    agree = int((loop_tokens.cpu() == engine_tokens[:N].cpu()).sum())
    return {"strengths": N, "prompts": M, "new": new, "engine_s": engine_wall, "loop_s_measured": loop_wall,
            "loop_rows_measured": N, "loop_s": loop_wall * M, "speedup": loop_wall * M / engine_wall,
            "agree": f"{agree}/{loop_tokens.numel()}"}


def timed(fn, warm=None) -> tuple[float, torch.Tensor]:
    """Wall time of ``fn()`` after a warm-up (``warm()``, default ``fn()`` itself)."""
    (warm or fn)()  # warm-up: kernels compiled, the engine's buffers allocated and its graph captured
    ct.sync()
    start = time.perf_counter()
    out = fn()
    ct.sync()
    return time.perf_counter() - start, out


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "steer_generate.json").write_text(json.dumps(result, indent=1))
    v = result["env"]
    lines = [f"# Steered generation ({v['gpu']}, {v['date']})", "",
             f"torch {v['torch']}, transformers {v['transformers']}, tilelang {v['tilelang']}, fla "
             f"{v['fla-core'] or v['flash-linear-attention']}, commit {v['commit']}. Model: {result['model']}; prompt "
             f"{result['prompt']} tokens, {result['new']} new tokens, greedy. Weight-bandwidth floor: "
             f"{result['floor_ms']:.4g} ms per step ({result['weight_gb']:.2f} GB of weights at 4.2 TB/s).", "",
             "| arm | batch | steering | new tokens/s | ms per token | floor ms | x hf | same tokens as engine | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["arms"]:
        if "tokens_per_s" in r:
            lines.append(f"| {r['arm']} | {r['batch']} | {r['steering']} | {r['tokens_per_s']:,.1f} | "
                         f"{r['ms_per_token']:.2f} | {result['floor_ms']:.4g} | {r.get('vs_hf', float('nan')):.2f} | "
                         f"{r.get('agree', '-')} | |")
        else:
            lines.append(f"| {r['arm']} | {r['batch']} | {r['steering']} | - | - | - | - | - | {r['error']} |")
    sw = result.get("sweep")
    if sw:
        lines += ["", f"Sweep: {sw['strengths']} strengths x {sw['prompts']} prompts, {sw['new']} new tokens: the engine "
                  f"batch {sw['engine_s']:.2f} s; the generate loop {sw['loop_s']:.1f} s ({sw['loop_s_measured']:.2f} s "
                  f"measured over {sw['loop_rows_measured']} rows, x {sw['prompts']} prompts): {sw['speedup']:.1f}x; "
                  f"tokens equal to the loop's on the measured rows: {sw['agree']}."]
    (out / "steer_generate.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tiny", action="store_true", help="dry run of every arm on a tiny model (CPU ok)")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; tiny 8)")
    parser.add_argument("--new", type=int, default=None, help="new tokens (default 128; tiny 4)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting arms after this many seconds")
    parser.add_argument("--arms", default="engine,hf,hf+patches", type=lambda a: a.split(","),
                        help="comma-separated arms to run (default all three, side by side)")
    parser.add_argument("--sweep-strengths", type=int, default=None, help="sweep strengths (default 16; tiny 2)")
    parser.add_argument("--sweep-prompts", type=int, default=None, help="sweep prompts (default 8; tiny 2)")
    parser.add_argument("--sweep-new", type=int, default=None, help="sweep new tokens (default 32; tiny 4)")
    args = parser.parse_args(argv)
    batches = args.batches or ([1, 2] if args.tiny else [1, 8, 32, 128])
    P, new = args.prompt or (8 if args.tiny else 512), args.new or (4 if args.tiny else 128)
    began = time.perf_counter()

    from qwen_scope.engine import DecodeEngine

    model = build_model(args.tiny)
    cfg = model.config
    layer = min(12, cfg.num_hidden_layers - 1)
    saes = {layer: random_sae(cfg.hidden_size, 256 if args.tiny else 32768, 8 if args.tiny else 100, model.dtype)}
    engine = DecodeEngine(model, saes)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"env": ct.versions(), "model": "tiny Qwen3.5 (fp32, dry run)" if args.tiny else
              "Qwen3.5-2B-shaped random bf16", "prompt": P, "new": new, "floor_ms": weight_floor_ms(model),
              "weight_gb": weight_bytes / 1e9, "arms": []}
    g = torch.Generator().manual_seed(1)
    for B in batches:
        prompts = [torch.randint(1, cfg.vocab_size, (P,), generator=g).to(DEVICE) for _ in range(B)]
        for kind in ("none", "add", "clamp"):
            edits = edits_for(kind, layer)
            # generate's warm-up is a short call (its kernels compile on any length); the engine's is the same
            # request (its buffers and graph are sized by it)
            arms = {"engine": (lambda: run_engine(engine, prompts, new, edits), None),
                    "hf": (lambda: run_hf(model, saes, prompts, new, edits, patched=False),
                           lambda: run_hf(model, saes, prompts, 4, edits, patched=False)),
                    "hf+patches": (lambda: run_hf(model, saes, prompts, new, edits, patched=True),
                                   lambda: run_hf(model, saes, prompts, 4, edits, patched=True))}
            arms = {name: arm for name, arm in arms.items() if name in args.arms}
            reference, hf_rate = None, None
            for name, (fn, warm) in arms.items():
                row = {"arm": name, "batch": B, "steering": kind}
                if time.perf_counter() - began > args.budget_s:
                    row["error"] = f"skipped: past the {args.budget_s:.0f} s budget"
                else:
                    try:
                        wall, tokens = timed(fn, warm)
                        row.update(tokens_per_s=B * new / wall, ms_per_token=1e3 * wall / new)
                        reference = tokens.cpu() if name == "engine" else reference
                        if reference is not None:
                            row["agree"] = f"{int((tokens.cpu() == reference).sum())}/{reference.numel()}"
                        hf_rate = row["tokens_per_s"] if name == "hf" else hf_rate
                    except Exception as err:  # an arm that fails is reported in the table, the others still run
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                result["arms"].append(row)
            for row in result["arms"][-len(arms):]:
                if hf_rate and "tokens_per_s" in row:
                    row["vs_hf"] = row["tokens_per_s"] / hf_rate
            write(args.out, result)
    if time.perf_counter() - began <= args.budget_s:
        N, M = args.sweep_strengths or (2 if args.tiny else 16), args.sweep_prompts or (2 if args.tiny else 8)
        result["sweep"] = run_sweep(model, engine, saes, layer, cfg.vocab_size, P, N, M,
                                    args.sweep_new or (4 if args.tiny else 32))
        write(args.out, result)
    print((args.out / "steer_generate.md").read_text())


if __name__ == "__main__":
    main()
