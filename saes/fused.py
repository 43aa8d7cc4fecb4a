"""Fused TopK-SAE encode: ``TopK_k(ReLU(x @ W_enc^T + b_enc))`` without materialising the ``[N, d_sae]`` pre-activations.

Two backends, one result (``SparseCodes`` equal to ``TopKSAE.encode_sparse`` up to ties):

- ``"tilelang"`` (Hopper, sm_90): ``saes.hopper_topk`` computes the matmul with the ReLU and a per-tile top-c in the
  epilogue, writing ``c`` candidates per 256 features instead of 256 pre-activations; a second small kernel
  (``merge_candidates_kernel``) merges them into the top-k, the rare rows it cannot certify are re-run through the
  kernel with ``4 c`` candidates and any still uncertain are recomputed as ``encode_sparse`` does (on CUDA through
  one half-precision GEMM with fp32 output: ``_recompute``; see ``hopper_topk.merge_candidates``). Values are the
  fp32-accumulated pre-activations (the default fp32 compute of ``TopKSAE``) with the 8 low mantissa bits cleared,
  returned in ``x.dtype``; features whose pre-activations agree to 2^-15 relative count as ties. No gradients.
- ``"torch"`` (any device): ``encode_sparse`` over row blocks, so the pre-activations never take more than
  ``max_block_bytes`` at a time; bit-for-bit ``encode_sparse`` when the input fits one block, else equal to the last
  fp32 bits (BLAS may round a row differently inside a smaller matmul). Inference only: no gradients either way.

``backend=None`` picks ``"tilelang"`` where every verifier of ``flashqla_kernels.dispatch`` passes (an sm_90 GPU,
bf16/fp16 operands of one dtype, block-aligned sizes, tilelang importable), else ``"torch"``; ``explain_backend`` says
which and why.

Host syncs. ``fused_encode`` synchronises to find the uncertain rows (``nonzero``) and re-runs only those.
``fused_encode_async`` never reads GPU data on the host: the uncertain rows are compacted into buffers of fixed
capacity (``rerun_capacity(N)`` rows for the wider re-run, ``FALLBACK_ROWS`` for ``encode_sparse``) and written back
by scatter, and it returns an ``overflow`` flag on the device that is True when either buffer was too small (the codes
are then not certified: encode again with ``fused_encode``). A loop that launches more GPU work behind the encode
(activation collection) calls ``fused_encode_async`` and checks ``overflow`` where it syncs anyway.
"""
from __future__ import annotations

import torch

from flashqla_kernels import dispatch
from saes import hopper_topk
from saes.topk import SparseCodes

# Tokens per kernel launch: bounds the candidate buffer (N * d_sae / 256 * c * 4 bytes: 64 MiB at 32K wide, c = 8).
CHUNK_TOKENS = 16384
# Bytes of fp32 pre-activations the torch backend materialises per block of rows.
MAX_BLOCK_BYTES = 1 << 30
# Sync-free path: rows re-run wider per CHUNK_TOKENS tokens, one kernel row block (128: 32x the ~4 flagged rows per
# 16K tokens of real activations, 8x the 1e-3 rate candidates_per_tile aims for) ...
RERUN_ROWS_PER_CHUNK = hopper_topk.BLOCK_M
# ... and rows recomputed (``_recompute``) when the wider re-run still cannot certify them (64 rows: 8 MiB of fp32
# pre-activations at d_sae = 32K, computed on every call; 0.17 ms on an H200 at 2048 -> 32768).
FALLBACK_ROWS = 64


def _dtype_reason(x: torch.Tensor, sae) -> str | None:
    """Why the kernel cannot take the operands' dtypes (it reads bf16 or fp16, x and W_enc alike), or None."""
    if x.dtype not in hopper_topk.DTYPES or sae.W_enc.dtype != x.dtype:
        return (f"needs x and W_enc both bfloat16 or both float16, got x {x.dtype} and W_enc {sae.W_enc.dtype}; "
                f"load the SAE with dtype=torch.bfloat16 and pass bf16 activations")
    return None


