"""The GDN layer's glue stages with backend dispatch: TileLang kernels for CUDA sm_90 tensors, torch elsewhere.

``conv_qkv_gates`` (causal conv1d + SiLU + split + q/k l2norm + gates), ``gated_norm`` (gated RMSNorm),
``rms_norm`` (Qwen's zero-centred RMSNorm: the decoder / final / q-k norms around the layers; ``add_rms_norm`` the
decoder's mid-layer residual add with the norm after it), ``silu_mul`` (the
dense MLP's ``silu(gate) * up``; ``swiglu`` the same with the gate and up projections in one fused GEMM), and the gated full-attention layers' ``qk_norm_rope`` (q/k norms + partial rotary
embedding, into the attention kernels' layout) and ``gate_mul`` (``attn * sigmoid(gate)``) have one signature each across the torch formulation (``torch_path``) and the
kernels (``hopper``). ``backend=None`` picks the kernels when ``glue_kernel_reason`` (and the stage's shape check)
returns None, else torch; ``"torch"`` forces torch; ``"tilelang"`` forces the kernels or raises the reason.
Importing this module touches neither CUDA nor tilelang.
"""
from __future__ import annotations

import importlib

import torch

from flashqla_kernels.gdn_layer import torch_path

__all__ = ["conv_qkv_gates", "gated_norm", "rms_norm", "add_rms_norm", "silu_mul", "swiglu", "qk_norm_rope", "gate_mul", "gate_mul_head_major",
           "glue_kernel_reason",
           "KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_HOPPER = "flashqla_kernels.gdn_layer.hopper"


def glue_kernel_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why the glue kernels cannot run on these tensors, or None when they can.

    Args:
        tensors: the stage's activations (the first one's dtype decides; None entries are skipped).

    Returns:
        A sentence naming what is unsupported, or None.
    """
    xs = [x for x in tensors if x is not None]
    x = xs[0]
    if not all(t.is_cuda for t in xs):
        return f"tensors are on {x.device}; the glue kernels run on CUDA tensors (sm_90) only"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) != (9, 0):
        return f"the glue kernels need an sm_90 GPU; {torch.cuda.get_device_name(x.device)} is sm_{major}{minor}"
    if x.dtype not in KERNEL_DTYPES:
        return f"activation dtype {x.dtype} unsupported by the glue kernels (bfloat16/float16 only)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in xs):
        return "an input requires grad and the glue kernels are forward-only"
    return None


def _use_kernels(backend: str | None, stage: str, *tensors, shape_reason=None) -> bool:
    if backend not in (None, "torch", "tilelang"):
        raise ValueError(f"backend must be one of None, 'torch', 'tilelang'; got {backend!r}")
    if backend == "torch":
        return False
    reason = glue_kernel_reason(*tensors) or (shape_reason() if shape_reason is not None else None)
    if reason is not None and backend == "tilelang":
        raise ValueError(f"backend='tilelang' cannot run the {stage} kernel: {reason}. Pass backend=None to fall "
                         "back to the torch formulation automatically.")
    return reason is None


def conv_qkv_gates(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                   b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, Hk: int, K: int, Hv: int, V: int,
                   prefix: torch.Tensor | None = None, backend: str | None = None):
    """Causal conv1d + SiLU + split + q/k l2norm + gates, token-major. Args/Returns as
    ``torch_path.conv_split_l2norm_gates`` (q, k, v contiguous in qkv's dtype; g, beta fp32).

    Example:
        >>> q, k, v, g, beta = conv_qkv_gates(layer.in_proj_qkv(h), layer.conv1d.weight.squeeze(1), None,
        ...                                   layer.in_proj_a(h), layer.in_proj_b(h), layer.A_log, layer.dt_bias,
        ...                                   Hk=16, K=128, Hv=32, V=128)
    """
    hopper = importlib.import_module(_HOPPER)  # no tilelang import until a kernel runs
    if _use_kernels(backend, "conv_qkv_gates", qkv, a, b,
                    shape_reason=lambda: hopper.conv_shape_reason(Hk, K, Hv, V, weight.shape[-1])):
        return hopper.conv_qkv_gates_fwd(qkv, weight, bias, a, b, A_log, dt_bias, Hk=Hk, K=K, Hv=Hv, V=V,
                                         prefix=prefix)
    return torch_path.conv_split_l2norm_gates(qkv, weight, bias, a, b, A_log, dt_bias, Hk=Hk, K=K, Hv=Hv, V=V,
                                              prefix=prefix)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
               backend: str | None = None) -> torch.Tensor:
    """Gated RMSNorm ``o * rsqrt(mean(o^2) + eps) * weight * silu(z)`` with fp32 math.

    Args:
        o: [B, T, Hv, V]. z: [B, T, Hv*V] or [B, T, Hv, V]. weight: [V]. eps: float. backend: see module doc.

    Returns:
        [B, T, Hv, V] in o's dtype.
    """
    hopper = importlib.import_module(_HOPPER)
    if _use_kernels(backend, "gated_norm", o, z, shape_reason=lambda: None if o.shape[-1] in hopper.HEAD_DIMS
                    else f"head dim V={o.shape[-1]} unsupported (supported: {hopper.HEAD_DIMS})"):
        return hopper.gated_rms_norm_fwd(o, z, weight, eps)
    return torch_path.gated_rms_norm(o, z, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """Qwen's zero-centred RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` with fp32 math.

    Args:
        x: [..., D] (D a multiple of 64 for the kernel). weight: [D]. eps: float. backend: see module doc.

    Returns:
        x's shape and dtype.
    """
    if _use_kernels(backend, "rms_norm", x, shape_reason=lambda: None if x.shape[-1] % 64 == 0
                    else f"row width D={x.shape[-1]} is not a multiple of 64"):
        hopper = importlib.import_module(_HOPPER)
        return hopper.rms_norm_fwd(x, weight, eps)
    return torch_path.rms_norm_zero_centred(x, weight, eps)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's mid-layer step: the residual add ``s = a + b`` (in a's dtype, as ``a + b`` rounds it) and Qwen's
    zero-centred RMSNorm of s, in one pass on the kernel.

    Args:
        a, b: [..., D], same shape and dtype (the residual and the token mixer's output). weight: [D]. eps: float.
            backend: see module doc.

    Returns:
        (s, rms_norm(s)), each a's shape and dtype; s is a new tensor.

    Example:
        >>> s, h = add_rms_norm(residual, attn_out, layer.post_attention_layernorm.weight, 1e-6)
    """
    if _use_kernels(backend, "add_rms_norm", a, b, shape_reason=lambda: None if a.shape[-1] % 64 == 0
                    and b.shape == a.shape and b.dtype == a.dtype
                    else f"rows {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}: the kernel adds "
                         "same-shape, same-dtype rows of a multiple of 64 channels"):
        hopper = importlib.import_module(_HOPPER)
        return hopper.add_rms_norm_fwd(a, b, weight, eps)
    s = a + b
    return s, torch_path.rms_norm_zero_centred(s, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The dense MLP's gated activation ``silu(gate) * up`` with fp32 math, rounded once.

    Args:
        gate: [..., D] (D a multiple of 64 for the kernel). up: same shape and dtype. backend: see module doc.

    Returns:
        gate's shape and dtype.

    Example:
        >>> out = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    """
    if _use_kernels(backend, "silu_mul", gate, up, shape_reason=lambda: None if gate.shape[-1] % 64 == 0
                    else f"row width D={gate.shape[-1]} is not a multiple of 64"):
        hopper = importlib.import_module(_HOPPER)
        return hopper.silu_mul_fwd(gate, up)
    return torch_path.silu_mul(gate, up)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The dense MLP's ``silu(x @ w_gate^T) * (x @ w_up^T)``: on the kernel one GEMM with the SwiGLU in its epilogue
    (the two pre-activations never reach memory, fp32 until the one rounding); in torch two ``linear`` calls (each
    rounded to x's dtype, as transformers' MLP does) and ``silu_mul``.

    Args:
        x: [..., K]. w_gate, w_up: [N, K] (``gate_proj.weight``, ``up_proj.weight``) in x's dtype for the kernel.
        backend: see module doc.

    Returns:
        [..., N] in x's dtype.

    Example:
        >>> out = mlp.down_proj(swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight))
    """
    def shape_reason():
        if w_gate.dtype != x.dtype or w_up.dtype != x.dtype:
            return f"weights in {w_gate.dtype} / {w_up.dtype} for {x.dtype} activations"
        return importlib.import_module(_HOPPER).swiglu_shape_reason(w_gate.shape[0], x.shape[-1], x.dtype)

    if _use_kernels(backend, "swiglu_gemm", x, w_gate, w_up, shape_reason=shape_reason):
        hopper = importlib.import_module(_HOPPER)
        return hopper.swiglu_gemm_fwd(x, w_gate, w_up)
    return torch_path.silu_mul(torch.nn.functional.linear(x, w_gate), torch.nn.functional.linear(x, w_up))


def qk_norm_rope(qg: torch.Tensor, kx: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None):
    """The gated attention layers' q/k preparation: zero-centred RMSNorm of each head row, then the rotary
    embedding on the first R channels, written in the attention kernels' ``[B, heads, L, D]`` layout.

    Args:
        qg: [B, L, H, 2 D] (``q_proj``'s output per head: query, gate). kx: [B, L, Hkv, D]. wq, wk: [D]. eps: float.
        cos, sin: [B or 1, L, R] (R even, <= D; the kernel needs D in (64, 128, 256)). backend: see module doc.

    Returns:
        q [B, H, L, D] and k [B, Hkv, L, D], contiguous, in qg's dtype.

    Example:
        >>> q, k = qk_norm_rope(attn.q_proj(h).view(B, L, -1, 2 * D), attn.k_proj(h).view(B, L, -1, D),
        ...                     attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin)
    """
    hopper = importlib.import_module(_HOPPER)

    def shape_reason():
        return hopper.attention_shape_reason(qg.shape[-1] // 2, cos.shape[-1], cos.shape[0], qg.shape[0])

    if _use_kernels(backend, "qk_norm_rope", qg, kx, shape_reason=shape_reason):
        return hopper.qk_norm_rope_fwd(qg, kx, wq, wk, eps, cos, sin)
    return torch_path.qk_norm_rope(qg, kx, wq, wk, eps, cos, sin)


def gate_mul(attn: torch.Tensor, qg: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The gated attention output ``attn * sigmoid(gate)``, the gate read in place from ``q_proj``'s output.

    Args:
        attn: [..., H * D]. qg: [..., H, 2 D], the same tokens. backend: see module doc.

    Returns:
        attn's shape and dtype.
    """
    hopper = importlib.import_module(_HOPPER)
    if _use_kernels(backend, "gate_mul", attn, qg, shape_reason=lambda: hopper.attention_shape_reason(
            qg.shape[-1] // 2, 0, 1, 1)):
        return hopper.gate_mul_fwd(attn, qg)
    return torch_path.gate_mul(attn, qg)


def gate_mul_head_major(attn: torch.Tensor, qg: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``gate_mul`` on the attention output as SDPA returns it (head-major), written token-major for ``o_proj``:
    transformers' transpose copy after SDPA and the gate's product in one pass.

    Args:
        attn: [B, H, L, D]. qg: [B, L, H, 2 D], the same tokens. backend: see module doc.

    Returns:
        [B, L, H * D] in attn's dtype.

    Example:
        >>> out = gate_mul_head_major(F.scaled_dot_product_attention(q, k, v, is_causal=True), qg)
    """
    hopper = importlib.import_module(_HOPPER)
    if _use_kernels(backend, "gate_mul_head_major", attn, qg, shape_reason=lambda: hopper.attention_shape_reason(
            attn.shape[-1], 0, 1, 1)):
        return hopper.gate_mul_head_major_fwd(attn, qg)
    return torch_path.gate_mul_head_major(attn, qg)
