"""The TopK sparse autoencoder of Qwen-Scope: weights in the release orientation, exact encode/decode math.

Math (release orientation, ``x`` a residual-stream vector of size d_model)::

    pre  = W_enc x + b_enc                      # [d_sae], no b_dec subtraction, no normalisation
    z    = TopK_k(ReLU(pre))                    # keep the k largest of ReLU(pre), zero the rest
    x̂    = W_dec z + b_dec                      # [d_model]

ReLU-then-TopK equals TopK-then-ReLU (sae-lens) exactly, so ``encode`` matches sae-lens and the official demo.

Edge cases, on purpose:
- **Fewer than k positive pre-activations**: only the positive ones are non-zero in ``encode``. ``encode_sparse``
  still returns exactly k slots; the surplus slots carry value ``0`` with a valid (arbitrary) feature index, so they
  decode to nothing and are never an "active" feature (test ``values > 0`` for activity).
- **Ties at the k-th value**: exactly k slots are kept; which of several equal features wins is the choice of
  ``torch.topk`` (unspecified). The multiset of kept values is always the k largest.
- **Precision**: by default the math runs in ``promote(input dtype, weight dtype, float32)`` — so bf16/fp16 inputs are
  computed in fp32 and fp64 inputs in fp64 — and results come back in the input dtype. Set ``compute_dtype`` to force
  one dtype (e.g. ``torch.bfloat16`` for a bf16 bank on GPU, which avoids casting the weights on every call).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

RELEASE_KEYS = ("W_enc", "W_dec", "b_enc", "b_dec")


class SparseCodes(NamedTuple):
    """Top-k SAE codes in the form to store: ``values [..., k]`` and ``indices [..., k]`` (int64).

    Slots with ``values == 0`` are padding (fewer than k positive pre-activations); they are not active features.
    """

    values: torch.Tensor
    indices: torch.Tensor

    def to_dense(self, d_sae: int) -> torch.Tensor:
        """Scatter into a dense ``[..., d_sae]`` tensor (dtype of ``values``)."""
        out = self.values.new_zeros(*self.values.shape[:-1], d_sae)
        return out.scatter_(-1, self.indices, self.values)

    def to(self, *args, **kwargs) -> SparseCodes:
        """Move both tensors (dtype arguments apply to ``values`` only; indices stay int64)."""
        values = self.values.to(*args, **kwargs)
        return SparseCodes(values, self.indices.to(values.device))

    @property
    def k(self) -> int:
        return self.values.shape[-1]


def _is_int_index(index) -> bool:
    if isinstance(index, bool):
        return False
    if isinstance(index, torch.Tensor):
        return index.ndim == 0 and not index.is_floating_point() and index.dtype != torch.bool
    try:
        operator.index(index)
        return True
    except TypeError:
        return False


class _DecoderWeight(nn.Parameter):
    """``W_dec [d_model, d_sae]``: ``W_dec[f]`` (sae-lens's "decoder row of feature f") is refused, with the fix;
    every other use is a plain Parameter."""

    def __getitem__(self, index):
        first = index[0] if isinstance(index, tuple) and len(index) == 1 else index
        if _is_int_index(first):
            raise IndexError(f"W_dec[{first}]: W_dec is [d_model, d_sae] here (the release layout; sae-lens keeps "
                             f"[d_sae, d_model]), so a row is not a feature. Feature f's direction is W_dec[:, f] or "
                             f"sae.decoder_directions(f)")
        return super().__getitem__(index)


class _EncoderWeight(nn.Parameter):
    """``W_enc [d_sae, d_model]``: ``W_enc[:, f]`` (sae-lens's "encoder column of feature f") is refused."""

    def __getitem__(self, index):
        if isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None) and _is_int_index(index[1]):
            raise IndexError(f"W_enc[:, {index[1]}]: W_enc is [d_sae, d_model] here (the release layout; sae-lens "
                             f"keeps [d_in, d_sae]), so a column is not a feature. Feature f's encoder row is "
                             f"W_enc[f]")
        return super().__getitem__(index)


@dataclass(frozen=True)
class SAEConfig:
    """What an SAE is, in sae-lens's field names (``sae.cfg``), so sae-lens habits carry over.

    Attributes:
        d_in: residual width it reads (d_model).
        d_sae: number of features.
        k: features kept per token.
        hook_name: the TransformerLens spelling of its site, ``blocks.{layer}.hook_resid_post`` (None without a layer).
        release: sae-lens release id (None for an SAE not loaded from a release).
        layer: decoder block whose output it reads (None when unknown).
        architecture: always ``"topk"``.
    """

    d_in: int
    d_sae: int
    k: int
    hook_name: str | None
    release: str | None
    layer: int | None
    architecture: str = "topk"


class TopKSAE(nn.Module):
    """A TopK SAE holding Qwen-Scope weights in the release orientation.

    Orientation (read this if you come from sae-lens): the tensors are kept as the released files store them,
    ``W_enc [d_sae, d_model]`` (row per feature) and ``W_dec [d_model, d_sae]`` (column per feature) — the transpose
    of sae-lens's ``W_enc [d_in, d_sae]`` / ``W_dec [d_sae, d_in]``. Feature f's decoder direction is
    ``sae.W_dec[:, f]``, or ``sae.decoder_directions(f)``; sae-lens's ``W_dec[f]`` is refused here with that hint
    instead of returning a row of another meaning (and so is ``W_enc[:, f]``). ``to_sae_lens`` converts.

    Args:
        W_enc: encoder ``[d_sae, d_model]`` (row per feature).
        W_dec: decoder ``[d_model, d_sae]`` (column per feature).
        b_enc: encoder bias ``[d_sae]``.
        b_dec: decoder bias ``[d_model]``.
        k: number of features kept per token (``1 <= k <= d_sae``).
        compute_dtype: dtype the math runs in; ``None`` (default) = ``promote(input, weights, float32)``.

    Example:
        >>> sae = TopKSAE.from_release_state(torch.load("layer12.sae.pt", weights_only=True), k=100)
        >>> codes = sae.encode_sparse(resid)          # resid [B, T, d_model] -> values/indices [B, T, 100]
        >>> recon = sae.decode(codes)                 # [B, T, d_model]
    """

    def __init__(self, W_enc: torch.Tensor, W_dec: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor, k: int,
                 *, compute_dtype: torch.dtype | None = None):
        super().__init__()
        _check_release_shapes({"W_enc": W_enc, "W_dec": W_dec, "b_enc": b_enc, "b_dec": b_dec}, "TopKSAE(...)")
        d_sae = W_enc.shape[0]
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d_sae:
            raise ValueError(f"k must be an int in [1, d_sae={d_sae}], got {k!r}")
        # a plain Tensor in: torch < 2.13 refuses to build a Parameter subclass from another subclass instance (such
        # as another SAE's W_enc) whose detach() returns a plain Tensor
        self.W_enc = _EncoderWeight(W_enc.as_subclass(torch.Tensor))
        self.W_dec = _DecoderWeight(W_dec.as_subclass(torch.Tensor))
        self.b_enc = nn.Parameter(b_enc)
        self.b_dec = nn.Parameter(b_dec)
        self.k = k
        self.compute_dtype = compute_dtype
        # Provenance, filled in by saes.load(): the Release (or None), the layer and the file it came from.
        self.release = None
        self.layer: int | None = None
        self.source: str | None = None

    # ------------------------------------------------------------------ construction / export
    @classmethod
    def from_release_state(cls, state_dict: Mapping[str, torch.Tensor], k: int, **kwargs) -> TopKSAE:
        """Build from a dict in the release layout (``W_enc, W_dec, b_enc, b_dec``; extra keys are ignored)."""
        missing = [key for key in RELEASE_KEYS if key not in state_dict]
        if missing:
            raise KeyError(f"SAE state dict lacks {missing}; expected keys {list(RELEASE_KEYS)}, "
                           f"got {sorted(state_dict)}")
        return cls(*(state_dict[key] for key in RELEASE_KEYS), k=k, **kwargs)

    def release_state(self) -> dict[str, torch.Tensor]:
        """The weights as a dict in the release layout (detached, contiguous; what ``layer{n}.sae.pt`` holds)."""
        return {key: getattr(self, key).detach().contiguous() for key in RELEASE_KEYS}

    @property
    def d_model(self) -> int:
        return self.W_enc.shape[1]

    @property
    def cfg(self) -> SAEConfig:
        """sae-lens-style config: ``d_in``, ``d_sae``, ``k``, ``hook_name``, ``release``, ``layer``."""
        release = getattr(self.release, "id", None)
        hook = f"blocks.{self.layer}.hook_resid_post" if self.layer is not None else None
        return SAEConfig(self.d_model, self.d_sae, self.k, hook, release, self.layer)

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def extra_repr(self) -> str:
        where = f", release={self.release.id}, layer={self.layer}" if self.release is not None else ""
        return f"d_model={self.d_model}, d_sae={self.d_sae}, k={self.k}, dtype={self.dtype}{where}"

    # ------------------------------------------------------------------ math
    def _compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.promote_types(torch.promote_types(dtype, self.W_enc.dtype), torch.float32)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"expected a floating-point tensor [..., d_model={self.d_model}], got "
                            f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of ' + str(x.dtype)}")
        if x.shape[-1:] != (self.d_model,):
            raise ValueError(f"input has last dim {tuple(x.shape)[-1:] or '()'} but this SAE expects d_model="
                             f"{self.d_model} (shape [..., {self.d_model}]); is it the right layer/model?")

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """Raw pre-activations ``W_enc x + b_enc`` (no ReLU, no top-k).

        Args:
            x: residual stream ``[..., d_model]``.
        Returns:
            ``[..., d_sae]`` in the dtype of ``x``.
        """
        self._check_input(x)
        return self._pre_acts(x).to(x.dtype)

    def _pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        cd = self._compute_dtype(x.dtype)
        return F.linear(x.to(cd), self.W_enc.to(cd), self.b_enc.to(cd))

    def _topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(torch.relu(self._pre_acts(x)), self.k, dim=-1, sorted=True)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Dense codes ``TopK(ReLU(W_enc x + b_enc))``.

        Args:
            x: residual stream ``[..., d_model]``.
        Returns:
            ``[..., d_sae]`` in the dtype of ``x``, at most k non-zeros per row.
        """
        self._check_input(x)
        values, indices = self._topk(x)
        return SparseCodes(values, indices).to_dense(self.d_sae).to(x.dtype)

    def encode_sparse(self, x: torch.Tensor) -> SparseCodes:
        """Top-k codes as ``SparseCodes(values [..., k], indices [..., k] int64)``, values sorted descending.

        Args:
            x: residual stream ``[..., d_model]``.
        Returns:
            ``SparseCodes``; ``values`` in the dtype of ``x``. Zero-valued slots are padding (see module doc).
        """
        self._check_input(x)
        values, indices = self._topk(x)
        return SparseCodes(values.to(x.dtype), indices)

    def feature_codes(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The codes of chosen features, ``encode(x).gather(-1, features)``, without a top-k selection.

        A feature's code is its ReLU pre-activation when fewer than k features have a larger one, else 0: one
        comparison pass over d_sae per token instead of sorting out the top k (what steering by clamping needs at
        every decode step). The two agree except where a positive pre-activation ties the k-th largest exactly:
        ``torch.topk`` keeps an arbitrary subset of the tied features, this keeps them all.

        Args:
            x: residual stream ``[..., d_model]``.
            features: int64 ``[..., E]`` feature indices (leading dims broadcast against ``x``'s).
        Returns:
            ``[..., E]`` in the dtype of ``x``.
        """
        self._check_input(x)
        pre = torch.relu(self._pre_acts(x))  # [..., d_sae]
        chosen = pre.gather(-1, features.expand(*pre.shape[:-1], features.shape[-1]))  # [..., E]
        # one feature at a time keeps the comparison at the size of ``pre`` (E is a handful of edits)
        above = torch.stack([(pre > chosen[..., j, None]).sum(-1) for j in range(chosen.shape[-1])], dim=-1)
        return torch.where(above < self.k, chosen, torch.zeros_like(chosen)).to(x.dtype)

    def decode(self, z: torch.Tensor | SparseCodes) -> torch.Tensor:
        """Reconstruction ``W_dec z + b_dec`` from dense codes or ``SparseCodes``.

        Args:
            z: dense ``[..., d_sae]`` or ``SparseCodes`` with ``values/indices [..., k']`` (any k').
        Returns:
            ``[..., d_model]`` in the dtype of ``z`` (of ``z.values`` for sparse codes).
        """
        if isinstance(z, SparseCodes):
            return self._decode_sparse(z)
        if not isinstance(z, torch.Tensor) or not z.is_floating_point():
            raise TypeError(f"decode expects a float tensor [..., d_sae={self.d_sae}] or SparseCodes, got {type(z)}")
        if z.shape[-1:] != (self.d_sae,):
            raise ValueError(f"codes have last dim {tuple(z.shape)[-1:]} but this SAE has d_sae={self.d_sae}")
        cd = self._compute_dtype(z.dtype)
        return F.linear(z.to(cd), self.W_dec.to(cd), self.b_dec.to(cd)).to(z.dtype)

    def _decode_sparse(self, codes: SparseCodes, *, checked: bool = False) -> torch.Tensor:
        values, indices = codes
        if values.shape != indices.shape:
            raise ValueError(f"SparseCodes values {tuple(values.shape)} and indices {tuple(indices.shape)} differ")
        # the range check reads the indices on the host (a device sync); codes from our own top-k skip it
        if indices.numel() and not checked:
            lo, hi = (int(v) for v in torch.aminmax(indices))
            if lo < 0 or hi >= self.d_sae:
                raise ValueError(f"SparseCodes indices must lie in [0, {self.d_sae}), got [{lo}, {hi}]")
        cd = self._compute_dtype(values.dtype)
        lead, k = values.shape[:-1], values.shape[-1]
        # Gather only the k decoder columns per token: N*k*d_model work instead of N*d_sae*d_model. Columns of the
        # row-major W_dec are strided, so for many tokens one transposed copy first is far cheaper (measured: 4096
        # tokens of a 2048x32768 SAE on an H200, 19.6 ms strided vs 2.4 ms with the copy; CPU is worse still).
        rows = self.W_dec.to(cd).T
        if indices.numel() * 8 >= self.d_sae:
            rows = rows.contiguous()
        out = F.embedding_bag(indices.reshape(-1, k), rows, mode="sum", per_sample_weights=values.reshape(-1, k).to(cd))
        out = out + self.b_dec.to(cd)
        return out.reshape(*lead, self.d_model).to(values.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction ``decode(encode(x))``: ``[..., d_model]`` -> ``[..., d_model]`` in the dtype of ``x``."""
        self._check_input(x)
        values, indices = self._topk(x)
        return self._decode_sparse(SparseCodes(values, indices), checked=True).to(x.dtype)

    def error(self, x: torch.Tensor) -> torch.Tensor:
        """SAE error ``x - forward(x)`` (what an error-term splice adds back): ``[..., d_model]``, dtype of ``x``."""
        self._check_input(x)
        values, indices = self._topk(x)
        recon = self._decode_sparse(SparseCodes(values, indices), checked=True)
        return (x.to(recon.dtype) - recon).to(x.dtype)

    def decoder_directions(self, ids: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Decoder columns of features ``ids`` as rows: ``[n, d_model]`` (a single int gives ``[1, d_model]``).

        Raw, unnormalised columns in the weight dtype — the official steering vector is ``W_dec[:, i]``.
        """
        idx = torch.as_tensor([ids] if isinstance(ids, int) else ids, dtype=torch.long, device=self.W_dec.device)
        idx = idx.reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.d_sae):
            raise ValueError(f"feature ids must lie in [0, {self.d_sae}), got {idx.tolist()[:10]}")
        return self.W_dec.detach()[:, idx].T.contiguous()

    def decoder_norms(self) -> torch.Tensor:
        """L2 norm of every decoder column, ``[d_sae]`` in fp32 (Qwen-Scope does not guarantee unit norms)."""
        return self.W_dec.detach().float().norm(dim=0)


def _check_release_shapes(state: Mapping[str, torch.Tensor], where: str) -> tuple[int, int]:
    """Check the four release tensors agree with one another; return ``(d_model, d_sae)``. Errors name ``where``."""
    for key in RELEASE_KEYS:
        t = state[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{where}: {key} must be a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{where}: {key} must be a dense tensor, got layout {t.layout}; convert with .to_dense()")
    w_enc, w_dec, b_enc, b_dec = (state[key] for key in RELEASE_KEYS)
    if w_enc.ndim != 2:
        raise ValueError(f"{where}: W_enc must be [d_sae, d_model], got shape {tuple(w_enc.shape)}")
    d_sae, d_model = w_enc.shape
    expected = {"W_dec": (d_model, d_sae), "b_enc": (d_sae,), "b_dec": (d_model,)}
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            hint = " (looks transposed: sae-lens orientation? use saes.from_sae_lens)" \
                if tuple(state[key].shape) == shape[::-1] else ""
            raise ValueError(f"{where}: {key} has shape {tuple(state[key].shape)}, expected {shape} given W_enc "
                             f"[d_sae={d_sae}, d_model={d_model}]{hint}")
    return d_model, d_sae