def _shape_reason(sae) -> str | None:
    """Why the kernel's tiling cannot cover the SAE's sizes (d_model, d_sae, k), or None."""
    d_sae, d_model = sae.W_enc.shape
    if d_model % hopper_topk.BLOCK_K:
        return f"d_model={d_model} is not a multiple of {hopper_topk.BLOCK_K}"
    if d_sae % hopper_topk.BLOCK_N:
        return f"d_sae={d_sae} is not a multiple of {hopper_topk.BLOCK_N}"
    if hopper_topk.candidates_per_tile(sae.k, d_sae) * (d_sae // hopper_topk.BLOCK_N) < sae.k:
        return f"k={sae.k} is too large for d_sae={d_sae} (more than the per-tile candidates can hold)"
    return None


def _tilelang_reason() -> str | None:
    """Why the kernel cannot be compiled here (tilelang is not importable), or None."""
    try:
        import tilelang  # noqa: F401
    except ImportError as err:
        return f"tilelang is not importable ({err}); pip install tilelang==0.1.15"
    return None


def _verifiers(x: torch.Tensor, sae) -> tuple[dispatch.Verifier, ...]:
    """The kernel's requirements on one call, in the order ``dispatch.decide`` checks them."""
    return (lambda: dispatch.hopper_reason(x, sae.W_enc, sae.b_enc), lambda: _dtype_reason(x, sae),
            lambda: _shape_reason(sae), _tilelang_reason)


def explain_backend(x: torch.Tensor, sae, backend: str | None = None) -> str:
    """The backend ``fused_encode(x, sae, backend=backend)`` would use, and why, as ``dispatch.explain`` words it.

    Args:
        x: ``[..., d_model]`` input. sae: a ``TopKSAE``. backend: as for ``fused_encode``.
    Returns:
        ``"fused_encode: backend <name>"`` and one indented line per backend considered (``"fused_encode: error:
        ..."`` where ``fused_encode`` would raise).

    Example:
        >>> print(explain_backend(torch.randn(4, 2048), sae))
        fused_encode: backend torch
          tilelang: not used: tensors are on cpu; the TileLang kernels run on CUDA tensors of an sm_90 GPU only
          torch: runs every input the op accepts
    """
    return dispatch.explain("fused_encode", backend, *_verifiers(x, sae))


def fused_encode(x: torch.Tensor, sae, *, backend: str | None = None) -> SparseCodes:
    """Top-k SAE codes of ``x``, as ``sae.encode_sparse(x)`` returns them, without the ``[N, d_sae]`` intermediate.

    Always exact. On the TileLang backend it synchronises with the host once to find the rows the merge could not
    certify (``nonzero``), re-runs only those through the kernel with ``4 c`` candidates per tile, and recomputes any
    still uncertain as ``encode_sparse`` does (one more sync, only when some rows were flagged).

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
    x2, decision = _check_call("fused_encode", x, sae, backend)
    if not decision.kernel:
        return _shaped(_encode_torch(x2, sae), x, sae)
    return _shaped(_encode_tilelang(x2, sae), x, sae)


def fused_encode_async(x: torch.Tensor, sae, *, backend: str | None = None) -> tuple[SparseCodes, torch.Tensor]:
    """``fused_encode`` without host synchronisation: the codes, and a device flag saying whether to trust them.

    On the TileLang backend nothing waits for the GPU (no ``.item()``, no data-dependent shape), so the host can queue
    the next kernels behind the encode. The rows the merge cannot certify go through fixed-capacity buffers:
    ``rerun_capacity(N)`` rows for the wider kernel re-run and ``FALLBACK_ROWS`` recomputed as ``encode_sparse`` does.
    When more rows need them, ``overflow`` is True and the codes of the rows left out are not certified: encode ``x``
    again with ``fused_encode``. When it is False the codes are those of ``fused_encode`` (recomputed rows up to the
    last fp32 bits: cuBLAS may round a row differently in a batch of another size).

    Args:
        x: residual stream ``[..., d_model]``.
        sae: a ``TopKSAE`` (or anything with ``W_enc [d_sae, d_model]``, ``b_enc [d_sae]``, ``k`` and
            ``encode_sparse``).
        backend: ``"tilelang"`` (sm_90 GPU, bf16/fp16), ``"torch"`` (any device) or None (the fastest that applies).
    Returns:
        ``(codes, overflow)``: ``codes`` as ``fused_encode`` returns them; ``overflow`` a 0-dim bool tensor on
        ``x.device``, always False on the torch backend (which is exact and synchronises where torch does).

    Example:
        >>> codes, overflow = fused_encode_async(resid, sae)   # queued behind the forward; nothing waits
        >>> ...                                                # launch more work, then at the next sync point:
        >>> if overflow.item():
        ...     codes = fused_encode(resid, sae)
    """
    x2, decision = _check_call("fused_encode_async", x, sae, backend)
    if not decision.kernel:
        return _shaped(_encode_torch(x2, sae), x, sae), torch.zeros((), dtype=torch.bool, device=x.device)
    codes, overflow = _encode_tilelang_async(x2, sae)
    return _shaped(codes, x, sae), overflow


def rerun_capacity(n_tokens: int) -> int:
    """Rows ``fused_encode_async`` re-runs wider for ``n_tokens`` tokens: ``RERUN_ROWS_PER_CHUNK`` per ``CHUNK_TOKENS``
    tokens begun (128 for up to 16384 tokens, about N / 128 beyond), at most ``n_tokens``."""
    return min(n_tokens, -(-n_tokens // CHUNK_TOKENS) * RERUN_ROWS_PER_CHUNK)


def _check_call(name: str, x: torch.Tensor, sae, backend: str | None) -> tuple[torch.Tensor, dispatch.Decision]:
    """Validate a ``fused_encode*`` call; returns ``x`` as ``[N, d_model]`` and the backend decision.

    Raises:
        ValueError: an unknown backend, ``x`` not a float tensor ``[..., d_model]``, or ``backend="tilelang"`` on
            inputs the kernel cannot take (naming the reason).
    """
    dispatch.check_backend(backend)
    d_model = sae.W_enc.shape[1]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.shape[-1:] != (d_model,):
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float tensor [..., d_model={d_model}], got {got}")
    return x.reshape(-1, d_model), dispatch.decide(name, backend, *_verifiers(x, sae))


def _shaped(codes: SparseCodes, x: torch.Tensor, sae) -> SparseCodes:
    """``[N, k]`` codes back to ``x``'s leading dims: ``[..., k]``."""
    lead = x.shape[:-1]
    return SparseCodes(codes.values.reshape(*lead, sae.k), codes.indices.reshape(*lead, sae.k))


@torch.no_grad()
def _encode_torch(x: torch.Tensor, sae, max_block_bytes: int = MAX_BLOCK_BYTES) -> SparseCodes:
    """``sae.encode_sparse`` over blocks of rows of ``x [N, d_model]`` (at most ``max_block_bytes`` of fp32 pre-acts)."""
    rows = max(1, max_block_bytes // (4 * sae.W_enc.shape[0]))
    if x.shape[0] <= rows:
        return sae.encode_sparse(x)
    parts = [sae.encode_sparse(x[start : start + rows]) for start in range(0, x.shape[0], rows)]
    return SparseCodes(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]))


