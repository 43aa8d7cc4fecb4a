"""Glue of the hybrid models' gated full-attention layers on sm_90a: bf16/fp16 in and out, fp32 math.

``qk_norm_rope``: from ``q_proj``'s output (query and gate interleaved per head, ``[B, L, H, 2 D]``) and ``k_proj``'s
(``[B, L, Hkv, D]``), the zero-centred RMSNorm of every head row, rounded to the input dtype as transformers' norm
returns it, then the partial rotary embedding on its first R channels,

    y = round(x * rsqrt(mean(x^2) + eps) * (1 + w))
    out[d] = y[d] cos[d] - y[d + R/2] sin[d]     (d < R/2)
    out[d] = y[d] cos[d] + y[d - R/2] sin[d]     (R/2 <= d < R),     out[d] = y[d]   (d >= R)

written straight into the ``[B, H, L, D]`` / ``[B, Hkv, L, D]`` layouts the attention kernels take. transformers
spends ~25 launches on this per layer (a copy of the strided query half, two norms, the transposes, and the rotary
half's slices, products and concatenations in bf16); here one read and one write. Grid (L / BT, H + Hkv, B).

``gate_mul``: the attention output ``[N, H, D]`` times ``sigmoid(gate)``, the gate read in place from ``q_proj``'s
output (transformers first copies the strided gate half, then runs sigmoid and the product as two more passes).
``gate_mul_head_major`` takes the attention output as SDPA returns it, ``[B, H, L, D]``, and writes the token-major
``[B, L, H * D]`` that ``o_proj`` reads: the transpose copy transformers makes after SDPA is folded into the product.
"""
import tilelang.language as T
import torch

from flashqla_kernels.toolkit import compile_kernel, empty, empty_like, tl_dtype

THREADS = 128
TILE_ELEMS = 4096  # BT * D per CTA


