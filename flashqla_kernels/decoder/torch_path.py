"""The GDN layer's glue in token-major torch: the formulation the Hopper glue kernels implement, and the fallback.

Every stage works on the projections' own layout, [B, T, C] (token-major), so nothing is transposed to
channels-first and no whole tensor makes an fp32 round trip through memory beyond what one fused kernel would do:

    conv:   y[b, t, c] = silu(sum_j w[c, j] x[b, t - (Kc-1) + j, c] + bias[c])      (x before t: the conv state)
    split:  q, k = y[..., :Hk*K], y[..., Hk*K:2*Hk*K] -> [B, T, Hk, K], l2-normalised (eps 1e-6, fp32 math)
            v    = y[..., 2*Hk*K:]                    -> [B, T, Hv, V]
    gates:  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)               (fp32, [B, T, Hv])
    norm:   out = o * rsqrt(mean(o^2) + eps) * weight * silu(z)                      (fp32 math, o's dtype out)
    mlp:    out = silu(gate) * up                  (the MLP's gated activation; fp32 math, gate's dtype out)
    head:   loss_i = logsumexp(x_i) - x_i[t_i], x_i <- softmax(x_i) - onehot(t_i)   (the LM loss; fp32 math, in place)
    attn:   q, k = rope(rms_norm(q_proj(x)[..., :D])), rope(rms_norm(k_proj(x)))  -> [B, H, T, D] (the gated
            full-attention layers: transformers' own operations); out = attn * sigmoid(q_proj(x)[..., D:])

Compute: fp32 (fp64 for fp64 inputs); outputs in the input dtype except the gates (fp32, as the op wants them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_silu", "conv_split_l2norm_gates", "gdn_gates", "gated_rms_norm", "l2norm_fp32",
           "rms_norm_zero_centred", "silu_mul", "qk_norm_rope", "gate_mul",
           "gate_mul_head_major", "cross_entropy_", "scale_"]


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU on the token-major layout.

    Args:
        x: [B, T, C]. weight: [C, Kc] (``conv1d.weight.squeeze(1)``). bias: [C] or None.
        prefix: [B, Kc-1, C] the tokens before x (from the conv state), or None for zeros (a fresh sequence).

    Returns:
        [B, T, C] in x's dtype.
    """
    B, T, C = x.shape
    Kc = weight.shape[-1]
    dt = _math_dtype(x)
    if prefix is None:
        xp = F.pad(x, (0, 0, Kc - 1, 0))
    else:
        xp = torch.cat([prefix.to(x.dtype), x], dim=1)
    w = weight.to(dt)
    acc = xp[:, 0:T].to(dt) * w[:, 0]
    for j in range(1, Kc):
        acc = acc + xp[:, j:j + T].to(dt) * w[:, j]
    if bias is not None:
        acc = acc + bias.to(dt)
    return F.silu(acc).to(x.dtype)