def _kernel_operands(sae, c: int | None, candidates) -> tuple:
    """``(candidates, merge, W_enc, b_enc fp32, c)`` for the kernel: ``candidates`` defaults to
    ``hopper_topk.topk_candidates`` merged by ``_merge_on_gpu``; an injected source (tests pass the kernel's torch twin)
    is merged by the torch ``merge_candidates``. ``c`` defaults to ``candidates_per_tile``."""
    W_enc = sae.W_enc.detach().contiguous()
    b_enc = sae.b_enc.detach().float().contiguous()
    c = c or hopper_topk.candidates_per_tile(sae.k, W_enc.shape[0])
    if candidates is None:
        return hopper_topk.topk_candidates, _merge_on_gpu, W_enc, b_enc, c
    return candidates, hopper_topk.merge_candidates, W_enc, b_enc, c


def _merge_on_gpu(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``merge_candidates`` of kernel candidates: the TileLang merge kernel where the keys of a row fit its registers
    (``NT * c <= MERGE_MAX_SLOTS``: every first pass of the shipped shapes, and the ``4 c`` re-run at d_sae = 32768),
    else the torch merge (the ``4 c`` re-run of a few flagged rows at d_sae = 65536)."""
    if cand.shape[1] * cand.shape[2] <= hopper_topk.MERGE_MAX_SLOTS:
        return hopper_topk.merge_candidates_kernel(cand, k)
    return hopper_topk.merge_candidates(cand, k)


def _merged_chunks(x: torch.Tensor, operands: tuple, k: int, chunk_tokens: int,
                   spare_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First pass, chunk by chunk without a host sync: kernel candidates and their merge.

    Returns:
        ``(values [N + spare_rows, k] x.dtype, indices [N + spare_rows, k] int64, flagged [N] bool)``; the spare rows
        are left uninitialised.
    """
    candidates, merge, W_enc, b_enc, c = operands
    n = x.shape[0]
    values = torch.empty(n + spare_rows, k, device=x.device, dtype=x.dtype)
    indices = torch.empty(n + spare_rows, k, device=x.device, dtype=torch.long)
    flagged = torch.empty(n, device=x.device, dtype=torch.bool)
    for start in range(0, n, chunk_tokens):
        stop = min(start + chunk_tokens, n)
        v, i, f = merge(candidates(x[start:stop].contiguous(), W_enc, b_enc, c), k)
        values[start:stop], indices[start:stop], flagged[start:stop] = v, i, f
    return values, indices, flagged


@torch.no_grad()
def _encode_tilelang(x: torch.Tensor, sae, chunk_tokens: int = CHUNK_TOKENS, *, c: int | None = None,
                     candidates=None) -> SparseCodes:
    """Kernel candidates + certified merge per chunk of tokens, then one pass over the uncertain rows, however many.

    The chunks run without a host sync; finding the uncertain rows does not (``nonzero``). Rows the merge cannot
    certify are re-run through the kernel with ``4 c`` candidates per tile (few rows, so cheap), and those still
    uncertain are recomputed (``_recompute``). ``candidates`` replaces the kernel (tests pass its torch twin; then the
    torch ``merge_candidates`` merges).
    """
    operands = _kernel_operands(sae, c, candidates)
    candidates, merge, W_enc, b_enc, c = operands
    values, indices, flagged = _merged_chunks(x, operands, sae.k, chunk_tokens)
    rows = flagged.nonzero().squeeze(1)
    wider = min(hopper_topk.BLOCK_N, 4 * c)
    if rows.numel() and wider > c:
        still = []
        for part in rows.split(chunk_tokens):
            v, i, f = merge(candidates(x[part], W_enc, b_enc, wider), sae.k)
            values[part], indices[part] = v.to(values.dtype), i  # index_put does not cast: fp32 merge -> x.dtype
            still.append(part[f])
        rows = torch.cat(still)
    for part in rows.split(chunk_tokens) if rows.numel() else ():
        exact = _recompute(x[part], sae)
        values[part], indices[part] = exact.values.to(values.dtype), exact.indices
    return SparseCodes(values, indices)


@torch.no_grad()
def _encode_tilelang_async(x: torch.Tensor, sae, chunk_tokens: int = CHUNK_TOKENS, *, c: int | None = None,
                           candidates=None, capacity: int | None = None,
                           capacity2: int | None = None) -> tuple[SparseCodes, torch.Tensor]:
    """``_encode_tilelang`` through fixed-capacity buffers: no host sync, and a device flag for rows left out.

    The first ``capacity`` flagged rows (in row order) are gathered into a fixed-size batch, padded with unflagged
    rows, and re-run through the kernel with ``4 c`` candidates; the first ``capacity2`` of those still flagged are
    recomputed (``_recompute``: ``encode_sparse``'s math). Results are scattered back into the output, whose one spare row takes the writes of the padding
    slots (so no two slots write one real row), and the spare row is dropped.

    Args:
        x: ``[N, d_model]``.
        sae: a ``TopKSAE``.
        chunk_tokens: tokens per kernel launch.
        c: candidates per tile of the first pass (None = ``candidates_per_tile``).
        candidates: the candidate source (None = the kernel; tests pass its torch twin).
        capacity: rows re-run wider (None = ``rerun_capacity(N)``); at most N.
        capacity2: rows recomputed (None = ``FALLBACK_ROWS``); at most ``capacity``.
    Returns:
        ``(SparseCodes(values [N, k] x.dtype, indices [N, k] int64), overflow)``: ``overflow`` a 0-dim bool tensor,
        True when more than ``capacity`` rows were flagged or more than ``capacity2`` stayed flagged after the wider
        re-run. When it is False the codes are those of ``_encode_tilelang``.
    """
    operands = _kernel_operands(sae, c, candidates)
    candidates, merge, W_enc, b_enc, c = operands
    n = x.shape[0]
    m = min(n, rerun_capacity(n) if capacity is None else capacity)
    m2 = min(m, FALLBACK_ROWS if capacity2 is None else capacity2)
    if m2 < 0:
        raise ValueError(f"capacity and capacity2 must be >= 0, got {capacity} and {capacity2}")
    values, indices, flagged = _merged_chunks(x, operands, sae.k, chunk_tokens, spare_rows=1)
    rows, valid = _first_set(flagged, m)
    wider = min(hopper_topk.BLOCK_N, 4 * c)
    if wider > c:
        still = torch.empty(m, device=x.device, dtype=torch.bool)
        for start in range(0, m, chunk_tokens):
            part = slice(start, min(start + chunk_tokens, m))
            v, i, f = merge(candidates(x[rows[part]], W_enc, b_enc, wider), sae.k)
            target = torch.where(valid[part], rows[part], n)
            values[target], indices[target] = v.to(values.dtype), i  # index_put does not cast: fp32 merge -> x.dtype
            still[part] = f & valid[part]
    else:
        still = valid
    slots, valid2 = _first_set(still, m2)
    rows2 = rows[slots]
    exact = _recompute(x[rows2], sae)
    target = torch.where(valid2, rows2, n)
    values[target], indices[target] = exact.values.to(values.dtype), exact.indices
    overflow = (flagged.sum() > m) | (still.sum() > m2)
    return SparseCodes(values[:n], indices[:n]), overflow


def _recompute(x: torch.Tensor, sae) -> SparseCodes:
    """``sae.encode_sparse(x)`` for the few rows the kernel could not certify. On CUDA with half-precision ``x`` and
    ``W_enc`` of its dtype: the same fp32-accumulated pre-activations from one half-precision GEMM with fp32 output,
    instead of encode_sparse's fp32 GEMM on a converted copy of W_enc (H200, 64 rows at 2048 -> 32768: 0.07 against
    0.57 ms, paid on every ``fused_encode_async`` call); equal to it up to the fp32 summation order."""
    W_enc = sae.W_enc.detach()
    if not (x.is_cuda and x.dtype in hopper_topk.DTYPES and W_enc.dtype == x.dtype):
        return sae.encode_sparse(x)
    try:
        pre = torch.mm(x, W_enc.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # no out_dtype before torch 2.8
        return sae.encode_sparse(x)
    top = torch.relu_(pre.add_(sae.b_enc.detach().float())).topk(sae.k, dim=1, sorted=True)
    return SparseCodes(top.values.to(x.dtype), top.indices)


def _first_set(mask: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the first ``m`` set entries of ``mask [N]`` (ascending), padded with unset positions, and which
    of them are set: a fixed-size compaction without a host sync (``m <= N``)."""
    order = torch.argsort((~mask).to(torch.uint8), stable=True)[:m]
    return order, mask[order]


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
        v, i, flagged = _merge_on_gpu(cand, k)
        rows = flagged.nonzero().squeeze(1)
        if rows.numel():
            exact = sae.encode_sparse(xc[rows])
            v[rows], i[rows] = exact.values.float(), exact.indices
        values[start : start + xc.shape[0]] = v
        indices[start : start + xc.shape[0]] = i
    return SparseCodes(values, indices)
