"""Fine-tune a Qwen model with an SAE-feature penalty and show what moved on held-out text.

The LM loss plus ``FeaturePenalty`` at ``--layer`` on ``--feature`` (``qwen_scope.applications.finetune``): the
table gives the held-out LM loss and the feature's mean activation and firing rate before and after. Without
arguments it runs offline on the bundled nano model (CPU, about 10 s): layer 4's feature 229, which fires on the
indentation after a newline in Python code, trained on three quarters of the shipped corpus slice and measured on
the other quarter's documents.

Examples::

    python examples/feature_penalty_finetune.py
    python examples/feature_penalty_finetune.py --model Qwen/Qwen3.5-2B-Base \\
        --release qwen-scope-3.5-2b-base-w32k-l50 --layer 12 --feature 6159 --device cuda \\
        --steps 200 --lr 1e-5 --batch-size 8 --seq-len 512 --gradient-checkpointing --save runs/ft

On a GPU the weights stay fp32 (AdamW's master copy) and the forward runs under bf16 autocast unless ``--dtype`` /
``--precision`` say otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time

from qwen_scope.commands._scope_args import add_scope_arguments, build_scope, positive_int

NANO_LAYER, NANO_FEATURE = 4, 229


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", type=int, default=None, help=f"SAE layer to penalise (nano default {NANO_LAYER})")
    p.add_argument("--feature", type=int, action="append", default=None,
                   help=f"feature id to keep off; repeat for several (nano default {NANO_FEATURE})")
    p.add_argument("--corpus", default=None,
                   help="training text: a datasets hub id or local files (default: the nano corpus slice)")
    p.add_argument("--text-column", default="text", help="the corpus's text field")
    p.add_argument("--max-docs", type=positive_int, default=None, help="read at most this many documents")
    p.add_argument("--steps", type=positive_int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4, the nano model's)")
    p.add_argument("--weight", type=float, default=1.0, help="penalty weight against the LM loss (default 1)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="rows per micro-batch (default 8)")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per row (default 128)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="bf16 autocast or not (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute blocks in the backward")
    p.add_argument("--max-eval-rows", type=positive_int, default=None, help="held-out rows to measure (default all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    p.add_argument("--save", default=None, help="save the fine-tuned model and tokenizer to this directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_scope_arguments(p)
    args = p.parse_args(argv)
    if args.template is not None:
        p.error("--template does not apply here: the texts are trained on as they are")
    if args.model is not None and (args.layer is None or args.feature is None):
        p.error("--model needs --layer and --feature (a feature of that layer's SAE to penalise)")
    return args


def texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Training and held-out documents: every fourth document is held out."""
    if args.corpus is None:
        from qwen_scope import nano_corpus

        docs = nano_corpus(args.max_docs)
    else:
        import itertools

        from qwen_scope import load_corpus

        rows = itertools.islice(load_corpus(args.corpus, streaming=True), args.max_docs or 2000)
        docs = [r[args.text_column] for r in rows]
    return [d for i, d in enumerate(docs) if i % 4], docs[::4]


def main(argv: list[str] | None = None) -> int:
    from qwen_scope.applications.finetune import FinetuneConfig, finetune

    args = parse_args(argv)
    layer = NANO_LAYER if args.layer is None else args.layer
    features = [NANO_FEATURE] if args.feature is None else args.feature
    # fp32 weights for AdamW's updates; the speed comes from autocast (build_scope's default on cuda is bf16).
    args.dtype = args.dtype or "float32"
    on_cuda = str(args.device or "cpu").startswith("cuda")
    config = FinetuneConfig(steps=args.steps, lr=args.lr, weight=args.weight, batch_size=args.batch_size,
                            grad_accum=args.grad_accum, seq_len=args.seq_len,
                            precision=args.precision or ("bf16" if on_cuda else "fp32"),
                            gradient_checkpointing=args.gradient_checkpointing, seed=args.seed,
                            max_eval_rows=args.max_eval_rows)
    try:
        scope = build_scope(args, [layer])
        train, held = texts(args)
        start = time.perf_counter()
        result = finetune(scope, train, held, {layer: features}, config, progress=not args.no_progress)
    except (ValueError, KeyError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    print(f"{args.model or 'the nano model'}: {config.steps} steps of {config.batch_size * config.grad_accum} x "
          f"{config.seq_len} tokens, lr {config.lr}, weight {config.weight}, {config.precision}, "
          f"{time.perf_counter() - start:.1f} s; held-out {result.before.n_tokens} tokens")
    print(result.table())
    if args.save:
        scope.model.save_pretrained(args.save)
        scope.tokenizer.save_pretrained(args.save)
        print(f"saved the fine-tuned model to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
