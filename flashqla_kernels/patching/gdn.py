"""The GDN layers' whole forward on the fused path (``flashqla_kernels.decoder.gdn_layer_forward``).

The replacement accepts the layer's call in every 5.17-5.24 spelling (``cache_params=`` up to 5.23, ``cache=`` from
5.24) and hands the call back to transformers' own forward whenever ``layer_unsupported_reason`` names a reason, so
it composes with the op patch (``op``): the fallback runs whatever chunk / recurrent functions are patched in.
"""
from __future__ import annotations

import inspect

from flashqla_kernels.decoder.gdn_layer import gdn_layer_forward, layer_unsupported_reason
from flashqla_kernels.patching import registry

__all__ = ["ROLE", "GROUP", "make_forward"]

ROLE = GROUP = "gdn"


def make_forward(original, backend: str | None):
    """The fused GDN forward replacing ``original`` (transformers' ``forward`` of a GDN class)."""
    # the cache argument's name in transformers' forward: "cache" (5.24+) or "cache_params" (<= 5.23)
    cache_name = "cache" if "cache" in inspect.signature(original).parameters else "cache_params"

    def forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        cache = cache if cache is not None else cache_params
        if layer_unsupported_reason(self, cache, kwargs) is not None:
            return original(self, hidden_states, attention_mask=attention_mask, **{cache_name: cache}, **kwargs)
        return gdn_layer_forward(self, hidden_states, cache, attention_mask, backend=backend)

    forward.__doc__ = f"flashqla_kernels fused GDN layer (backend={backend!r}); falls back to transformers' forward."
    return registry.mark(forward, backend, original)
