"""Options shared by the ``features`` and ``steer`` commands: which model, which SAE release, where to run."""
from __future__ import annotations

import argparse
import re

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
_PART = re.compile(r"^(?:layer)?(\d+)(?:\s*-\s*(?:layer)?(\d+))?$", re.IGNORECASE)


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


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of tokens, steps or candidates)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_layers(text: str) -> tuple[tuple[int, int], ...]:
    """``"12"``, ``"10,12"``, ``"10-13"`` or sae-lens ids ``"layer12"`` -> inclusive ``(lo, hi)`` ranges.

    Only the syntax is checked here, before any work; ``expand_layers`` bounds them by the model's depth (a range is
    never expanded before that, so ``0-100000000`` costs nothing to refuse).
    """
    out: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _PART.match(part)
        if m is None:
            raise SystemExit(f"bad --layers {text!r}: {part!r} is not a layer; expected e.g. '12', '10,12', '10-13' "
                             f"or 'layer12'")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise SystemExit(f"bad --layers {text!r}: range {part!r} runs backwards; write it low-high")
        out.append((lo, hi))
    if not out:
        raise SystemExit(f"bad --layers {text!r}: no layers")
    return tuple(out)


def expand_layers(ranges: tuple[tuple[int, int], ...], n_layers: int, text: str, model: str) -> list[int]:
    """The layers of ``ranges``, each checked against the model's ``n_layers`` before any list is built."""
    for lo, hi in ranges:
        if hi >= n_layers:
            raise SystemExit(f"--layers {text}: layer {hi} is out of range; {model} has decoder blocks "
                             f"0..{n_layers - 1}")
    return sorted({n for lo, hi in ranges for n in range(lo, hi + 1)})


def model_and_release(args: argparse.Namespace) -> tuple[str, str]:
    """The model and SAE release the command runs on (the nano pair when neither is given)."""
    from qwen_scope.nano import NANO_DIR, NANO_RELEASE_DIR

    if args.model is not None and args.release is None:
        raise SystemExit(f"--model {args.model} needs --release (an SAE release trained for it); "
                         "`qwen-scope releases` lists the Qwen-Scope sets")
    model = str(NANO_DIR) if args.model is None else args.model
    release = str(NANO_RELEASE_DIR) if args.release is None else args.release
    return model, release


def model_layers(args: argparse.Namespace, ranges: tuple[tuple[int, int], ...]) -> list[int]:
    """``--layers`` checked against the model's depth, read from its config (no weights loaded)."""
    from qwen_scope.sources import model_config

    model, _ = model_and_release(args)
    n_layers = int(model_config(model).get_text_config().num_hidden_layers)
    return expand_layers(ranges, n_layers, args.layers, args.model or "the nano model")


def build_scope(args: argparse.Namespace, layers: list[int]):
    import torch

    from qwen_scope.scope import Scope

    model, release = model_and_release(args)
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    return Scope.from_pretrained(model, release, layers, device=args.device, dtype=dtype)
