"""Fused TopK-SAE encode: ``TopK_k(ReLU(x @ W_enc^T + b_enc))`` without materialising the ``[N, d_sae]`` pre-activations.

Two backends, one result (``SparseCodes`` equal to ``TopKSAE.encode_sparse`` up to ties):

- ``"tilelang"`` (Hopper, sm_90): ``saes.hopper_topk`` computes the matmul with the ReLU and a per-tile top-c in the
  epilogue, writing ``c`` candidates per 256 features instead of 256 pre-activations; a small torch pass merges them
  into the top-k, re-runs the rare rows it cannot certify through the kernel with ``4 c`` candidates and hands any
  still uncertain to ``encode_sparse`` (see ``hopper_topk.merge_candidates``). Values are the
  fp32-accumulated pre-activations (the default fp32 compute of ``TopKSAE``) with the 8 low mantissa bits cleared,
  returned in ``x.dtype``; features whose pre-activations agree to 2^-15 relative count as ties. No gradients.
- ``"torch"`` (any device): ``encode_sparse`` over row blocks, so the pre-activations never take more than
  ``max_block_bytes`` at a time; bit-for-bit ``encode_sparse`` when the input fits one block, else equal to the last
  fp32 bits (BLAS may round a row differently inside a smaller matmul). Inference only: no gradients either way.

``backend=None`` picks ``"tilelang"`` where ``unsupported_reason`` returns None, else ``"torch"``;
``explain_backend`` says which and why.
"""
from __future__ import annotations

import torch

from saes import hopper_topk
from saes.topk import SparseCodes

BACKENDS = ("tilelang", "torch")
# Tokens per kernel launch: bounds the candidate buffer (N * d_sae / 256 * c * 4 bytes: 64 MiB at 32K wide, c = 8).
CHUNK_TOKENS = 16384
# Bytes of fp32 pre-activations the torch backend materialises per block of rows.
MAX_BLOCK_BYTES = 1 << 30


def unsupported_reason(x: torch.Tensor, sae) -> str | None:
    """Why the TileLang backend cannot encode ``x`` with ``sae`` (None = it can).

    Args:
        x: ``[..., d_model]`` input.
        sae: a ``TopKSAE`` (anything with ``W_enc [d_sae, d_model]``, ``b_enc [d_sae]`` and ``k``).
    Returns:
        A sentence naming the obstacle and the fix, or None.
    """
    W_enc, k = sae.W_enc, sae.k
    d_sae, d_model = W_enc.shape
    if not (x.is_cuda and W_enc.is_cuda and sae.b_enc.is_cuda):
        return f"x and the SAE must be on a CUDA device (x on {x.device}, W_enc on {W_enc.device})"
    if x.device != W_enc.device:
        return f"x is on {x.device} but W_enc on {W_enc.device}; move one of them"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        name = torch.cuda.get_device_name(x.device)
        return f"the kernel is built for Hopper (sm_90); {name} is sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}"
    if x.dtype not in hopper_topk._TL_DTYPES or W_enc.dtype != x.dtype:
        return (f"needs x and W_enc both bfloat16 or both float16, got x {x.dtype} and W_enc {W_enc.dtype}; "
                f"load the SAE with dtype=torch.bfloat16 and pass bf16 activations")
    if d_model % hopper_topk.BLOCK_K:
        return f"d_model={d_model} is not a multiple of {hopper_topk.BLOCK_K}"
    if d_sae % hopper_topk.BLOCK_N:
        return f"d_sae={d_sae} is not a multiple of {hopper_topk.BLOCK_N}"
    if hopper_topk.candidates_per_tile(k, d_sae) * (d_sae // hopper_topk.BLOCK_N) < k:
        return f"k={k} is too large for d_sae={d_sae} (more than the per-tile candidates can hold)"
    try:
        import tilelang  # noqa: F401
    except ImportError as err:
        return f"tilelang is not importable ({err}); pip install tilelang==0.1.15"
    return None


def explain_backend(x: torch.Tensor, sae, backend: str | None = None) -> str:
    """One line: the backend ``fused_encode(x, sae, backend=backend)`` would use, and why."""
    reason = unsupported_reason(x, sae)
    if backend == "torch":
        return "torch (asked for)"
    if reason is None:
        return "tilelang (fused sm_90a kernel)"
    return f"{'error' if backend == 'tilelang' else 'torch'}: tilelang unavailable because {reason}"


def fused_encode(x: torch.Tensor, sae, *, backend: str | None = None) -> SparseCodes:
    """Top-k SAE codes of ``x``, as ``sae.encode_sparse(x)`` returns them, without the ``[N, d_sae]`` intermediate.

    Args:
        x: residual stream ``[..., d_model]``.
        sae: a ``TopKSAE`` (or anything with ``W_enc [d_sae, d_model]``, ``b_enc [d_sae]``, ``k`` and
            ``encode_sparse``).
        backend: ``"tilelang"`` (sm_90 GPU, bf16/fp16), ``"torch"`` (any device) or None (the fastest that applies).
    Returns:
        ``SparseCodes(values [..., k] in x.dtype sorted descending, indices [..., k] int64)``; zero values are padding
        for tokens with fewer than k positive pre-activations.

    Example:
        >>> sae = saes.load("qwen-scope-3.5-2b-base-w32k-l100", layer=12, device="cuda", dtype=torch.bfloat16)
        >>> codes = fused_encode(resid, sae)          # resid [B, T, 2048] bf16 -> values/indices [B, T, 100]
    """
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    d_model = sae.W_enc.shape[1]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.shape[-1:] != (d_model,):
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float tensor [..., d_model={d_model}], got {got}")
    reason = unsupported_reason(x, sae) if backend != "torch" else "torch backend asked for"
    if backend == "tilelang" and reason is not None:
        raise ValueError(f"fused_encode(backend='tilelang') cannot run: {reason}; use backend='torch' or None")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_model)
    codes = _encode_torch(x2, sae) if reason is not None else _encode_tilelang(x2, sae)
    return SparseCodes(codes.values.reshape(*lead, sae.k), codes.indices.reshape(*lead, sae.k))


