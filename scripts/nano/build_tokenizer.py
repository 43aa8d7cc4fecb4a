"""Write the nano model's byte-level tokenizer (token id = UTF-8 byte value, plus ``<|endoftext|>`` = 256).

A GPT-2-style byte-level BPE with the 256 byte symbols as vocabulary and no merges, so ``AutoTokenizer`` loads it
from a local directory with no custom code. Deterministic; takes no input.

Usage: python scripts/nano/build_tokenizer.py --out qwen_scope/data/nano
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def build(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    assert tok.token_to_id(EOS) == 256, "the special token must come right after the 256 bytes"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
              "unk_token": None, "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "qwen_scope/data/nano"))
    args = parser.parse_args(argv)
    build(Path(args.out))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.out)
    text = "def f(x):\n    return x  # héllo ✓"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8")), ids
    assert tok.decode(ids) == text and tok.eos_token_id == 256
    print(f"wrote {args.out}: {type(tok).__name__}, vocab {len(tok)}, round trip ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
