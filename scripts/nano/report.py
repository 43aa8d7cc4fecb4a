"""Format the nano model's measured results as markdown (the tables of qwen_scope/data/nano/RESULTS.md).

Reads the training run (``log.jsonl``, ``state.json``), the corpus recipe, the SAE set's ``training.json`` and the
analysis (``analysis.json``); prints markdown. Hand-written interpretation is added around it in RESULTS.md.

Usage: python scripts/nano/report.py --run .nano/run --corpus .nano/corpus --analysis .nano/analysis > /tmp/tables.md
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def curve_table(log: list[dict], n_rows: int = 12) -> str:
    evals = [e for e in log if "val_loss" in e]
    step = max(1, math.ceil(len(evals) / n_rows))
    rows = evals[::step] + ([evals[-1]] if (len(evals) - 1) % step else [])
    lines = ["| step | train loss | val loss (nats/byte) | val bits/byte | lr | elapsed s |", "|---|---|---|---|---|---|"]
    for e in rows:
        lines.append(f"| {e['step']} | {e['loss']:.3f} | {e['val_loss']:.3f} | {e['val_loss'] / math.log(2):.3f} | "
                     f"{e['lr']:.2e} | {e['elapsed_s']:.0f} |")
    return "\n".join(lines)


def sae_table(info: dict) -> str:
    lines = ["| layer | type | FVE (val) | L0 | dead (val) | loss clean | loss with SAE spliced | delta |",
             "|---|---|---|---|---|---|---|---|"]
    for n, m in sorted(info["metrics"].items(), key=lambda kv: int(kv[0])):
        kind = info["layer_types"][int(n)].replace("_attention", "")
        lines.append(f"| {n} | {kind} | {m['fve']:.3f} | {m['l0']:.1f} | {m['dead_fraction']:.3f} | "
                     f"{m['clean_loss']:.3f} | {m['spliced_loss']:.3f} | {m['spliced_loss'] - m['clean_loss']:+.3f} |")
    return "\n".join(lines)


def feature_lists(analysis: dict, per_layer: int) -> str:
    out = []
    for n, feats in sorted(analysis["layers"].items(), key=lambda kv: int(kv[0])):
        out.append(f"\n**Layer {n}**\n")
        for f in feats[:per_layer]:
            ex = " · ".join(f"`{e!r}`"[:90] for e in f["examples"][:3])
            out.append(f"- #{f['feature']} (fires on {100 * f['freq']:.2f}% of tokens, max {f['max']:.2f}); "
                       f"logit lens up: {' '.join(f['logit_lens_up'][:5])}; top examples: {ex}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=".nano/run")
    p.add_argument("--corpus", default=".nano/corpus")
    p.add_argument("--release", default=str(REPO / "qwen_scope/data/nano/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16"))
    p.add_argument("--analysis", default=".nano/analysis")
    p.add_argument("--per-layer", type=int, default=4)
    args = p.parse_args(argv)
    run, corpus = Path(args.run), Path(args.corpus)
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    state = json.loads((run / "state.json").read_text())
    recipe = json.loads((corpus / "recipe.json").read_text())
    info = json.loads((Path(args.release) / "training.json").read_text())
    analysis = json.loads((Path(args.analysis) / "analysis.json").read_text())
    uni, final = state["unigram_val_loss"], state["final_val_loss"]
    print("## Corpus\n")
    print(f"- CPython {recipe['python']} standard library; licence {recipe['licence']}.")
    print(f"- {recipe['n_docs']['train']} train / {recipe['n_docs']['val']} validation documents; "
          f"{recipe['n_tokens']['train']:,} / {recipe['n_tokens']['val']:,} byte tokens.")
    print(f"- bytes by source: " + ", ".join(f"{k} {v:,}" for k, v in recipe["by_source"].items()))
    print(f"- sha256 train {recipe['sha256']['train'][:16]}…, val {recipe['sha256']['val'][:16]}…\n")
    print("## Model training\n")
    a = state["args"]
    print(f"- {state['n_params']:,} parameters; device {state['device']}, torch {state['torch']}; {state['step']} steps "
          f"of {a['batch']}x{a['seq']} bytes ({state['step'] * a['batch'] * a['seq'] / 1e6:.0f}M tokens), "
          f"AdamW lr {a['lr']} (warmup {a['warmup']}, cosine to 10%), {state['elapsed_s']:.0f} s.")
    print(f"- held-out loss **{final:.3f} nats/byte ({final / math.log(2):.3f} bits/byte)** vs unigram baseline "
          f"{uni:.3f} nats/byte ({uni / math.log(2):.3f} bits/byte).\n")
    print(curve_table(log) + "\n")
    print("## SAE set\n")
    c = info["config"]
    print(f"- d_sae {c['d_sae']}, k {c['k']}, {c['n_tokens']:,} training tokens per layer drawn from "
          f"{c['train_tokens']:,} distinct activation tokens; stored as {c['dtype']}; metrics on "
          f"{c['val_tokens']:,} validation tokens (position 0 of each window excluded).\n")
    print(sae_table(info) + "\n")
    print("## Greedy completions\n")
    for prompt, text in analysis["completions"].items():
        print(f"- `{prompt!r}` → `{text!r}`")
    print("\n## Features (automatic list: frequency 0.1%-5%, most peaked first)\n")
    print(feature_lists(analysis, args.per_layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
