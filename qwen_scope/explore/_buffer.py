"""A per-feature bounded top-K buffer with context windows, merged one chunk at a time (vectorised).

Used twice by the feature-database builder: once keyed by the activation (top-activating examples) and once keyed by
a random number (priority sampling = a uniform sample without replacement of each feature's firings, from which the
quantile-bin samples are drawn). Memory is ``d_sae * K * (C + small)`` whatever the number of tokens streamed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# Context gatherer: (token_index [M] global, feature [M]) -> (tokens [M, C] int32, values [M, C] float32).
ContextFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class KeyedTopK:
    """For every feature, the K entries with the largest key seen so far, sorted by key (descending).

    Args:
        d_sae: number of features.
        K: entries kept per feature.
        C: context-window length stored per entry.

    Empty slots have ``key = -inf`` and ``token_index = -1``. Context windows live in a pool of ``d_sae * K`` rows;
    ``ptr [d_sae, K]`` points each slot at its row (feature f owns rows ``f*K .. f*K+K-1``), so a merge writes only
    the contexts of new entries instead of moving every window.
    """

    def __init__(self, d_sae: int, K: int, C: int):
        self.d_sae, self.K, self.C = d_sae, K, C
        self.key = torch.full((d_sae, K), float("-inf"), dtype=torch.float64)
        self.value = torch.zeros(d_sae, K, dtype=torch.float32)
        self.token_index = torch.full((d_sae, K), -1, dtype=torch.int64)
        self.ptr = torch.arange(d_sae * K).reshape(d_sae, K)
        self.pool_tokens = torch.full((d_sae * K, C), -1, dtype=torch.int32)
        self.pool_values = torch.zeros(d_sae * K, C, dtype=torch.float32)

    @property
    def ctx_tokens(self) -> torch.Tensor:
        """``[d_sae, K, C]`` context token ids per slot (-1 outside the document)."""
        return self.pool_tokens[self.ptr]

    @property
    def ctx_values(self) -> torch.Tensor:
        """``[d_sae, K, C]`` the feature's activation on each context token."""
        return self.pool_values[self.ptr]

    def update(self, feature: torch.Tensor, key: torch.Tensor, value: torch.Tensor, token_index: torch.Tensor,
               context: ContextFn) -> None:
        """Offer M candidate entries; keep the K largest keys per feature.

        Args:
            feature: ``[M]`` int64 feature ids.
            key: ``[M]`` float64 ranking keys (distinct keys recommended; ties keep the earlier entry).
            value: ``[M]`` activation values.
            token_index: ``[M]`` global token indices.
            context: gathers context windows for the accepted new entries only.
        """
        keep = key > self.key[feature, -1]
        if not bool(keep.any()):
            return
        feature, key, value, token_index = feature[keep], key[keep], value[keep], token_index[keep]
        # Sorted distinct features; a bincount is much cheaper than torch.unique's sort.
        touched = torch.nonzero(torch.bincount(feature, minlength=self.d_sae)).flatten()
        U, K = touched.numel(), self.K
        # Candidates: the K old slots of each touched feature (pointer -1 - (u*K + j)) and new entries (pointer m).
        old_key = self.key[touched]  # [U, K]
        all_feature = torch.cat([touched.repeat_interleave(K), feature])
        all_key = torch.cat([old_key.reshape(-1), key])
        pointer = torch.cat([-1 - torch.arange(U * K), torch.arange(feature.numel())])
        # Old slots come first, so a stable sort keeps an old entry ahead of a new one with an equal key.
        order = torch.sort(all_key, descending=True, stable=True).indices
        order = order[torch.sort(all_feature[order], stable=True).indices]
        sorted_feature = all_feature[order]
        group_start = torch.searchsorted(sorted_feature, sorted_feature, right=False)
        rank = torch.arange(order.numel()) - group_start
        chosen = pointer[order[rank < K]].reshape(U, K)
        self._commit(touched, chosen, key, value, token_index, feature, context)

    def _commit(self, touched, chosen, key, value, token_index, feature, context: ContextFn) -> None:
        U, K = chosen.shape
        is_new = chosen >= 0
        old = (-1 - chosen).clamp(min=0)  # local old slot u*K + j
        new = chosen.clamp(min=0)
        old_ptr = self.ptr[touched].reshape(-1)
        kept = torch.zeros(U * K, dtype=torch.bool)
        kept[old[~is_new]] = True
        # Row u frees exactly as many pool rows as it gains new entries; pair them in row-major order.
        freed = old_ptr[~kept]
        ptr = old_ptr[old]
        ptr[is_new] = freed
        self.key[touched] = torch.where(is_new, key[new], self.key[touched].reshape(-1)[old])
        self.value[touched] = torch.where(is_new, value[new], self.value[touched].reshape(-1)[old])
        self.token_index[touched] = torch.where(is_new, token_index[new], self.token_index[touched].reshape(-1)[old])
        self.ptr[touched] = ptr
        if bool(is_new.any()):
            m = new[is_new]
            tok, val = context(token_index[m], feature[m])
            self.pool_tokens[freed] = tok
            self.pool_values[freed] = val

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The buffer's tensors under ``prefix.`` names (for safetensors)."""
        return {f"{prefix}.{name}": getattr(self, name).contiguous() for name in _STATE}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str) -> KeyedTopK:
        key = state[f"{prefix}.key"]
        buf = cls(key.shape[0], key.shape[1], state[f"{prefix}.pool_tokens"].shape[1])
        for name in _STATE:
            setattr(buf, name, state[f"{prefix}.{name}"])
        return buf


_STATE = ("key", "value", "token_index", "ptr", "pool_tokens", "pool_values")
