"""TileLang kernels for sm_90a for the decoder's glue, one stage per file (builders and their launchers):
``conv_gates`` (causal conv1d + SiLU + split + q/k l2norm + gates, token-major), ``gated_norm`` (gated RMSNorm),
``rms_norm`` (Qwen's zero-centred RMSNorm around the layers), ``silu_mul`` (the MLP's ``silu(gate) * up``),
``attn_glue`` (the gated attention layers' q/k norm + partial RoPE, and ``attn * sigmoid(gate)``),
``swiglu_gemm`` (the MLP's gate and up GEMMs with ``silu(gate) * up`` in their epilogue) and ``cross_entropy`` (the
LM head's loss per row with its gradient written over the logits, and the in-place scale of that gradient).
``conv_gates``, ``gated_norm``, ``rms_norm`` and ``silu_mul`` also have a backward kernel (``*_bwd``), which
``flashqla_kernels.decoder.autograd`` pairs with the forward under grad.

Importing this package does not import tilelang: each launcher imports its stage module (which imports tilelang) on
the first kernel call. Every stage compiles through ``flashqla_kernels.toolkit.compile_kernel`` (once per
specialisation per process, and TileLang's disk cache across processes) and allocates its outputs with
``toolkit.empty`` / ``empty_like`` (NaN-filled inside ``toolkit.poisoned_outputs()``).
"""
from __future__ import annotations

import torch

__all__ = ["conv_qkv_gates_fwd", "gated_rms_norm_fwd", "rms_norm_fwd", "add_rms_norm_fwd", "silu_mul_fwd",
           "qk_norm_rope_fwd", "gate_mul_fwd", "gate_mul_head_major_fwd", "swiglu_gemm_fwd", "conv_qkv_bwd",
           "gated_rms_norm_bwd", "rms_norm_bwd", "silu_mul_bwd", "add_operands_reason", "norm_out_reason",
           "conv_shape_reason", "attention_shape_reason", "swiglu_shape_reason", "cross_entropy_fwd", "scale_fwd",
           "logits_shape_reason", "HEAD_DIMS"]

HEAD_DIMS = (64, 128, 256)
# The SwiGLU GEMM's default tile: N (output channels) in blocks of 128, K (input channels) in steps of 64; equal to
# swiglu_gemm.DEFAULT_CONFIG's BN and BK (a test pins it).
SWIGLU_BLOCK_N, SWIGLU_BLOCK_K = 128, 64


def conv_shape_reason(Hk: int, K: int, Hv: int, V: int, Kc: int) -> str | None:
    """Why the conv + gates kernel cannot take these head shapes, or None."""
    if K != V:
        return f"the conv kernel tiles channels by head and needs K == V; got K={K}, V={V}"
    if K not in HEAD_DIMS:
        return f"head dim {K} unsupported by the conv kernel (supported: {HEAD_DIMS})"
    if not 2 <= Kc <= 8:
        return f"conv width {Kc} unsupported by the conv kernel (2..8)"
    return None


def conv_qkv_gates_fwd(qkv, weight, bias, a, b, A_log, dt_bias, *, Hk, K, Hv, V, prefix=None):
    """Conv + gates on the kernel (see ``conv_gates.conv_qkv_gates``); same Args/Returns as
    ``flashqla_kernels.decoder.ops.conv_qkv_gates``. Raises ValueError for head shapes the kernel lacks."""
    reason = conv_shape_reason(Hk, K, Hv, V, weight.shape[-1])
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import conv_gates as stage

    return stage.conv_qkv_gates(qkv, weight, bias, a, b, A_log, dt_bias, Hk=Hk, Hv=Hv, D=K, prefix=prefix)


def gated_rms_norm_fwd(o, z, weight, eps):
    """Gated RMSNorm on the kernel (see ``gated_norm.gated_rms_norm``): o [..., V], z same numel, weight [V]."""
    if o.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim V={o.shape[-1]} unsupported by the gated-norm kernel (supported: {HEAD_DIMS})")
    from flashqla_kernels.decoder.hopper import gated_norm as stage

    return stage.gated_rms_norm(o, z, weight, eps)


def norm_out_reason(dtype: torch.dtype, out_dtype: torch.dtype | None) -> str | None:
    """Why the RMSNorm kernels cannot write rows of ``dtype`` normalised in ``out_dtype``, or None: None or the rows'
    own dtype, or bf16 / fp16 from fp32 rows (the residual stream under autocast, written in autocast's dtype)."""
    if out_dtype is None or out_dtype == dtype or (dtype == torch.float32
                                                   and out_dtype in (torch.bfloat16, torch.float16)):
        return None
    return (f"the RMSNorm kernels write {dtype} rows in their own dtype, or fp32 rows in bf16/fp16; got out_dtype "
            f"{out_dtype}")


def rms_norm_fwd(x, weight, eps, *, out_dtype=None):
    """Zero-centred RMSNorm on the kernel (see ``rms_norm.rms_norm``): x [..., D] with D a multiple of 64, y in
    ``out_dtype`` (None: x's; ``norm_out_reason``)."""
    if x.shape[-1] % 64:
        raise ValueError(f"row width D={x.shape[-1]} unsupported by the RMSNorm kernel (a multiple of 64 needed)")
    reason = norm_out_reason(x.dtype, out_dtype)
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import rms_norm as stage

    return stage.rms_norm(x, weight, eps, out_dtype=out_dtype)


def add_operands_reason(a, b) -> str | None:
    """Why the add + RMSNorm kernel cannot add these rows, or None: same shape, and b in a's dtype, or a fp32 (the
    residual stream of fp32 weights under autocast) and b bf16/fp16 (summed in fp32, as torch's add promotes)."""
    if b.shape != a.shape or not (b.dtype == a.dtype or (a.dtype == torch.float32
                                                         and b.dtype in (torch.bfloat16, torch.float16))):
        return (f"add_rms_norm adds rows of one shape, b in a's dtype or a fp32 and b bf16/fp16; got a "
                f"{tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}")
    return None


def add_rms_norm_fwd(a, b, weight, eps, *, out_dtype=None):
    """The decoder's residual add and the zero-centred RMSNorm after it in one pass (see ``rms_norm.add_rms_norm``):
    a, b [..., D] with D a multiple of 64 (``add_operands_reason``); returns (a + b in a's dtype, rms_norm(a + b) in
    ``out_dtype``, None: a's; ``norm_out_reason``)."""
    if a.shape[-1] % 64:
        raise ValueError(f"row width D={a.shape[-1]} unsupported by the add + RMSNorm kernel (a multiple of 64 needed)")
    reason = add_operands_reason(a, b) or norm_out_reason(a.dtype, out_dtype)
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import rms_norm as stage

    return stage.add_rms_norm(a, b, weight, eps, out_dtype=out_dtype)


def silu_mul_fwd(gate, up):
    """The MLP's ``silu(gate) * up`` on the kernel (see ``silu_mul.silu_mul``): gate, up [..., D] with D a multiple
    of 64, same shape and dtype."""
    if gate.shape[-1] % 64:
        raise ValueError(f"row width D={gate.shape[-1]} unsupported by the silu_mul kernel (a multiple of 64 needed)")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"silu_mul needs up like gate; got gate {tuple(gate.shape)} {gate.dtype}, "
                         f"up {tuple(up.shape)} {up.dtype}")
    from flashqla_kernels.decoder.hopper import silu_mul as stage

    return stage.silu_mul(gate, up)


def conv_qkv_bwd(qkv, weight, bias, dq, dk, dv, *, Hk, K, Hv):
    """The conv + SiLU + q/k l2norm backward on the kernel (see ``conv_gates.conv_qkv_bwd``; no conv state):
    returns (dqkv in qkv's dtype, dweight [C, Kc] fp32, dbias [C] fp32 or None)."""
    from flashqla_kernels.decoder.hopper import conv_gates as stage

    return stage.conv_qkv_bwd(qkv, weight, bias, dq, dk, dv, Hk=Hk, Hv=Hv, D=K)


def gated_rms_norm_bwd(o, z, weight, eps, dy):
    """The gated RMSNorm's backward on the kernel (see ``gated_norm.gated_rms_norm_bwd``): (do, dz, dweight fp32)."""
    from flashqla_kernels.decoder.hopper import gated_norm as stage

    return stage.gated_rms_norm_bwd(o, z, weight, eps, dy)


def rms_norm_bwd(x, weight, eps, dy, ds=None):
    """The zero-centred RMSNorm's backward on the kernel (see ``rms_norm.rms_norm_bwd``; dy in x's dtype, or bf16 /
    fp16 for fp32 x), ``ds`` (the residual path's gradient of x) added: (dx, dweight fp32)."""
    from flashqla_kernels.decoder.hopper import rms_norm as stage

    return stage.rms_norm_bwd(x, weight, eps, dy, ds)


def silu_mul_bwd(gate, up, dout):
    """The backward of ``silu(gate) * up`` on the kernel (see ``silu_mul.silu_mul_bwd``): (dgate, dup)."""
    from flashqla_kernels.decoder.hopper import silu_mul as stage

    return stage.silu_mul_bwd(gate, up, dout)


def attention_shape_reason(D: int, R: int, cos_batch: int, batch: int) -> str | None:
    """Why the attention glue kernels cannot take head dim D, R rotary channels and cos/sin of ``cos_batch`` rows
    for a batch of ``batch``, or None."""
    if D not in HEAD_DIMS:
        return f"attention head dim {D} unsupported by the attention glue kernels (supported: {HEAD_DIMS})"
    if R % 2 or R > D:
        return f"rotary dim {R} must be even and at most the head dim {D}"
    if cos_batch not in (1, batch):
        return f"cos/sin have {cos_batch} batch rows for a batch of {batch} (1 or the batch needed)"
    return None


