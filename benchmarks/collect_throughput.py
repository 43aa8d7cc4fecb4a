"""Activation-collection throughput on one H200: bare forward vs ``qwen_scope.collect`` writing a real store.

Model: the Qwen3.5-2B-shaped random bf16 model of ``shared/reference/anchors-h200.md`` (hidden 2048, 24 layers: 18 GDN
with Hk = Hv = 16 and 6 full attention, vocab 248320, 2.39 B parameters), steps of 8 x 4096 tokens, ``use_cache=False``.
Arms, per GDN backend (ours = ``flashqla_kernels.patch_transformers(backend="tilelang", fused_layer=True)``, what
``collect`` uses by itself on Hopper; FLA = transformers with
flash-linear-attention importable, torch = transformers' pure-torch ``torch_chunk_gated_delta_rule``):
  (a) bare forward of the text model, called as ``collect`` calls it (no hooks, no lm_head, the per-layer-type mask
      mapping of ``adapter.unpadded_masks()`` that spares transformers' packed-sequence check and its device sync:
      with that sync, FLA's and the torch path's host-heavy forwards ran 6-17% slower than their own collection steps);
  (b) ``collect`` of all 24 ``resid_post`` points, dense bf16, into the store on local disk (fsync per shard);
  (c1) ``collect`` of SAE codes (32K wide, k = 100) at layer 23 (the whole forward runs), codes written;
  (c24) the same at all 24 layers.
Encode backend: ``saes.fused_encode`` (TileLang on sm_90); the ``*-torch-encode`` arms force the torch path (bf16 addmm
+ ReLU + topk). Timing: one warm-up collection (compiles kernels, fills allocator caches), then a timed ``collect`` of
``--steps`` steps, wall clock around the whole call (store set-up, the pipeline filling and draining, shard writes
and the final fsync included: "end to end"). For the code arms also the steady state a long run converges to: one
more ``collect`` call of ``n + 2`` steps (n = ``--steady-steps``) timing each step as it reaches the host
(``collect(on_step=...)``), and ms/step = the mean interval between steps 2 and n + 2 (the store set-up, the pipeline
filling and the final drain fall outside it), not the difference of two calls' wall times, which the per-call costs
make noisy (a (c24) "steady" MFU of 125% in one run). (a) is a steady-state measure
itself (warm-up excluded), so the bar (c1) >= 90% of (a) compares steady states; both are reported. MFU = (model FLOPs + SAE-encode FLOPs) x tokens/s /
the bf16 matmul peak measured in the same run.

Correctness first: the three GDN backends' final hidden states on a 1 x 4096 batch are compared (rel. L2), the fused
encode is compared with ``encode_sparse``, and one stored row is compared with a direct capture.

Usage: first, on any machine with nvcc, ``TILELANG_CACHE_DIR=.tlcache python benchmarks/collect_throughput.py
--precompile``; then on the GPU machine (carrying ``.tlcache``, same ``TILELANG_CACHE_DIR``)
``python benchmarks/collect_throughput.py --out <dir> [--steps 3] [--budget-s 170]``, which writes
``collect_throughput.json`` and ``collect_throughput.md`` into ``--out`` after every arm (a timeout keeps what ran).
``--tiny`` runs every code path on a tiny model (CPU is fine) as a dry run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402


def _bare_qwen_scope_package() -> None:
    """Import ``qwen_scope.*`` submodules without running ``qwen_scope/__init__`` when an optional dependency of an
    unrelated submodule (plotly, for the dashboards) is missing on the GPU host."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("plotly") is not None or "qwen_scope" in sys.modules:
        return
    package = types.ModuleType("qwen_scope")
    package.__path__ = [str(Path(__file__).resolve().parents[1] / "qwen_scope")]
    sys.modules["qwen_scope"] = package


_bare_qwen_scope_package()

B, T, D_SAE, K, D_MODEL, N_LAYERS, DEVICE = 8, 4096, 32768, 100, 2048, 24, "cuda"


def model_config(tiny: bool = False):
    import transformers as tf

    if tiny:
        return tf.Qwen3_5TextConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
    return tf.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False, max_position_embeddings=8192)


def build_model(tiny: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    config = model_config(tiny)
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = tf.Qwen3_5ForCausalLM(config)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def model_flops_per_token(model) -> float:
    """2 x non-embedding params + causal attention scores (6 layers) + GDN chunk math (18 layers)."""
    cfg = model.config
    params = sum(p.numel() for p in model.model.parameters()) - model.model.embed_tokens.weight.numel()
    n_full = cfg.layer_types.count("full_attention")
    attention = n_full * 2 * T * cfg.num_attention_heads * cfg.head_dim
    gdn = (len(cfg.layer_types) - n_full) * cfg.linear_num_value_heads * (
        4 * 2 * 64 * 64 * 128 + 3 * 2 * 64 * 128 * 128) / 64
    return 2 * params + attention + gdn


def random_sae(seed: int):
    from saes import TopKSAE

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(D_SAE, D_MODEL, generator=g, device=DEVICE) / D_MODEL ** 0.5
    b_enc = 0.01 * torch.randn(D_SAE, generator=g, device=DEVICE)
    sae = TopKSAE(w.bfloat16(), w.T.contiguous().bfloat16(), b_enc.bfloat16(),
                  torch.zeros(D_MODEL, device=DEVICE).bfloat16(), k=K, compute_dtype=torch.bfloat16)
    return sae.requires_grad_(False)


# ---------------------------------------------------------------------------------------------- GDN backends
class Backends:
    """Switch transformers' Qwen3.5 GDN op between ours, FLA and the pure-torch path (module global swap)."""

    def __init__(self):
        from transformers.models.qwen3_5 import modeling_qwen3_5

        from flashqla_kernels.patching.op import transformers_op_parts

        self.module = modeling_qwen3_5
        self.original = self.module.torch_chunk_gated_delta_rule
        implementation, pure = transformers_op_parts(self.original)
        self.fla = getattr(implementation, "__module__", "").startswith("fla")
        params = set(inspect.signature(pure).parameters)
        self.torch_path = lambda *a, **kw: pure(*a, **{k: v for k, v in kw.items() if k in params})

    def available(self) -> list[str]:
        out = []
        try:
            import flashqla_kernels  # noqa: F401
            out.append("ours")
        except ImportError:
            pass
        return out + (["fla"] if self.fla else []) + ["torch"]

    def use(self, name: str) -> None:
        from flashqla_kernels import unpatch_transformers, patch_transformers

        unpatch_transformers()
        self.module.torch_chunk_gated_delta_rule = self.original
        if name == "ours":  # what collect() does by itself on Hopper: the whole GDN layer on the fused path
            patch_transformers(backend="tilelang" if DEVICE == "cuda" else None, fused_layer=True)
        elif name == "torch":
            self.module.torch_chunk_gated_delta_rule = self.torch_path


# ---------------------------------------------------------------------------------------------- measurements
def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def sync_time(fn, steps: int) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t) / steps


def matmul_peak() -> float:
    n = 8192 if DEVICE == "cuda" else 512
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    sync_time(lambda: a @ b, 3)
    return 2 * n ** 3 / sync_time(lambda: a @ b, 20)


def disk_write_gbps(work: Path) -> float:
    data = torch.randint(0, 255, (1 << (30 if DEVICE == "cuda" else 24),), dtype=torch.uint8).numpy()
    path = work / "disk_probe"
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return data.nbytes / dt / 1e9


