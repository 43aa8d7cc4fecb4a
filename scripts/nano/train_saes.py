"""Train the nano model's SAE set (one TopK SAE per decoder block, at resid_post) with ``saes.training``.

Deterministic: activations come from fixed windows of the corpus (a seeded choice), position 0 of every window is
dropped (the outlier position, as Qwen-Scope filters it), and every SAE is trained with a fixed seed. Writes the set in
the Qwen-Scope release layout (``layer{n}.sae.pt`` dicts; bf16 by default to keep the package small) plus
``training.json`` (config, per-layer metrics and curves). Metrics per layer, on held-out validation windows: FVE, L0,
dead fraction (never fired on validation), and the next-byte loss with the SAE spliced in (vs clean).

Usage: python scripts/nano/train_saes.py --model qwen_scope/data/nano --data .nano/corpus
"""
from __future__ import annotations

import argparse
import fcntl
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from saes import TopKSAE
from saes.training import SAETrainingConfig, evaluate_sae, save_release, train_sae
from saes.training_data import decoder_layers, model_activations

REPO = Path(__file__).resolve().parents[2]
RELEASE = "SAE-Res-Qwen3.5-Nano-Base-W{w}K-L0_{k}"


def windows(path: Path, n_tokens: int, seq: int, seed: int) -> torch.Tensor:
    """``[n_tokens // seq, seq]`` non-overlapping windows of the token file, a seeded choice in file order."""
    ids = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    n_all = ids.numel() // seq
    n = min(n_all, max(1, n_tokens // seq))
    pick = torch.randperm(n_all, generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return ids[: n_all * seq].reshape(n_all, seq)[pick]


def collect(model, wins: torch.Tensor, layers: list[int], batch_seqs: int) -> dict[int, torch.Tensor]:
    parts: dict[int, list[torch.Tensor]] = {n: [] for n in layers}
    for acts in model_activations(model, wins.split(batch_seqs), layers, skip_positions=1):
        for n in layers:
            parts[n].append(acts[n])
    return {n: torch.cat(p) for n, p in parts.items()}


@torch.no_grad()
def spliced_loss(model, wins: torch.Tensor, layer: int | None, sae: TopKSAE | None, batch_seqs: int) -> float:
    """Next-byte loss (nats) on ``wins`` (positions >= 1 predicted), with block ``layer``'s output replaced by the
    SAE reconstruction at positions >= 1 (``layer=None``: clean)."""
    handle = None
    if layer is not None:
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            patched = torch.cat([hidden[:, :1], sae(hidden[:, 1:])], dim=1)
            return (patched, *output[1:]) if isinstance(output, tuple) else patched
        handle = decoder_layers(model)[layer].register_forward_hook(hook)
    total, count = 0.0, 0
    try:
        for ids in wins.split(batch_seqs):
            ids = ids.to(next(model.parameters()).device)
            logits = model(input_ids=ids, use_cache=False).logits[:, 1:-1]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1),
                                           reduction="sum"))
            count += ids[:, 2:].numel()
    finally:
        if handle is not None:
            handle.remove()
    return total / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "qwen_scope/data/nano"))
    p.add_argument("--data", default=".nano/corpus")
    p.add_argument("--out", default=None, help="release dir (default: next to the model, named from d_sae and k)")
    p.add_argument("--d-sae", type=int, default=1024)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--train-tokens", type=int, default=600_000, help="distinct activation tokens per layer")
    p.add_argument("--n-tokens", type=int, default=4_000_000, help="training tokens per SAE (epochs over them)")
    p.add_argument("--val-tokens", type=int, default=40_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch-seqs", type=int, default=16)
    p.add_argument("--layers", default="all")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core machine)")
    p.add_argument("--device", default="cpu", help="where the model runs and the SAEs train (cpu or cuda)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    n_layers = len(decoder_layers(model))
    layers = list(range(n_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    out = Path(args.out or Path(args.model) / RELEASE.format(w=args.d_sae // 1024, k=args.k))
    data = Path(args.data)
    t0 = time.time()
    train_wins = windows(data / "train.bin", args.train_tokens, args.seq, args.seed)
    val_wins = windows(data / "val.bin", args.val_tokens, args.seq, args.seed + 1)
    acts = collect(model, train_wins, layers, args.batch_seqs)
    val_acts = collect(model, val_wins, layers, args.batch_seqs)
    print(f"collected {acts[layers[0]].shape[0]} train / {val_acts[layers[0]].shape[0]} val tokens per layer "
          f"in {time.time() - t0:.0f} s", flush=True)
    clean = spliced_loss(model, val_wins, None, None, args.batch_seqs)
    dtype = getattr(torch, args.dtype)
    saes, metrics, histories = {}, {}, {}
    for n in layers:
        config = SAETrainingConfig(d_sae=args.d_sae, k=args.k, n_tokens=args.n_tokens, batch_size=args.batch_size,
                                   lr=args.lr, seed=args.seed + n)
        t1 = time.time()
        result = train_sae(acts[n].to(args.device), config, desc=f"layer {n}", progress=args.device == "cpu")
        # Report the weights as shipped (cast to the stored dtype and back).
        sae = TopKSAE.from_release_state({k: v.to(dtype).float() for k, v in result.sae.release_state().items()},
                                         k=args.k)
        m = evaluate_sae(sae.to(args.device), val_acts[n])
        m["train_fve"] = result.final["fve"]
        m["spliced_loss"] = spliced_loss(model, val_wins, n, sae, args.batch_seqs)
        m["clean_loss"] = clean
        m["train_seconds"] = round(time.time() - t1, 1)
        saes[n], metrics[n], histories[n] = sae.cpu(), m, result.history
        print(f"layer {n}: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in m.items()), flush=True)
    info = {"config": vars(args), "layer_types": list(model.config.layer_types), "metrics": metrics,
            "history": histories, "recipe": "scripts/nano/train_saes.py"}
    out.mkdir(parents=True, exist_ok=True)
    # Several processes may each train some layers into one release: merge training.json under a lock.
    with open(out / ".training.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        previous = out / "training.json"
        if previous.exists():
            old = json.loads(previous.read_text())
            for key in ("metrics", "history"):
                info[key] = {**{int(k): v for k, v in old[key].items()}, **info[key]}
            info["config"]["layers"] = ",".join(str(n) for n in sorted(info["metrics"]))
        save_release(saes, out, formats=("pt",), dtype=dtype, info=info)
    (out / ".training.lock").unlink(missing_ok=True)
    print(f"wrote {out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