def l2norm_fp32(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in fp32 (fp64 for fp64), returned in x's dtype (as FLA and transformers)."""
    xf = x.to(_math_dtype(x))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay and write gates from the raw projections.

    Args:
        a, b: [B, T, Hv] outputs of ``in_proj_a`` / ``in_proj_b``. A_log, dt_bias: [Hv].

    Returns:
        (g [B, T, Hv] = -exp(A_log) * softplus(a + dt_bias), beta [B, T, Hv] = sigmoid(b)), both fp32 (fp64 for fp64).
    """
    dt = _math_dtype(a)
    g = -A_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt))
    return g, torch.sigmoid(b.to(dt))


def conv_split_l2norm_gates(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                            Hk: int, K: int, Hv: int, V: int, prefix: torch.Tensor | None = None):
    """Everything between the input projections and the chunk op, token-major.

    Args:
        qkv: [B, T, C] with C = 2*Hk*K + Hv*V in the order [q | k | v] (``in_proj_qkv``'s output).
        weight: [C, Kc] conv weight; bias: [C] or None. a, b: [B, T, Hv]; A_log, dt_bias: [Hv].
        Hk, K, Hv, V: head counts and dims. prefix: [B, Kc-1, C] tokens before qkv (conv state) or None.

    Returns:
        (q [B, T, Hk, K] l2-normalised, k [B, T, Hk, K] l2-normalised, v [B, T, Hv, V] (qkv's dtype),
        g [B, T, Hv] fp32, beta [B, T, Hv] fp32).
    """
    B, T, C = qkv.shape
    if C != 2 * Hk * K + Hv * V:
        raise ValueError(f"qkv has {C} channels; expected 2*Hk*K + Hv*V = {2 * Hk * K + Hv * V} "
                         f"for Hk={Hk}, K={K}, Hv={Hv}, V={V}")
    y = causal_conv1d_silu(qkv, weight, bias, prefix)
    q, k, v = torch.split(y, [Hk * K, Hk * K, Hv * V], dim=-1)
    q = l2norm_fp32(q.reshape(B, T, Hk, K))
    k = l2norm_fp32(k.reshape(B, T, Hk, K))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return q, k, v.reshape(B, T, Hv, V), g, beta


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3*RMSNormGated`` with fp32 math end to end: ``o * rsqrt(mean(o^2) + eps) * w * silu(z)``.

    Args:
        o: [..., V] (the chunk op's output). z: same shape as o, or any shape with the same number of elements
        (e.g. [B, T, Hv*V]). weight: [V]. eps: the model's ``rms_norm_eps``.

    Returns:
        o's shape and dtype.
    """
    dt = _math_dtype(o)
    of = o.to(dt)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (of * weight.to(dt) * F.silu(z.reshape(o.shape).to(dt))).to(o.dtype)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Qwen's zero-centred RMSNorm (``Qwen3_5RMSNorm``, ``Qwen3NextRMSNorm``): ``x * rsqrt(mean(x^2) + eps) * (1 + w)``
    in fp32 (fp64 for fp64), the same operations as transformers'.

    Args:
        x: [..., D]. weight: [D] (init zeros). eps: float. out_dtype: the result's dtype (None: x's, as
            transformers'); the result in x's dtype is cast to it.

    Returns:
        x's shape, in ``out_dtype``.
    """
    dt = _math_dtype(x)
    xf = x.to(dt)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * (1.0 + weight.to(dt))).to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's gated activation ``silu(gate) * up`` in fp32 (fp64 for fp64), rounded once to gate's dtype; for fp32
    inputs the same operations as transformers' ``act_fn(gate_proj(x)) * up_proj(x)``.

    Args:
        gate: [..., D] (``gate_proj``'s output). up: same shape.

    Returns:
        gate's shape and dtype.
    """
    dt = _math_dtype(gate)
    return (F.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype)


def qk_norm_rope(qg: torch.Tensor, kx: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated attention layers' q/k preparation with transformers' operations: the zero-centred RMSNorm of each
    head row (rounded to the input dtype), then the rotary embedding on the first R = cos.shape[-1] channels.

    Args:
        qg: [B, L, H, 2 D] (``q_proj``'s output per head: query, gate). kx: [B, L, Hkv, D]. wq, wk: [D]. eps: float.
        cos, sin: [B or 1, L, R].

    Returns:
        q [B, H, L, D] and k [B, Hkv, L, D], contiguous, in qg's dtype.
    """
    D = qg.shape[-1] // 2
    q = rms_norm_zero_centred(qg[..., :D], wq, eps).transpose(1, 2)
    k = rms_norm_zero_centred(kx, wk, eps).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    R = cos.shape[-1]

    def rope(x):
        xr, xp = x[..., :R], x[..., R:]
        rotated = torch.cat((-xr[..., R // 2:], xr[..., :R // 2]), dim=-1)
        return torch.cat(((xr * cos) + (rotated * sin), xp), dim=-1)

    return rope(q).contiguous(), rope(k).contiguous()


def gate_mul(attn: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
    """The gated attention output, ``attn * sigmoid(gate)`` as transformers computes it.

    Args:
        attn: [..., H * D] (the attention output, token-major). qg: [..., H, 2 D], the same tokens.

    Returns:
        attn's shape and dtype.
    """
    D = qg.shape[-1] // 2
    return attn * torch.sigmoid(qg[..., D:].reshape(attn.shape))


def gate_mul_head_major(attn: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
    """``gate_mul`` on SDPA's head-major output, as transformers computes it: its transpose to token-major
    (``sdpa_attention_forward``), then ``attn * sigmoid(gate)``.

    Args:
        attn: [B, H, L, D]. qg: [B, L, H, 2 D], the same tokens.

    Returns:
        [B, L, H * D] in attn's dtype.
    """
    B, H, L, D = attn.shape
    return gate_mul(attn.transpose(1, 2).contiguous().reshape(B, L, H * D), qg)


def cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, block_rows: int = 1024) -> torch.Tensor:
    """Each row's cross entropy ``logsumexp(x_i) - x_i[t_i]`` (fp32; fp64 for fp64 logits), with ``logits``
    overwritten by ``softmax - onehot`` rounded to its dtype, ``block_rows`` rows at a time (the fp32 softmax of one
    block is the memory it takes: ``block_rows * V * 4`` bytes).

    Args:
        logits: [N, V]. targets: [N] int64 in [0, V).

    Returns:
        [N] in the math dtype.
    """
    dt = _math_dtype(logits)
    loss = torch.empty(logits.shape[0], dtype=dt, device=logits.device)
    for start in range(0, logits.shape[0], block_rows):
        block = logits[start:start + block_rows]
        tgt = targets[start:start + block_rows, None]
        p = torch.softmax(block, dim=1, dtype=dt)  # one kernel: the logits read, the math dtype written
        # logsumexp = x_j - log p_j at the row's largest p_j (>= 1 / V: its log is exact in the math dtype)
        p_max, j = p.max(dim=1, keepdim=True)
        lse = block.gather(1, j).to(dt) - p_max.log()
        loss[start:start + block.shape[0]] = (lse - block.gather(1, tgt).to(dt)).squeeze(1)
        p.scatter_add_(1, tgt, torch.full(tgt.shape, -1.0, dtype=dt, device=p.device))
        block.copy_(p)
    return loss


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x *= s`` in place (``s`` a 1-element tensor on x's device); returns x."""
    return x.mul_(s.reshape(()))
