"""A fake Hugging Face hub cache holding a tiny random model and its SAE file under the real Qwen repo ids.

Code that only runs "when the real weights are cached" (the notebooks' last cells, the README's real-model blocks)
runs against it offline: the model is a Qwen3.5 with the real residual width (the SAE files must match the release
catalogue's d_model and d_sae) but two heads, a 32-wide MLP and a byte vocabulary, so it loads and runs in about
a second.

    snapshot = write_fake_model(cache, "Qwen/Qwen3.5-2B-Base", n_layers=24, d_model=2048)
    write_fake_sae(cache, "Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_50", layer=12, d_model=2048, d_sae=32768)
"""
from __future__ import annotations

from pathlib import Path

import torch

from saes import get_release
from tests.factories import tiny_tokenizer

COMMIT = "fa4e0b5c0ffee0123456789abcdef0123456789a"


def snapshot_dir(cache_dir: str | Path, repo_id: str, commit: str = COMMIT) -> Path:
    """``cache_dir/models--Org--Name/snapshots/<commit>`` with ``refs/main`` naming the commit, created."""
    repo = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def write_fake_model(cache_dir: str | Path, repo_id: str, *, n_layers: int, d_model: int, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 (hybrid GDN + attention) with ``n_layers`` and hidden size ``d_model``, with a
    byte-level tokenizer, saved as the snapshot of ``repo_id``; returns the snapshot directory."""
    import transformers as tf

    config = tf.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=d_model, intermediate_size=32, num_hidden_layers=n_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, tie_word_embeddings=True,
        layer_types=["linear_attention" if (n + 1) % 4 else "full_attention" for n in range(n_layers)])
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForCausalLM(config).eval()
    snapshot = snapshot_dir(cache_dir, repo_id)
    model.save_pretrained(snapshot)
    tok = tiny_tokenizer()
    tok.save_pretrained(snapshot)
    return snapshot


def write_fake_sae(cache_dir: str | Path, repo_id: str, *, layer: int, d_model: int, d_sae: int,
                   seed: int = 0) -> Path:
    """``layer{layer}.sae.pt`` in the release layout (fp32 ``W_enc [d_sae, d_model]``, ``W_dec [d_model, d_sae]``,
    ``b_enc``, ``b_dec``) in the snapshot of ``repo_id``; returns the file."""
    path = snapshot_dir(cache_dir, repo_id) / f"layer{layer}.sae.pt"
    # Release-sized (half a GB at the 2B's widths), so built in place: unit decoder columns, the encoder their
    # transpose (tests.factories.random_sae_state adds encoder noise, which costs seconds at this size).
    g = torch.Generator().manual_seed(seed)
    w_dec = torch.empty(d_model, d_sae).normal_(generator=g)
    w_dec.div_(w_dec.norm(dim=0, keepdim=True))
    state = {"W_enc": w_dec.T.contiguous(), "W_dec": w_dec,
             "b_enc": 0.05 * torch.randn(d_sae, generator=g), "b_dec": 0.05 * torch.randn(d_model, generator=g)}
    torch.save(state, path)
    return path


def write_fake_release(cache_dir: str | Path, release_id: str, layers: tuple[int, ...]) -> None:
    """The model of ``release_id`` and its SAE files at ``layers``, shaped as the release catalogue says."""
    rel = get_release(release_id)
    write_fake_model(cache_dir, rel.model_id, n_layers=rel.n_layers, d_model=rel.d_model)
    for layer in layers:
        write_fake_sae(cache_dir, rel.repo_id, layer=layer, d_model=rel.d_model, d_sae=rel.d_sae, seed=layer)
