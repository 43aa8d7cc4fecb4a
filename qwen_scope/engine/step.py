"""The decode step: one token for every row of the batch, a pure function of the engine's static buffers.

It reads the token each row feeds next and its position (device tensors), runs every decoder layer's decode form
(``layers.py``), applies the steering edits and records the SAE readout where asked, samples, and writes the
result into the state in place. No host reads, no data-dependent branches, no shape that changes from one token to
the next: on CUDA the engine captures one call as a graph and replays it per token; on CPU the same call runs
eagerly. The first call must run eagerly in any case (it is the graph's warm-up and the first real step).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from flashqla_kernels.decoder import ops as fused
from flashqla_kernels.patching.norms import is_zero_centred_norm, norm_eps
from hooks import QwenAdapter
from qwen_scope.engine.layers import attention_decode, gdn_decode, mlp_decode, norm
from qwen_scope.engine.sampling import SamplingBuffers, choose_tokens, record_step
from qwen_scope.engine.state import DecodeState
from qwen_scope.engine.steer_buffers import LayerSteerBuffers
from saes import TopKSAE

__all__ = ["DecodeStep", "unsupported_reason"]


def unsupported_reason(adapter: QwenAdapter) -> str | None:
    """Why the engine cannot decode this model, or None when every layer has a decode form here."""
    from qwen_scope.engine.layers import unsupported_mlp_reason

    if adapter.unembed is None:
        return f"{type(adapter.model).__name__} has no lm_head (a bare text model); load the causal LM"
    rotary = getattr(adapter.text_model, "rotary_emb", None)
    if rotary is None:
        return f"{type(adapter.text_model).__name__} has no rotary_emb module"
    if getattr(rotary, "rope_type", "default") not in ("default", "linear"):
        return f"rope_type {rotary.rope_type!r} rescales with the sequence length; the static step keeps one table"
    for n, kind in enumerate(adapter.layer_types):
        if kind not in ("full_attention", "linear_attention"):
            return f"layer {n} is {kind!r}; the engine decodes full attention and Gated DeltaNet layers only"
        mixer = adapter.mixer(n)
        if kind == "full_attention" and getattr(mixer, "sliding_window", None):
            return f"layer {n} uses sliding-window attention"
        reason = unsupported_mlp_reason(adapter.mlp(n))
        if reason:
            return f"layer {n}: {reason}"
    return None


class DecodeStep:
    """One decode step over a batch: ``step()`` advances every row by one token.

    Args:
        adapter: the model's adapter (its modules supply the weights).
        state: the batch's ``DecodeState``.
        steer: ``{layer: LayerSteerBuffers}`` edits applied to ``resid_post.<layer>``.
        readout: ``{layer: (sae, k)}``: SAE codes kept for every fed generated token.
        sampling: the sampling buffers, or None for greedy.
    """

    def __init__(self, adapter: QwenAdapter, state: DecodeState, steer: Mapping[int, LayerSteerBuffers],
                 readout: Mapping[int, tuple[TopKSAE, int]], sampling: SamplingBuffers | None):
        self.adapter, self.state = adapter, state
        self.steer, self.readout, self.sampling = dict(steer), dict(readout), sampling
        self.layers = list(adapter.layers)
        self.kinds = list(adapter.layer_types)
        self.rotary = adapter.text_model.rotary_emb
        # Qwen3.5's multimodal rotary reads position ids [3, B, T] (one row per section; text repeats them) and
        # transformers before 5.24 takes only that form, so give it that form on every version
        self.mrope = hasattr(self.rotary, "mrope_section")
        # a zero-centred post-attention norm also takes the residual add before it: one kernel (layers.norm's op)
        self.fused_post = [is_zero_centred_norm(layer.post_attention_layernorm) for layer in self.layers]

    @torch.no_grad()
    def __call__(self) -> None:
        st = self.state
        pos = st.decode_positions()  # [B]
        read_col = st.gen_index - 1  # [1], the generated token fed now
        x = self.adapter.embed(st.last_tokens[:, None])  # [B, 1, d_model]
        ids = pos[:, None]
        cos, sin = self.rotary(x, ids[None].expand(3, -1, -1) if self.mrope else ids)
        valid = (st.slots[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, S]
        for n, layer in enumerate(self.layers):
            x = self._layer(n, layer, x, cos, sin, pos, valid)
            if n in self.steer:
                x = self.steer[n].apply(x, pos[:, None])
            if n in self.readout:
                self._read(n, x, read_col)
        logits = self.adapter.unembed(norm(self.adapter.final_norm, x))[:, 0].float()  # [B, V]
        record_step(st, logits, choose_tokens(logits, self.sampling), st.gen_index)
        st.gen_index.add_(1)

    def _layer(self, n: int, layer, x, cos, sin, pos, valid):
        st = self.state
        pre, post = layer.input_layernorm, layer.post_attention_layernorm
        h = norm(pre, x)
        if self.kinds[n] == "linear_attention":
            h = gdn_decode(layer.linear_attn, h, st.conv[n], st.recurrent[n])
        else:
            h = attention_decode(layer.self_attn, h, cos, sin, st.k_cache[n], st.v_cache[n], pos, valid)
        if self.fused_post[n]:
            x, h = fused.add_rms_norm(x, h, post.weight, norm_eps(post))
        else:
            x = x + h
            h = post(x)
        return x + mlp_decode(layer.mlp, h)

    def _read(self, n: int, x: torch.Tensor, column: torch.Tensor) -> None:
        sae, k = self.readout[n]
        codes = sae.encode_sparse(x.float())
        self.state.readout_values[n].index_copy_(1, column, codes.values[..., :k].float())
        self.state.readout_indices[n].index_copy_(1, column, codes.indices[..., :k])