@torch.no_grad()
def _encode_torch(x: torch.Tensor, sae, max_block_bytes: int = MAX_BLOCK_BYTES) -> SparseCodes:
    """``sae.encode_sparse`` over blocks of rows of ``x [N, d_model]`` (at most ``max_block_bytes`` of fp32 pre-acts)."""
    rows = max(1, max_block_bytes // (4 * sae.W_enc.shape[0]))
    if x.shape[0] <= rows:
        return sae.encode_sparse(x)
    parts = [sae.encode_sparse(x[start : start + rows]) for start in range(0, x.shape[0], rows)]
    return SparseCodes(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]))


@torch.no_grad()
def _encode_tilelang(x: torch.Tensor, sae, chunk_tokens: int = CHUNK_TOKENS, *, c: int | None = None,
                     candidates=None) -> SparseCodes:
    """Kernel candidates + certified merge per chunk of tokens, then one pass over the uncertain rows.

    The chunks run without a host sync. Rows the merge cannot certify are then re-run through the kernel with ``4 c``
    candidates per tile (few rows, so cheap), and those still uncertain go to ``encode_sparse``. ``candidates``
    replaces the kernel (tests pass its torch twin).
    """
    candidates = candidates or hopper_topk.topk_candidates
    W_enc, k = sae.W_enc.detach().contiguous(), sae.k
    b_enc = sae.b_enc.detach().float().contiguous()
    c = c or hopper_topk.candidates_per_tile(k, W_enc.shape[0])
    values = torch.empty(x.shape[0], k, device=x.device, dtype=x.dtype)
    indices = torch.empty(x.shape[0], k, device=x.device, dtype=torch.long)
    flagged = torch.empty(x.shape[0], device=x.device, dtype=torch.bool)
    for start in range(0, x.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, x.shape[0])
        v, i, f = hopper_topk.merge_candidates(candidates(x[start:stop].contiguous(), W_enc, b_enc, c), k)
        values[start:stop], indices[start:stop], flagged[start:stop] = v, i, f
    rows = flagged.nonzero().squeeze(1)
    wider = min(hopper_topk.BLOCK_N, 4 * c)
    if rows.numel() and wider > c:
        still = []
        for part in rows.split(chunk_tokens):
            v, i, f = hopper_topk.merge_candidates(candidates(x[part], W_enc, b_enc, wider), k)
            values[part], indices[part] = v.to(values.dtype), i  # index_put does not cast: fp32 merge -> x.dtype
            still.append(part[f])
        rows = torch.cat(still)
    for part in rows.split(chunk_tokens) if rows.numel() else ():
        exact = sae.encode_sparse(x[part])
        values[part], indices[part] = exact.values.to(values.dtype), exact.indices
    return SparseCodes(values, indices)


@torch.no_grad()
def _encode_split(x: torch.Tensor, sae, chunk_tokens: int = 8192) -> SparseCodes:
    """Unfused variant for comparison: cuBLAS ``addmm`` writes bf16 pre-activations per chunk, the TileLang epilogue
    kernel reads them back. Selection at the precision of the stored pre-activations (ties at bf16)."""
    W_enc, k = sae.W_enc.detach(), sae.k
    b_enc = sae.b_enc.detach().to(x.dtype)
    c = hopper_topk.candidates_per_tile(k, W_enc.shape[0])
    values = torch.empty(x.shape[0], k, device=x.device, dtype=x.dtype)
    indices = torch.empty(x.shape[0], k, device=x.device, dtype=torch.long)
    for start in range(0, x.shape[0], chunk_tokens):
        xc = x[start : start + chunk_tokens]
        cand = hopper_topk.topk_candidates_from_preacts(torch.addmm(b_enc, xc, W_enc.T), c)
        v, i, flagged = hopper_topk.merge_candidates(cand, k)
        rows = flagged.nonzero().squeeze(1)
        if rows.numel():
            exact = sae.encode_sparse(xc[rows])
            v[rows], i[rows] = exact.values.float(), exact.indices
        values[start : start + xc.shape[0]] = v
        indices[start : start + xc.shape[0]] = i
    return SparseCodes(values, indices)
