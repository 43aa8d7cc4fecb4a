"""Where to read and write inside a Qwen model: family adapters, named hook points, capture and intervention.

Importing this package changes nothing global; hooks exist only inside ``capture`` / ``intervene`` blocks.
"""
from hooks.adapters import HYBRID_FAMILIES, QwenAdapter, get_adapter, supported_families
from hooks.capture import Capture, Intervention, InterventionContext, capture, capture_forward, intervene
from hooks.points import KINDS, HookPoint, parse_hook_name, resid_post, valid_hook_names
from hooks.positions import Positions, parse_positions, position_mask

__all__ = [
    "HYBRID_FAMILIES", "QwenAdapter", "get_adapter", "supported_families",
    "Capture", "Intervention", "InterventionContext", "capture", "capture_forward", "intervene",
    "KINDS", "HookPoint", "parse_hook_name", "resid_post", "valid_hook_names",
    "Positions", "parse_positions", "position_mask",
]
