"""The decoder's glue stages with backend dispatch: TileLang kernels for CUDA sm_90 tensors, torch elsewhere.

``conv_qkv_gates`` (causal conv1d + SiLU + split + q/k l2norm + gates), ``gated_norm`` (gated RMSNorm),
``rms_norm`` (Qwen's zero-centred RMSNorm: the decoder / final / q-k norms around the layers; ``add_rms_norm`` the
decoder's mid-layer residual add with the norm after it), ``silu_mul`` (the dense MLP's ``silu(gate) * up``;
``swiglu`` the same with the gate and up projections in one fused GEMM), and the gated full-attention layers'
``qk_norm_rope`` (q/k norms + partial rotary embedding, into the attention kernels' layout) and ``gate_mul``
(``attn * sigmoid(gate)``) have one signature each across the torch formulation (``torch_path``) and the kernels
(``hopper``). ``cross_entropy_`` (the LM head's loss per row, its gradient written over the logits) and ``scale_``
(that gradient scaled in place) are the LM loss's two halves: no autograd of their own (the caller's Function is).

Each stage asks ``flashqla_kernels.dispatch.decide`` with the same verifiers: ``dispatch.hopper_reason`` (CUDA tensors
of an sm_90 GPU), ``dtype_reason`` (bfloat16 / float16) and the stage's shape check. ``backend=None`` picks the kernel
when every verifier passes, else torch; ``"torch"`` forces torch; ``"tilelang"`` forces the kernel or raises the
reason. Under grad, ``conv_qkv_gates`` (without a conv state), ``gated_norm``, ``rms_norm``, ``add_rms_norm`` and
``silu_mul`` run their kernels through ``autograd``, each forward kernel paired with a backward kernel
(``GRAD_KERNELS = False`` sends them to torch too); the others (``swiglu``, ``qk_norm_rope``, ``gate_mul``,
``gate_mul_head_major``) are forward-only and take the differentiable torch formulation when an input requires grad. ``glue_kernel_reason`` is the same device / dtype / grad check for callers
choosing between a fused path and transformers' own forward.

``rms_norm`` and ``add_rms_norm`` take ``out_dtype=``: the patches of the decoder and final norms pass
``autocast_out_dtype(x)``, so under autocast the norm of the fp32 residual stream is rounded to autocast's dtype once,
in the kernel, instead of written in fp32 for every projection it feeds to cast again (the backward kernel reads the
gradient in that dtype).

Importing this module touches neither CUDA nor tilelang (``hopper`` loads its stage modules on a kernel's first call).
"""
from __future__ import annotations

import torch

from flashqla_kernels import dispatch
from flashqla_kernels.decoder import autograd, hopper, torch_path

__all__ = ["conv_qkv_gates", "gated_norm", "rms_norm", "add_rms_norm", "silu_mul", "swiglu", "qk_norm_rope",
           "gate_mul", "gate_mul_head_major", "cross_entropy_", "scale_", "glue_kernel_reason", "dtype_reason",
           "autocast_out_dtype", "conv_qkv_gates_decision", "gated_norm_decision", "KERNEL_DTYPES", "ROW_DTYPES",
           "GRAD_KERNELS"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# Under grad, the stages with a backward kernel (conv + gates, the norms, silu_mul) run their autograd pairing of
# forward and backward kernels; False sends every call that records grad to the torch formulation.
GRAD_KERNELS = True
# the RMSNorm kernels also take fp32 rows: the residual stream of fp32 weights under bf16 autocast stays fp32
ROW_DTYPES = KERNEL_DTYPES + (torch.float32,)


def dtype_reason(x: torch.Tensor, dtypes: tuple = KERNEL_DTYPES) -> str | None:
    """Why the glue kernels (of ``dtypes``) cannot take activations of ``x``'s dtype, or None."""
    if x.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"activation dtype {x.dtype} unsupported by the glue kernels ({names} only)"
    return None


def autocast_out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a norm of ``x`` should write for the projections it feeds: under autocast on x's device, autocast's
    bf16 / fp16 for fp32 x (each projection would cast an fp32 output to it anyway); else x's dtype.

    Example:
        >>> with torch.autocast("cuda", dtype=torch.bfloat16):
        ...     h = rms_norm(x, norm.weight, norm.eps, out_dtype=autocast_out_dtype(x))   # x fp32 -> h bf16
    """
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in KERNEL_DTYPES:
            return dtype
    return x.dtype


def glue_kernel_reason(*tensors: torch.Tensor | None, grad_ok: bool = False,
                       dtypes: tuple = KERNEL_DTYPES) -> str | None:
    """Why the glue kernels cannot run on these tensors, or None when they can.

    Args:
        tensors: the stage's activations (the first one's dtype decides; None entries are skipped).
        grad_ok: the caller's stages have backward kernels (``rms_norm``, ``add_rms_norm``, ``silu_mul``, the GDN
            layer's), so an input requiring grad is no obstacle (while ``GRAD_KERNELS`` is on).
        dtypes: the activation dtypes the caller's kernels take (``ROW_DTYPES`` for the RMSNorms).

    Returns:
        A sentence naming what is unsupported (device, dtype, or an input requiring grad), or None.
    """
    xs = [x for x in tensors if x is not None]
    return (dispatch.hopper_reason(*xs) or dtype_reason(xs[0], dtypes)
            or (None if grad_ok and GRAD_KERNELS else dispatch.grad_reason(*xs)))


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call: grad mode on and an input (activation or weight) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _kernel(stage: str, backend: str | None, tensors: tuple, shape_reason=None, forward_only: bool = True,
            dtypes: tuple = KERNEL_DTYPES) -> bool:
    """Whether ``stage`` runs its kernel on ``tensors`` (the first one's dtype decides, among ``dtypes``); raises for
    a forced kernel that cannot run. ``forward_only``: the stage has no backward kernel, so grad sends it to torch."""
    return _decision(stage, backend, tensors, shape_reason, forward_only, dtypes).kernel


def _decision(stage: str, backend: str | None, tensors: tuple, shape_reason=None,
              forward_only: bool = True, dtypes: tuple = KERNEL_DTYPES) -> dispatch.Decision:
    checks = (lambda: dispatch.hopper_reason(*tensors), lambda: dtype_reason(tensors[0], dtypes))
    if shape_reason is not None:
        checks += (shape_reason,)
    return dispatch.decide(stage, backend, *checks, grad=tensors if forward_only or not GRAD_KERNELS else ())


def conv_qkv_gates_decision(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, Hk: int, K: int, Hv: int,
                            V: int, Kc: int, has_prefix: bool = False, weights: tuple = (),
                            backend: str | None = None) -> dispatch.Decision:
    """The dispatcher's decision for ``conv_qkv_gates`` on these activations and head shapes (conv width Kc; a conv
    state when ``has_prefix``; ``weights``: the conv weight and bias, A_log, dt_bias, which may require grad)."""
    def shape_reason():
        reason = hopper.conv_shape_reason(Hk, K, Hv, V, Kc)
        if reason is None and has_prefix and _needs_grad(qkv, a, b, *weights):
            reason = "a conv state (prefix) under grad: the conv kernel's backward takes fresh sequences only"
        return reason

    return _decision("conv_qkv_gates", backend, (qkv, a, b), shape_reason, forward_only=False)


def gated_norm_decision(o: torch.Tensor, z: torch.Tensor, *, backend: str | None = None) -> dispatch.Decision:
    """The dispatcher's decision for ``gated_norm`` on o [..., V] and z."""
    V = o.shape[-1]
    return _decision("gated_norm", backend, (o, z), lambda: None if V in hopper.HEAD_DIMS
                     else f"head dim V={V} unsupported (supported: {hopper.HEAD_DIMS})", forward_only=False)


def _width_reason(x: torch.Tensor) -> str | None:
    return None if x.shape[-1] % 64 == 0 else f"row width D={x.shape[-1]} is not a multiple of 64"


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
    weights = (weight, bias, A_log, dt_bias)
    if conv_qkv_gates_decision(qkv, a, b, Hk=Hk, K=K, Hv=Hv, V=V, Kc=weight.shape[-1], has_prefix=prefix is not None,
                               weights=weights, backend=backend).kernel:
        if _needs_grad(qkv, a, b, *weights):
            return autograd.conv_qkv_gates(qkv, weight, bias, a, b, A_log, dt_bias, Hk=Hk, K=K, Hv=Hv, V=V)
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
    if gated_norm_decision(o, z, backend=backend).kernel:
        if _needs_grad(o, z, weight):
            return autograd.gated_norm(o, z, weight, eps)
        return hopper.gated_rms_norm_fwd(o, z, weight, eps)
    return torch_path.gated_rms_norm(o, z, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out_dtype: torch.dtype | None = None,
             backend: str | None = None) -> torch.Tensor:
    """Qwen's zero-centred RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` with fp32 math.

    Args:
        x: [..., D] (for the kernel: D a multiple of 64, bf16 / fp16 / fp32). weight: [D]. eps: float.
        out_dtype: the output's dtype, rounded once from the fp32 math (default None: x's; the kernel takes x's or,
            for fp32 x, bf16 / fp16: ``autocast_out_dtype``). backend: see module doc.

    Returns:
        x's shape, in ``out_dtype``.

    Example:
        >>> h = rms_norm(x, layer.input_layernorm.weight, 1e-6, out_dtype=autocast_out_dtype(x))
    """
    if _kernel("rms_norm", backend, (x,), lambda: _width_reason(x) or hopper.norm_out_reason(x.dtype, out_dtype),
               forward_only=False, dtypes=ROW_DTYPES):
        if _needs_grad(x, weight):
            return autograd.rms_norm(x, weight, eps, out_dtype=out_dtype)
        return hopper.rms_norm_fwd(x, weight, eps, out_dtype=out_dtype)
    return torch_path.rms_norm_zero_centred(x, weight, eps, out_dtype=out_dtype)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out_dtype: torch.dtype | None = None, backend: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's mid-layer step: the residual add ``s = a + b`` (in a's dtype, as ``a + b`` rounds it) and Qwen's
    zero-centred RMSNorm of s, in one pass on the kernel.

    Args:
        a, b: [..., D], same shape (the residual and the token mixer's output): same dtype, or a fp32 (the residual
            stream under autocast) and b bf16/fp16, summed in fp32 as torch's add promotes. weight: [D]. eps: float.
        out_dtype: the norm's dtype, as ``rms_norm``'s (s keeps a's). backend: see module doc.

    Returns:
        (s, rms_norm(s)), each a's shape; s in a's dtype, a new tensor; the norm in ``out_dtype`` (None: a's).

    Example:
        >>> s, h = add_rms_norm(residual, attn_out, layer.post_attention_layernorm.weight, 1e-6)
    """
    if _kernel("add_rms_norm", backend, (a, b), lambda: _width_reason(a) or hopper.add_operands_reason(a, b)
               or hopper.norm_out_reason(a.dtype, out_dtype), forward_only=False, dtypes=ROW_DTYPES):
        if _needs_grad(a, b, weight):
            return autograd.add_rms_norm(a, b, weight, eps, out_dtype=out_dtype)
        return hopper.add_rms_norm_fwd(a, b, weight, eps, out_dtype=out_dtype)
    s = a + b
    return s, torch_path.rms_norm_zero_centred(s, weight, eps, out_dtype=out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The dense MLP's gated activation ``silu(gate) * up`` with fp32 math, rounded once.

    Args:
        gate: [..., D] (D a multiple of 64 for the kernel). up: same shape and dtype. backend: see module doc.

    Returns:
        gate's shape and dtype.

    Example:
        >>> out = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    """
    if _kernel("silu_mul", backend, (gate, up), lambda: _width_reason(gate)
               or (None if up.shape == gate.shape and up.dtype == gate.dtype
                   else f"up {tuple(up.shape)} {up.dtype} unlike gate {tuple(gate.shape)} {gate.dtype}"),
               forward_only=False):
        if _needs_grad(gate, up):
            return autograd.silu_mul(gate, up)
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
        return hopper.swiglu_shape_reason(w_gate.shape[0], x.shape[-1], x.dtype)

    if _kernel("swiglu_gemm", backend, (x, w_gate, w_up), shape_reason):
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
    def shape_reason():
        return hopper.attention_shape_reason(qg.shape[-1] // 2, cos.shape[-1], cos.shape[0], qg.shape[0])

    if _kernel("qk_norm_rope", backend, (qg, kx), shape_reason):
        return hopper.qk_norm_rope_fwd(qg, kx, wq, wk, eps, cos, sin)
    return torch_path.qk_norm_rope(qg, kx, wq, wk, eps, cos, sin)


def gate_mul(attn: torch.Tensor, qg: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The gated attention output ``attn * sigmoid(gate)``, the gate read in place from ``q_proj``'s output.

    Args:
        attn: [..., H * D]. qg: [..., H, 2 D], the same tokens. backend: see module doc.

    Returns:
        attn's shape and dtype.
    """
    if _kernel("gate_mul", backend, (attn, qg), lambda: hopper.attention_shape_reason(qg.shape[-1] // 2, 0, 1, 1)):
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
    if _kernel("gate_mul_head_major", backend, (attn, qg),
               lambda: hopper.attention_shape_reason(attn.shape[-1], 0, 1, 1)):
        return hopper.gate_mul_head_major_fwd(attn, qg)
    return torch_path.gate_mul_head_major(attn, qg)


_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, *, block_rows: int = 1024,
                   backend: str | None = None) -> torch.Tensor:
    """Each row's cross entropy ``logsumexp(x_i) - x_i[t_i]`` in fp32, with ``logits`` overwritten in place by the
    gradient of their sum, ``softmax(x_i) - onehot(t_i)``, rounded to the logits' dtype. Not differentiable itself:
    the caller's autograd Function holds the buffer as the gradient (``qwen_scope.applications.lm_loss``).

    Args:
        logits: [N, V] contiguous bf16 / fp16 / fp32 (V a multiple of 8 for the kernel). targets: [N] int64, every
            entry in [0, V) (not checked: the check would wait for the GPU). block_rows: rows the torch formulation
            softmaxes at once (its fp32 memory); the kernel walks every row in one launch. backend: see module doc.

    Returns:
        [N] fp32.

    Example:
        >>> loss = cross_entropy_(head(h), targets).mean()     # head(h) now holds softmax - onehot
    """
    if dispatch.decide("cross_entropy", backend, lambda: dispatch.hopper_reason(logits, targets),
                       lambda: dtype_reason(logits, _LOGIT_DTYPES),
                       lambda: hopper.logits_shape_reason(logits)).kernel:
        return hopper.cross_entropy_fwd(logits, targets)
    return torch_path.cross_entropy_(logits, targets, block_rows)


def scale_(x: torch.Tensor, s: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``x *= s`` in place in fp32, rounded once to x's dtype, with ``s`` a 1-element tensor on x's device (no host
    sync). Returns x.

    Args:
        x: [N, V] contiguous bf16 / fp16 / fp32 (V a multiple of 8 for the kernel). s: the factor. backend: see
            module doc.
    """
    if dispatch.decide("scale", backend, lambda: dispatch.hopper_reason(x, s),
                       lambda: dtype_reason(x, _LOGIT_DTYPES), lambda: hopper.logits_shape_reason(x)).kernel:
        return hopper.scale_fwd(x, s.float())
    return torch_path.scale_(x, s)