def corpus(n_tokens: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    docs, total = [], 0
    while total < n_tokens:
        n = int(torch.randint(500, 6000, (1,), generator=g))
        docs.append({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()})
        total += n
    return docs


def collect_arm(model, docs, work: Path, steps: int, *, points=None, saes=None, check=False,
                steady_steps: int = 0) -> tuple[float, dict]:
    """Seconds per step of a timed ``collect`` after a one-step warm-up; the summary of the timed call. With
    ``steady_steps`` (n), ``info["steady_s_per_step"]``: one more call of n + 2 steps, each step's arrival at the
    host timed through ``on_step``, and the mean interval from the second step's arrival to the last's (n intervals:
    the set-up, the pipeline fill and the drain are outside it)."""
    from qwen_scope.collect import collect

    # gdn_kernels=False: the arm's GDN path is the one Backends.use put in place
    kw = dict(points=points, saes=saes, context_len=T, batch_size=B, shard_tokens=B * T, progress=False,
              corpus_id="bench", overwrite=True, gdn_kernels=False)
    collect(model, docs, token_budget=B * T, out_dir=work / "warm", **kw)
    sync()
    t = time.perf_counter()
    summary = collect(model, docs, token_budget=steps * B * T, out_dir=work / "timed", **kw)
    dt = time.perf_counter() - t
    info = {"n_tokens": summary.n_tokens, "bytes": summary.bytes, "shards": summary.n_shards}
    if check:
        info["check"] = check_store(model, work / "timed", saes)
    if steady_steps:
        shutil.rmtree(work / "timed", ignore_errors=True)
        arrivals = []
        sync()
        collect(model, docs, token_budget=(steady_steps + 2) * B * T, out_dir=work / "timed",
                on_step=lambda stored: arrivals.append(time.perf_counter()), **kw)
        info["steady_s_per_step"] = (arrivals[-1] - arrivals[1]) / (len(arrivals) - 2)
        info["step_arrivals_s"] = [a - arrivals[0] for a in arrivals]
    for d in ("warm", "timed"):
        shutil.rmtree(work / d, ignore_errors=True)
    return dt / steps, info


def check_store(model, path: Path, saes) -> dict:
    """The store's first row against a direct capture: dense max |diff|, code-index agreement."""
    from hooks import capture_forward, resid_post
    from qwen_scope.store import ActivationStore

    store = ActivationStore(path, verify=True)
    ids = store.token_ids()[:T][None].to(DEVICE)
    points = [p for p in store.points if store.point_info(p)["dense"]][-1:] + list(
        resid_post(n) for n in (saes or {}))[:1]
    cap = capture_forward(model, points, input_ids=ids)
    out = {}
    for p in points:
        x = cap[p][0]
        if store.point_info(p)["dense"]:
            # the stored row ran in a batch of B, the check alone: bf16 GEMMs round batch-dependently
            stored = store.dense(p, 0, T).to(DEVICE).float()
            out[f"{p} dense rel-L2 vs a direct forward"] = float((stored - x.float()).norm() / x.float().norm())
        if store.point_info(p)["sae"]:
            want = fp32_twin(saes[int(p.split(".")[1])]).encode_sparse(x)
            got = store.sae_codes(p, 0, T)
            out[f"{p} stored codes: features shared with encode_sparse (fp32) of a direct forward"] = \
                shared_features(got, want)
    return out


def correctness(model, backends: Backends, names: list[str]) -> dict:
    from hooks import capture_forward, resid_post

    g = torch.Generator(device=DEVICE).manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g, device=DEVICE)
    outs, result = {}, {}
    for name in names:
        backends.use(name)
        last = resid_post(N_LAYERS - 1)
        outs[name] = capture_forward(model, [last], input_ids=ids)[last].float()
    ref = outs.get("fla", outs.get("torch"))
    for name, o in outs.items():
        vs = "fla" if "fla" in outs else "torch"
        result[f"gdn {name} vs {vs} rel-L2 (last resid_post)"] = float((o - ref).norm() / ref.norm())
        result[f"gdn {name} vs {vs} max |difference| (last resid_post; max |value| {ref.abs().max():.3g})"] = float(
            (o - ref).abs().max())
    from saes.fused import explain_backend, fused_encode

    sae = random_sae(0)
    x = outs[names[0]][0].bfloat16()
    fused = fused_encode(x, sae)
    result["encode backend"] = explain_backend(x, sae)
    # The fused encode accumulates in fp32; the benchmark SAE's own encode_sparse computes in bf16 (compute_dtype),
    # whose rounding (2^-8) is wider than the gap between the k-th and (k+1)-th pre-activation: compare with both.
    for label, ref in (("fp32 compute", fp32_twin(sae).encode_sparse(x)), ("bf16 compute", sae.encode_sparse(x))):
        result[f"fused vs encode_sparse ({label}): index sets equal (fraction of tokens)"] = float(
            (fused.indices.sort(-1).values == ref.indices.sort(-1).values).all(-1).float().mean())
        result[f"fused vs encode_sparse ({label}): features shared (fraction)"] = shared_features(fused, ref)
        result[f"fused vs encode_sparse ({label}): max |value diff| / max value"] = float(
            (fused.values.float() - ref.values.float()).abs().max() / ref.values.float().abs().max())
    return result


def fp32_twin(sae):
    """The same weights with the default compute dtype (fp32 math on bf16 weights), like the fused kernel."""
    from saes import TopKSAE

    return TopKSAE(sae.W_enc, sae.W_dec, sae.b_enc, sae.b_dec, k=sae.k).requires_grad_(False)


def shared_features(got, want) -> float:
    """Share of ``want``'s (token, feature) picks that ``got`` also made."""
    hit = (got.indices.to(want.indices.device)[..., :, None] == want.indices[..., None, :]).any(-2)
    return float(hit.float().mean())


