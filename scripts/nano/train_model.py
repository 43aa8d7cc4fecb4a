"""Train the nano Qwen3.5 model (hybrid Gated DeltaNet + full attention, byte-level) on the stdlib corpus.

Deterministic (batches are a function of ``--seed`` and the step alone) and resumable: ``--out`` holds
``model.safetensors``, ``exp_avg.safetensors``, ``exp_avg_sq.safetensors`` (fp32), ``state.json`` and ``log.jsonl``; running again with the same ``--out``
continues from the last checkpoint. ``--time-budget S`` times the first steps and fixes the step count so the run
ends in about S seconds; the count is recorded in ``state.json`` (pass it as ``--steps`` to reproduce).

Usage:
    python scripts/nano/train_model.py --data .nano/corpus --out .nano/run --steps 2000       # any device
    python scripts/nano/train_model.py ... --export qwen_scope/data/nano                      # write shipped model
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
EOS = 256


def nano_config():
    """The nano model: Qwen3.5 text architecture, 6 blocks (GDN, GDN, full attention) x 2, d_model 128."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=272, hidden_size=128, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=None, eos_token_id=EOS,
        pad_token_id=EOS)


def load_tokens(data: Path, split: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(data / f"{split}.bin", dtype=np.uint16).astype(np.int64))


def get_batch(tokens: torch.Tensor, batch: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """``[batch, seq + 1]`` random windows; a pure function of (seed, step) so resumed runs see the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq: int, n_windows: int, device, autocast) -> float:
    """Mean next-byte loss (nats) over ``n_windows`` fixed, evenly spaced validation windows."""
    model.eval()
    starts = torch.linspace(0, val.numel() - seq - 2, n_windows).long().tolist()
    losses = []
    for chunk in range(0, n_windows, 16):
        ids = torch.stack([val[s:s + seq + 1] for s in starts[chunk:chunk + 16]]).to(device)
        with autocast():
            losses.append(float(lm_loss(model, ids)) * ids.shape[0])
    model.train()
    return sum(losses) / n_windows


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats) of validation bytes under the train split's add-one unigram distribution."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[val].mean())


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build(args, device):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(nano_config()).to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    return model, opt


def save_checkpoint(out: Path, model, opt, state: dict) -> None:
    """Weights and the two Adam moments as three fp32 safetensors files (each well under 16 MiB) + state.json."""
    from safetensors.torch import save_file

    files = {"model": {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}}
    params = [p for group in opt.param_groups for p in group["params"]]
    for moment in ("exp_avg", "exp_avg_sq"):
        files[moment] = {str(i): opt.state[p][moment] for i, p in enumerate(params) if p in opt.state}
    for name, tensors in files.items():
        save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()},
                  str(out / f"{name}.safetensors.tmp"))
    state = dict(state, adam_step=[float(opt.state[p]["step"]) for p in params] if opt.state else None)
    for name in files:
        (out / f"{name}.safetensors.tmp").replace(out / f"{name}.safetensors")
    (out / "state.json").write_text(json.dumps(state, indent=1))


def load_checkpoint(out: Path, model, opt, device) -> dict:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(out / "model.safetensors"), device=str(device)), strict=False)
    model.tie_weights()
    state = json.loads((out / "state.json").read_text())
    moments = {m: load_file(str(out / f"{m}.safetensors"), device=str(device)) for m in ("exp_avg", "exp_avg_sq")}
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        if state.get("adam_step"):
            opt.state[p] = {"step": torch.tensor(state["adam_step"][i]), "exp_avg": moments["exp_avg"][str(i)],
                            "exp_avg_sq": moments["exp_avg_sq"][str(i)]}
    return state


def train(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    use_bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else torch.autocast("cpu", enabled=False)

    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_ids, val_ids = load_tokens(data, "train"), load_tokens(data, "val")
    model, opt = build(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    state = {"step": 0, "steps": args.steps, "args": vars(args), "n_params": n_params,
             "unigram_val_loss": unigram_loss(train_ids, val_ids, 272), "device": str(device),
             "torch": torch.__version__, "elapsed_s": 0.0}
    if (out / "state.json").exists():
        state = load_checkpoint(out, model, opt, device)
        state["steps"] = args.steps or state["steps"]
        print(f"resumed at step {state['step']} of {state['steps']}")
    log = open(out / "log.jsonl", "a")
    t0, t_train = time.time(), time.time() - state["elapsed_s"]
    while state["steps"] is None or state["step"] < state["steps"]:
        step = state["step"]
        # Time steps [10, 10 + time_probe) only: the first ones include kernel compilation and autotuning.
        if state["steps"] is None and step == 10:
            t_probe = time.time()
        if state["steps"] is None and step == 10 + args.time_probe:
            per_step = (time.time() - t_probe) / args.time_probe
            left = args.time_budget - (time.time() - t0)
            state["steps"] = step + max(1, int(left / per_step))
            print(f"{per_step * 1e3:.1f} ms/step -> {state['steps']} steps in {args.time_budget:.0f} s", flush=True)
        total = state["steps"] or 10 ** 9
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        ids = get_batch(train_ids, args.batch, args.seq, args.seed, step).to(device, non_blocking=True)
        with autocast():
            loss = lm_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] = step + 1
        last = state["steps"] is not None and state["step"] >= state["steps"]
        if state["step"] % args.log_every == 0 or last:
            entry = {"step": state["step"], "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                     "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.time() - t_train, 1)}
            if state["step"] % args.eval_every == 0 or last:
                entry["val_loss"] = evaluate(model, val_ids, args.seq, args.eval_windows, device, autocast)
            log.write(json.dumps(entry) + "\n")
            log.flush()
            print(json.dumps(entry), flush=True)
        if state["step"] % args.ckpt_every == 0 or last:
            state["elapsed_s"] = time.time() - t_train
            save_checkpoint(out, model, opt, state)
    state["final_val_loss"] = evaluate(model, val_ids, args.seq, args.eval_windows, device, autocast)
    save_checkpoint(out, model, opt, state)
    print(json.dumps({k: state[k] for k in ("step", "n_params", "unigram_val_loss", "final_val_loss")}))
    return state


def export(run: Path, dest: Path) -> None:
    """Write the shipped model (bf16 safetensors, config that loads as fp32, generation config) into ``dest``."""
    from safetensors.torch import load_file
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    config = nano_config()
    model = Qwen3_5ForCausalLM(config)
    model.load_state_dict(load_file(str(run / "model.safetensors")), strict=False)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(dest)
    # Stored in bf16 (half the size); the config asks for fp32 so from_pretrained upcasts by default.
    cfg = json.loads((dest / "config.json").read_text())
    cfg["dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(eos_token_id=EOS, pad_token_id=EOS, do_sample=False, max_new_tokens=64).save_pretrained(dest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=".nano/corpus")
    p.add_argument("--out", default=".nano/run")
    p.add_argument("--steps", type=int, default=None, help="total steps (default: from --time-budget)")
    p.add_argument("--time-budget", type=float, default=150.0, help="seconds, used when --steps is not given")
    p.add_argument("--time-probe", type=int, default=30, help="steps timed to turn the budget into a step count")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--export", default=None, help="after training, write the shipped model into this directory")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 is many times faster than 2 on a busy 2-core machine)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train(args)
    if args.export:
        export(Path(args.out), Path(args.export))
    return 0


if __name__ == "__main__":
    sys.exit(main())
