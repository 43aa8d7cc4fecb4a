"""Inspect the nano model and its SAE set: greedy completions and, per layer, features with their top examples
and logit-lens tokens. Writes ``OUT/analysis.json`` and prints a readable report (the source of RESULTS.md's lists).

A feature's logit lens is ``lm_head(final_norm(W_dec[:, i]))``: the bytes its decoder direction promotes / demotes.
Top examples are the validation tokens where it fires hardest, shown with 24 bytes of context and the firing byte in
[brackets].

Usage: python scripts/nano/analyze.py --data .nano/corpus --out .nano/analysis
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_saes import collect, windows  # noqa: E402

from saes import load  # noqa: E402
from saes.training_data import decoder_layers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def __init__(self", "import os\nimport sys\n\n\ndef main(", "The return value is", "    Return the number of",
           "for i in range(", "Help on module json:\n\n"]


def show(byte_ids) -> str:
    return bytes(b for b in byte_ids if b < 256).decode("utf-8", errors="replace")


def byte_repr(i: int) -> str:
    return "<eos>" if i == 256 else repr(bytes([i]).decode("latin-1")) if i < 256 else f"<{i}>"


@torch.no_grad()
def completions(model, tokenizer, n_new: int) -> dict[str, str]:
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=n_new, do_sample=False)
        out[prompt] = tokenizer.decode(gen[0, ids.shape[1]:])
    return out


@torch.no_grad()
def logit_lens(model, direction: torch.Tensor, n: int) -> tuple[list[str], list[str]]:
    norm = model.model.norm
    logits = model.lm_head(norm(direction.float()[None]))[0, :257]
    return ([byte_repr(i) for i in logits.topk(n).indices.tolist()],
            [byte_repr(i) for i in (-logits).topk(n).indices.tolist()])


def feature_report(model, sae, acts, flat_ids, index, seq_pos, n_features, n_examples):
    """Features of ``sae`` firing on 0.1%-5% of ``acts [N, d_model]``; ``index[t]`` maps kept token t to its place in
    ``flat_ids`` (all window tokens, flattened) and ``seq_pos[t]`` is its position inside its window."""
    codes = sae.encode(acts)                                             # [N, d_sae]
    freq = (codes > 0).float().mean(0)
    # Interesting = fires on 0.1%-5% of tokens; ranked by how peaked its top activations are.
    candidates = ((freq > 1e-3) & (freq < 0.05)).nonzero().flatten()
    peak = codes[:, candidates].max(0).values
    order = candidates[peak.argsort(descending=True)][:n_features]
    report = []
    for f in order.tolist():
        top = codes[:, f].topk(n_examples).indices.tolist()
        examples = []
        for t in top:
            at = int(index[t])
            lo = at - min(seq_pos[t], 24)
            examples.append(show(flat_ids[lo:at].tolist()) + "[" + show([int(flat_ids[at])]) + "]"
                            + show(flat_ids[at + 1:at + 4].tolist()))
        up, down = logit_lens(model, sae.W_dec[:, f], 8)
        report.append({"feature": f, "freq": round(float(freq[f]), 5), "max": round(float(codes[:, f].max()), 3),
                       "examples": examples, "logit_lens_up": up, "logit_lens_down": down})
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "qwen_scope/data/nano"))
    p.add_argument("--release", default=str(REPO / "qwen_scope/data/nano/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16"))
    p.add_argument("--data", default=".nano/corpus")
    p.add_argument("--out", default=".nano/analysis")
    p.add_argument("--val-tokens", type=int, default=40_000)
    p.add_argument("--features", type=int, default=12)
    p.add_argument("--examples", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=60)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    result = {"completions": completions(model, tokenizer, args.new_tokens), "layers": {}}
    for prompt, text in result["completions"].items():
        print(f"--- {prompt!r} -> {text!r}")
    seq = 256
    wins = windows(Path(args.data) / "val.bin", args.val_tokens, seq, 1)
    layers = list(range(len(decoder_layers(model))))
    acts = collect(model, wins, layers, 16)
    # Activations skip position 0 of every window: map kept tokens back to the flattened windows.
    seq_pos = torch.arange(1, seq).repeat(wins.shape[0]).tolist()
    flat_ids = wins.reshape(-1)
    index = (torch.arange(wins.shape[0])[:, None] * seq + torch.arange(1, seq)).reshape(-1)
    for n in layers:
        sae = load(args.release, n, dtype=torch.float32)
        rep = feature_report(model, sae, acts[n], flat_ids, index, seq_pos, args.features, args.examples)
        result["layers"][n] = rep
        print(f"\n=== layer {n} ({model.config.layer_types[n]})")
        for r in rep:
            print(f"  #{r['feature']:4d} freq={r['freq']:.4f} max={r['max']:.2f}  up={' '.join(r['logit_lens_up'][:6])}")
            for e in r["examples"][:4]:
                print(f"        {e!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