def versions() -> dict:
    out = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)", "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for dist in ("transformers", "triton", "tilelang", "flash-linear-attention", "fla-core", "flash-qla"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        out["commit"] = os.environ.get("QWEN_SCOPE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        out["commit"] = None
    return out


def write(out: Path, result: dict) -> None:
    (out / "collect_throughput.json").write_text(json.dumps(result, indent=1))
    v, rows = result["env"], result["arms"]
    lines = [f"# Collection throughput ({v['gpu']}, {v['date']})", "",
             f"torch {v['torch']}, transformers {v['transformers']}, triton {v['triton']}, tilelang {v['tilelang']}, "
             f"fla {v['fla-core'] or v['flash-linear-attention']}, commit {v['commit']}. "
             "Model: Qwen3.5-2B-shaped random "
             f"bf16 ({result['params_b']:.2f} B params, {result['model_gflop_per_token']:.2f} GFLOP/token), steps "
             f"of {B} x {T} tokens, use_cache=False, SAE {D_SAE} wide k={K}. bf16 matmul peak measured: "
             f"{result['peak_tflops']:.0f} TFLOP/s; disk write with fsync: {result['disk_write_GBps']:.2f} GB/s.", "",
             "End to end: one timed call of the arm's steps, set-up and drain included. Steady: the mean step "
             "interval of a longer call, each step timed as it reaches the host (code arms only). (a) is a "
             "steady-state measure.", "",
             "| GDN backend | arm | tokens/s | ms/step | MFU | vs (a) same backend | steady tokens/s | steady ms/step "
             "| steady MFU | steady vs (a) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tokens_per_s" in r:
            steady = (f"{r['steady_tokens_per_s']:,.0f} | {r['steady_ms_per_step']:.1f} | "
                      f"{100 * r['steady_mfu']:.1f}% | {100 * r['steady_vs_a']:.1f}%" if "steady_tokens_per_s" in r
                      else "- | - | - | -")
            lines.append(f"| {r['backend']} | {r['arm']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                         f"{100 * r['mfu']:.1f}% | {100 * r['vs_a']:.1f}% | {steady} | {r.get('note', '')} |")
        else:
            lines.append(f"| {r['backend']} | {r['arm']} | - | - | - | - | - | - | - | - | "
                         f"{r.get('error', r.get('note', ''))} |")
    lines += ["", "Checks:", ""] + [f"- {k}: {v}" for k, v in result["checks"].items()]
    (out / "collect_throughput.md").write_text("\n".join(lines) + "\n")


def precompile() -> None:
    """Compile (sm_90a, no GPU needed) the TileLang kernels the arms use into tilelang's cache
    (``TILELANG_CACHE_DIR``), so the timed run on the GPU loads them instead of JIT-compiling for minutes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import chunk_kernels

    from saes import hopper_topk

    # the chunk kernels at Hk = Hv = 16: 1 sequence (the checks) and B (the arms)
    for spec in chunk_kernels.chunk_specs({(16, 16, 128, "bfloat16", n) for n in (1, B)}, 132, final=(False, True)):
        _, _, err = chunk_kernels.build_one(spec)
        if err:
            raise RuntimeError(f"{spec}: {err}")
    hopper_topk.compile_topk_candidates(2048, D_SAE, hopper_topk.candidates_per_tile(K, D_SAE), "bfloat16")
    print("precompiled the GDN (Hk = Hv = 16, K = V = 128, bf16) and fused-encode (2048 -> 32768, k = 100) kernels")


ARMS = [  # (backend, arm) in priority order: the time budget cuts from the end
    ("ours", "a"), ("ours", "c1"), ("ours", "c24"), ("ours", "b"), ("fla", "a"), ("fla", "c1"), ("torch", "a"),
    ("torch", "c1"), ("ours", "c1-torch-encode"), ("ours", "c24-torch-encode"), ("fla", "c24"), ("fla", "b"),
    ("torch", "c24"), ("torch", "b")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/collect_bench"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--steady-steps", type=int, default=6,
                        help="n: the code arms' steady state from one more call of n + 2 steps, timed step by step; "
                             "0: skip")
    parser.add_argument("--budget-s", type=float, default=170.0)
    parser.add_argument("--arms", default="",
                        help="comma-separated backend:arm pairs to run (e.g. ours:a,ours:c24,fla:c24); default: all")
    parser.add_argument("--tiny", action="store_true", help="dry run of every code path on a tiny model (CPU ok)")
    parser.add_argument("--precompile", action="store_true", help="only fill the TileLang cache (CPU is enough)")
    args = parser.parse_args()
    if args.precompile:
        precompile()
        return
    global B, T, D_SAE, K, D_MODEL, N_LAYERS, DEVICE
    if args.tiny:
        B, T, D_SAE, K, D_MODEL, N_LAYERS = 2, 128, 512, 8, 64, 4
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"env": versions(), "arms": [], "checks": {}}
    result["peak_tflops"] = matmul_peak() / 1e12
    result["disk_write_GBps"] = disk_write_gbps(args.work)
    model = build_model(args.tiny)
    flops = model_flops_per_token(model)
    result["model_gflop_per_token"] = flops / 1e9
    result["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    backends = Backends()
    names = backends.available()
    result["checks"].update(correctness(model, backends, names))
    print(json.dumps(result, indent=1), flush=True)
    docs = corpus((max(args.steps, args.steady_steps + 2) + 1) * B * T + 10_000, model.config.vocab_size)
    sae_all = {n: random_sae(100 + n) for n in range(N_LAYERS)}
    bare = {}
    chosen = [tuple(a.split(":", 1)) for a in args.arms.split(",") if a]
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown --arms {unknown}; choose from {', '.join(f'{b}:{a}' for b, a in ARMS)}")
    for backend, arm in [a for a in ARMS if not chosen or a in chosen]:
        row = {"backend": backend, "arm": arm}
        result["arms"].append(row)
        if backend not in names:
            row["note"] = "backend not available"
            continue
        if time.perf_counter() - t0 > args.budget_s:
            row["note"] = "skipped: time budget"
            continue
        backends.use(backend)
        try:
            sae_flops, info = 0.0, {}
            if arm == "a":
                ids = torch.randint(0, model.config.vocab_size, (B, T), device=DEVICE)
                from hooks import get_adapter

                adapter = get_adapter(model)
                masks = adapter.unpadded_masks()
                mask_kw = {} if masks is None else {"attention_mask": masks}
                with torch.no_grad():
                    run = lambda: adapter.text_model(input_ids=ids, use_cache=False, **mask_kw)  # noqa: E731
                    sync_time(run, 1)
                    sec = sync_time(run, args.steps)
                bare[backend] = sec
            elif arm == "b":
                from hooks import resid_post

                sec, info = collect_arm(model, docs, args.work, args.steps,
                                        points=[resid_post(n) for n in range(N_LAYERS)], check=backend == "ours")
            else:
                layers = [N_LAYERS - 1] if arm.startswith("c1") else list(range(N_LAYERS))
                saes = {n: sae_all[n] for n in layers}
                if arm.endswith("torch-encode"):
                    from saes import fused as fe

                    # no verifier passes: fused_encode takes its torch path
                    saved, fe._verifiers = fe._verifiers, lambda x, sae: (lambda: "forced torch",)
                try:
                    sec, info = collect_arm(model, docs, args.work, args.steps, saes=saes,
                                            check=backend == "ours" and arm == "c1", steady_steps=args.steady_steps)
                finally:
                    if arm.endswith("torch-encode"):
                        fe._verifiers = saved
                sae_flops = len(layers) * 2 * D_MODEL * D_SAE
            row.update(ms_per_step=1e3 * sec, tokens_per_s=B * T / sec,
                       mfu=(flops + sae_flops) * B * T / sec / (result["peak_tflops"] * 1e12))
            row["vs_a"] = bare[backend] / sec if backend in bare else float("nan")
            if "steady_s_per_step" in info:
                st = info["steady_s_per_step"]
                row.update(steady_ms_per_step=1e3 * st, steady_tokens_per_s=B * T / st,
                           steady_mfu=(flops + sae_flops) * B * T / st / (result["peak_tflops"] * 1e12),
                           steady_vs_a=bare[backend] / st if backend in bare else float("nan"))
            if "bytes" in info:
                # what the disk must absorb: the store's bytes per step, and that rate at the arm's steady pace
                row["bytes_per_step"] = info["bytes"] / info["n_tokens"] * B * T
                st = info.get("steady_s_per_step", sec)
                row["note"] = (f"{row['bytes_per_step'] / 1e6:,.1f} MB/step written "
                               f"({info['bytes'] / info['n_tokens']:,.0f} B/token), "
                               f"{row['bytes_per_step'] / st / 1e9:.2f} GB/s")
            if "check" in info:
                result["checks"].update({f"{backend} {arm}: {k}": v for k, v in info["check"].items()})
        except Exception as err:  # noqa: BLE001 - one failing arm must not lose the others
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps(row), f"t={time.perf_counter() - t0:.0f}s", flush=True)
        write(args.out, result)
    result["wall_s"] = time.perf_counter() - t0
    write(args.out, result)
    print((args.out / "collect_throughput.md").read_text())


if __name__ == "__main__":
    main()