def qk_norm_rope_fwd(qg, kx, wq, wk, eps, cos, sin):
    """q/k norm + partial RoPE on the kernel (see ``attn_glue.qk_norm_rope``); same Args/Returns as
    ``flashqla_kernels.decoder.ops.qk_norm_rope``. Raises ValueError for shapes the kernel lacks."""
    reason = attention_shape_reason(qg.shape[-1] // 2, cos.shape[-1], cos.shape[0], qg.shape[0])
    if reason is None and (kx.shape[-1] != qg.shape[-1] // 2 or cos.shape != sin.shape):
        reason = (f"k rows of {kx.shape[-1]} channels for q rows of {qg.shape[-1] // 2}, or cos {tuple(cos.shape)} "
                  f"unlike sin {tuple(sin.shape)}")
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import attn_glue as stage

    return stage.qk_norm_rope(qg, kx, wq, wk, eps, cos, sin)


def gate_mul_fwd(attn, qg):
    """``attn * sigmoid(gate)`` on the kernel (see ``attn_glue.gate_mul``): attn [..., H * D], qg [..., H, 2 D]."""
    reason = attention_shape_reason(qg.shape[-1] // 2, 0, 1, 1)
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import attn_glue as stage

    return stage.gate_mul(attn, qg)


def gate_mul_head_major_fwd(attn, qg):
    """``attn * sigmoid(gate)`` on SDPA's head-major output (see ``attn_glue.gate_mul_head_major``): attn
    [B, H, L, D], qg [B, L, H, 2 D]; returns [B, L, H * D]."""
    reason = attention_shape_reason(attn.shape[-1], 0, 1, 1)
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import attn_glue as stage

    return stage.gate_mul_head_major(attn, qg)


def swiglu_shape_reason(N: int, K: int, dtype: torch.dtype) -> str | None:
    """Why the SwiGLU GEMM kernel cannot take N output channels (w_gate / w_up [N, K]), K input channels and
    activations of ``dtype``, or None."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} unsupported by the SwiGLU GEMM kernel (bfloat16 or float16)"
    if N % SWIGLU_BLOCK_N:
        return f"N={N} output channels: the SwiGLU GEMM kernel tiles N by {SWIGLU_BLOCK_N}"
    if K % SWIGLU_BLOCK_K:
        return f"K={K} input channels: the SwiGLU GEMM kernel steps K by {SWIGLU_BLOCK_K}"
    return None


def swiglu_gemm_fwd(x, w_gate, w_up):
    """The MLP's ``silu(x @ w_gate^T) * (x @ w_up^T)`` in one GEMM kernel (see ``swiglu_gemm.swiglu_gemm``): x
    [..., K], w_gate and w_up [N, K] (``gate_proj.weight``, ``up_proj.weight``) in x's dtype; returns [..., N].
    Raises ValueError for shapes or dtypes the kernel lacks."""
    reason = swiglu_shape_reason(w_gate.shape[0], x.shape[-1], x.dtype)
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import swiglu_gemm as stage

    return stage.swiglu_gemm(x, w_gate, w_up)


def logits_shape_reason(x: torch.Tensor) -> str | None:
    """Why the cross-entropy kernels cannot take rows of logits ``x``, or None."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"logits dtype {x.dtype} unsupported by the cross-entropy kernels (bfloat16, float16 or float32)"
    if x.dim() != 2 or not x.is_contiguous():
        return f"logits must be contiguous [rows, vocab], got shape {tuple(x.shape)} strides {x.stride()}"
    if x.shape[1] % 8:
        return f"vocab of {x.shape[1]} entries: the cross-entropy kernels read rows in 8-entry vectors"
    return None


def cross_entropy_fwd(logits, targets):
    """Each row's cross entropy on the kernel, ``logits`` [N, V] overwritten by ``softmax - onehot`` (see
    ``cross_entropy.cross_entropy_``); targets [N] int64 in [0, V). Returns [N] fp32."""
    reason = logits_shape_reason(logits)
    if reason is None and (targets.shape != logits.shape[:1] or targets.dtype != torch.int64):
        reason = (f"targets must be int64 [{logits.shape[0]}] for logits {tuple(logits.shape)}, got "
                  f"{targets.dtype} {tuple(targets.shape)}")
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import cross_entropy as stage

    return stage.cross_entropy_(logits, targets.contiguous())


def scale_fwd(x, s):
    """``x *= s`` in place on the kernel (see ``cross_entropy.scale_``): x [N, V] contiguous, s a 1-element fp32
    tensor on x's device. Returns x."""
    reason = logits_shape_reason(x)
    if reason is None and (s.numel() != 1 or s.dtype != torch.float32 or s.device != x.device):
        reason = f"the scale must be one fp32 value on {x.device}, got {s.dtype} {tuple(s.shape)} on {s.device}"
    if reason is not None:
        raise ValueError(reason)
    from flashqla_kernels.decoder.hopper import cross_entropy as stage

    return stage.scale_(x, s)