def tokens_per_cta(D: int) -> int:
    return max(1, TILE_ELEMS // D)


def build_qk_norm_rope(H: int, Hkv: int, D: int, R: int, dtype: str, eps: float):
    """The q/k norm + partial RoPE kernel for H query heads and Hkv key heads of D channels, R rotary channels."""
    BT = tokens_per_cta(D)
    half = R // 2
    inv_d = 1.0 / D
    B = T.dynamic("B")
    L = T.dynamic("L")
    Bc = T.dynamic("Bc")  # batch rows of cos / sin: B, or 1 (shared by the batch)

    @T.prim_func
    def qwen_qk_norm_rope(
        qg: T.Tensor((B, L, H, 2 * D), dtype),
        kx: T.Tensor((B, L, Hkv, D), dtype),
        wq: T.Tensor((D,), "float32"),
        wk: T.Tensor((D,), "float32"),
        cos: T.Tensor((Bc, L, R), dtype),
        sin: T.Tensor((Bc, L, R), dtype),
        q: T.Tensor((B, H, L, D), dtype),
        k: T.Tensor((B, Hkv, L, D), dtype),
    ):
        with T.Kernel(T.ceildiv(L, BT), H + Hkv, B, threads=THREADS) as (bt, hh, b):
            t0 = bt * BT
            cb = T.if_then_else(Bc == 1, 0, b)
            xf = T.alloc_fragment((BT, D), "float32")
            sq = T.alloc_fragment((BT, D), "float32")
            ss = T.alloc_fragment((BT,), "float32")
            ys = T.alloc_shared((BT, D), "float32")
            if hh < H:
                for i, d in T.Parallel(BT, D):
                    xf[i, d] = T.if_then_else(t0 + i < L, T.cast(qg[b, T.min(t0 + i, L - 1), hh, d], "float32"), 0.0)
            else:
                for i, d in T.Parallel(BT, D):
                    xf[i, d] = T.if_then_else(t0 + i < L, T.cast(kx[b, T.min(t0 + i, L - 1), hh - H, d], "float32"),
                                              0.0)
            for i, d in T.Parallel(BT, D):
                sq[i, d] = xf[i, d] * xf[i, d]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(BT):
                ss[i] = T.rsqrt(ss[i] * inv_d + eps)
            for i, d in T.Parallel(BT, D):
                w = T.if_then_else(hh < H, wq[d], wk[d])
                ys[i, d] = T.cast(T.cast(xf[i, d] * ss[i] * (1.0 + w), dtype), "float32")
            T.sync_threads()
            # the rotary channels, then the rest: every index in range as written (TileLang evaluates both arms of
            # a select and may drop a clamp, so no arm may index past a row)
            for i, d in T.Parallel(BT, R):
                if t0 + i < L:
                    sign = T.if_then_else(d < half, -1.0, 1.0)
                    val = ys[i, d] * T.cast(cos[cb, t0 + i, d], "float32") + sign * ys[i, (d + half) % R] * T.cast(
                        sin[cb, t0 + i, d], "float32")
                    if hh < H:
                        q[b, hh, t0 + i, d] = T.cast(val, dtype)
                    else:
                        k[b, hh - H, t0 + i, d] = T.cast(val, dtype)
            if R < D:
                for i, d in T.Parallel(BT, D - R):
                    if t0 + i < L:
                        if hh < H:
                            q[b, hh, t0 + i, R + d] = T.cast(ys[i, R + d], dtype)
                        else:
                            k[b, hh - H, t0 + i, R + d] = T.cast(ys[i, R + d], dtype)

    return qwen_qk_norm_rope


def build_gate_mul(H: int, D: int, dtype: str):
    """``attn * sigmoid(gate)`` for N tokens of H heads of D channels, the gate at channels D..2D of each head of
    ``q_proj``'s output."""
    BT = tokens_per_cta(D)
    N = T.dynamic("N")

    @T.prim_func
    def attention_gate_mul(
        attn: T.Tensor((N, H, D), dtype),
        qg: T.Tensor((N, H, 2 * D), dtype),
        out: T.Tensor((N, H, D), dtype),
    ):
        with T.Kernel(T.ceildiv(N, BT), H, threads=THREADS) as (bt, h):
            for i, d in T.Parallel(BT, D):
                if bt * BT + i < N:
                    gate = T.cast(qg[bt * BT + i, h, D + d], "float32")
                    out[bt * BT + i, h, d] = T.cast(T.cast(attn[bt * BT + i, h, d], "float32") / (1.0 + T.exp(-gate)),
                                                    dtype)

    return attention_gate_mul


def build_gate_mul_head_major(H: int, D: int, dtype: str):
    """``attn * sigmoid(gate)``, ``attn`` head-major ``[B, H, L, D]``, the output token-major ``[B, L, H, D]``."""
    BT = tokens_per_cta(D)
    Bn = T.dynamic("B")
    L = T.dynamic("L")

    @T.prim_func
    def attention_gate_mul_head_major(
        attn: T.Tensor((Bn, H, L, D), dtype),
        qg: T.Tensor((Bn, L, H, 2 * D), dtype),
        out: T.Tensor((Bn, L, H, D), dtype),
    ):
        with T.Kernel(T.ceildiv(L, BT), H, Bn, threads=THREADS) as (bt, h, b):
            for i, d in T.Parallel(BT, D):
                if bt * BT + i < L:
                    gate = T.cast(qg[b, bt * BT + i, h, D + d], "float32")
                    out[b, bt * BT + i, h, d] = T.cast(
                        T.cast(attn[b, h, bt * BT + i, d], "float32") / (1.0 + T.exp(-gate)), dtype)

    return attention_gate_mul_head_major


def qk_norm_rope(qg: torch.Tensor, kx: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the q/k norm + partial RoPE kernel.

    Args:
        qg: [B, L, H, 2 D] (query, gate per head). kx: [B, L, Hkv, D]. wq, wk: [D]. eps: float.
        cos, sin: [B or 1, L, R] in qg's dtype (R even, <= D).

    Returns:
        q [B, H, L, D] and k [B, Hkv, L, D], contiguous, in qg's dtype.
    """
    B, L, H, D2 = qg.shape
    D, Hkv, R = D2 // 2, kx.shape[2], cos.shape[-1]
    kernel = compile_kernel(build_qk_norm_rope, H, Hkv, D, R, tl_dtype(qg.dtype), float(eps))
    q = empty((B, H, L, D), qg.dtype, qg.device)
    k = empty((B, Hkv, L, D), qg.dtype, qg.device)
    if B * L > 0:
        kernel(qg.contiguous(), kx.contiguous(), wq.to(torch.float32).contiguous(), wk.to(torch.float32).contiguous(),
               cos.to(qg.dtype).contiguous(), sin.to(qg.dtype).contiguous(), q, k)
    return q, k


def gate_mul(attn: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
    """Run ``attn * sigmoid(gate)``.

    Args:
        attn: [..., H * D] (the attention output, token-major). qg: [..., H, 2 D], the same tokens.

    Returns:
        attn's shape and dtype.
    """
    if qg.dim() != attn.dim() + 1 or attn.shape[-1] != qg.shape[-2] * (qg.shape[-1] // 2):
        raise ValueError(f"qg must be [..., H, 2 D] for attn [..., H * D]; got qg {tuple(qg.shape)}, "
                         f"attn {tuple(attn.shape)}")
    N, H, D = attn.numel() // attn.shape[-1], qg.shape[-2], qg.shape[-1] // 2
    kernel = compile_kernel(build_gate_mul, H, D, tl_dtype(attn.dtype))
    out = empty_like(attn)
    if N > 0:
        kernel(attn.reshape(N, H, D).contiguous(), qg.reshape(N, H, 2 * D).contiguous(), out.view(N, H, D))
    return out


def gate_mul_head_major(attn: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
    """Run ``attn * sigmoid(gate)`` on SDPA's head-major output.

    Args:
        attn: [B, H, L, D] (the attention output as SDPA returns it). qg: [B, L, H, 2 D], the same tokens.

    Returns:
        [B, L, H * D] in attn's dtype, token-major.
    """
    B, H, L, D = attn.shape
    if qg.shape != (B, L, H, 2 * D):
        raise ValueError(f"qg must be [B, L, H, 2 D] = {(B, L, H, 2 * D)} for attn [B, H, L, D] = "
                         f"{tuple(attn.shape)}; got qg {tuple(qg.shape)}")
    kernel = compile_kernel(build_gate_mul_head_major, H, D, tl_dtype(attn.dtype))
    out = empty((B, L, H, D), attn.dtype, attn.device)
    if B * L > 0:
        kernel(attn.contiguous(), qg.contiguous(), out)
    return out.view(B, L, H * D)
