"""Options shared by the ``features`` and ``steer`` commands: which model, which SAE release, where to run."""
from __future__ import annotations

import argparse

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def add_scope_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model hub id or local directory (tokenizer loaded from it); default: the bundled nano model")
    p.add_argument("--release", default=None,
                   help="SAE release id (qwen-scope-3.5-2b-base-w32k-l50), hub repo or local release directory; "
                        "default: the nano model's own SAE set (only without --model)")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="model dtype (default bf16 on cuda)")
    p.add_argument("--template", default=None, choices=("chat", "chat-think", "chat-nothink"),
                   help="wrap the text as a user turn with the chat template")


def parse_layers(text: str) -> list[int]:
    """``"12"``, ``"10,12"`` or ``"10-13"`` -> list of layers."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(part)])
        except ValueError:
            raise SystemExit(f"bad layer list {text!r}: expected e.g. '12', '10,12' or '10-13'") from None
    if not out:
        raise SystemExit(f"bad layer list {text!r}: no layers")
    return out


def build_scope(args: argparse.Namespace, layers: list[int]):
    import torch

    from qwen_scope.scope import Scope

    from qwen_scope.nano import NANO_DIR, NANO_RELEASE_DIR

    if args.model is not None and args.release is None:
        raise SystemExit(f"--model {args.model} needs --release (an SAE release trained for it); "
                         "`qwen-scope releases` lists the Qwen-Scope sets")
    model = NANO_DIR if args.model is None else args.model
    release = NANO_RELEASE_DIR if args.release is None else args.release
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    return Scope.from_pretrained(model, release, layers, device=args.device, dtype=dtype)
