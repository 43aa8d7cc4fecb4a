"""Shared factories for tests: tiny random Qwen models of every family and SAE files in the release layout.

Every model here is a few hundred KB and runs a forward in milliseconds on CPU. Import as
``from tests.factories import tiny_model, write_sae_release``.
"""
from __future__ import annotations

from pathlib import Path

import torch

import hooks

# The families a tiny model is built for (all but the Qwen3.5-MoE VL wrapper) ...
FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl")
# ... and those of them with Gated DeltaNet layers, as the adapters declare them.
HYBRID_FAMILIES = tuple(f for f in FAMILIES if f in hooks.HYBRID_FAMILIES)

D_MODEL = 64
VOCAB = 256
N_LAYERS = 4

_COMMON = dict(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=128, num_hidden_layers=N_LAYERS,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_config(family: str):
    """The transformers config of a tiny random model of ``family`` (one of ``FAMILIES``)."""
    import transformers as tf

    if family == "qwen3":
        return tf.Qwen3Config(**_COMMON)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, **_MOE)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**_COMMON, **_GDN, **_MOE, shared_expert_intermediate_size=32)
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**_COMMON, **_GDN)
    text = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**text, **_GDN, **_MOE, shared_expert_intermediate_size=32)
    if family == "qwen3_5_vl":
        return tf.Qwen3_5Config(
            text_config=dict(_COMMON, **_GDN),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=D_MODEL))
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def tiny_model(family: str = "qwen3_5", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random model of ``family`` in eval mode (causal LM; the VL wrapper for ``qwen3_5_vl``)."""
    import transformers as tf

    config = tiny_config(family)
    classes = {
        "qwen3": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3_5": tf.Qwen3_5ForCausalLM, "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
        "qwen3_5_vl": tf.Qwen3_5ForConditionalGeneration,
    }
    torch.manual_seed(seed)
    model = classes[family](config).to(dtype).eval()
    # Qwen's zero-centred RMSNorm weights start at zero; give norms some spread so tests see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.normal_(0.0, 0.1)
    return model


def random_sae_state(d_model: int = D_MODEL, d_sae: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random SAE weight dict in the exact Qwen-Scope release layout (fp32, release orientation)."""
    g = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(d_model, d_sae, generator=g)
    w_dec = w_dec / w_dec.norm(dim=0, keepdim=True)
    return {
        "W_enc": (w_dec.T.clone() + 0.1 * torch.randn(d_sae, d_model, generator=g)).contiguous(),
        "W_dec": w_dec.contiguous(),
        "b_enc": 0.05 * torch.randn(d_sae, generator=g),
        "b_dec": 0.05 * torch.randn(d_model, generator=g),
    }


def write_sae_release(root: Path, repo_name: str = "SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8", n_layers: int = N_LAYERS,
                      d_model: int = D_MODEL, d_sae: int = 256, seed: int = 0) -> Path:
    """Write ``layer{n}.sae.pt`` files (torch-pickled dicts of fp32 tensors) into ``root/repo_name``; return the dir."""
    out = Path(root) / repo_name
    out.mkdir(parents=True, exist_ok=True)
    for n in range(n_layers):
        torch.save(random_sae_state(d_model, d_sae, seed + n), out / f"layer{n}.sae.pt")
    return out


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def tiny_tokenizer():
    """A byte-level fast tokenizer matching ``VOCAB``: token id = byte value, with ``<|endoftext|>`` (EOS/pad) at 0.

    Offline, deterministic, ``save_pretrained``-able, so a tiny model directory can carry it for CLI tests.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items() if b != 0}
    vocab["<|endoftext|>"] = 0
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def write_hub_cache_release(cache_dir: Path, repo_id: str = "Qwen/SAE-Res-Qwen3.5-Nano-Base-W0K-L0_8",
                            n_layers: int = N_LAYERS, d_model: int = D_MODEL, d_sae: int = 256, seed: int = 0,
                            commit: str = "0123456789abcdef0123456789abcdef01234567", layers=None) -> Path:
    """Write SAE files into a Hugging Face hub cache layout (``models--org--name/{blobs,refs/main,snapshots/<commit>}``,
    snapshot entries symlinked to blobs as huggingface_hub does); return the snapshot directory.

    ``layers`` (default ``range(n_layers)``) picks which ``layer{n}.sae.pt`` files exist; layer n uses ``seed + n``."""
    import hashlib

    repo = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    for d in (snapshot, blobs, repo / "refs"):
        d.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for n in (range(n_layers) if layers is None else layers):
        tmp = blobs / f"tmp-layer{n}"
        torch.save(random_sae_state(d_model, d_sae, seed + n), tmp)
        blob = blobs / hashlib.sha256(tmp.read_bytes()).hexdigest()
        tmp.replace(blob)
        (snapshot / f"layer{n}.sae.pt").symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot
