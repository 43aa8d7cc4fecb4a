"""The hybrid model families the patches know: transformers' Qwen3-Next, Qwen3.5 and Qwen3.5-MoE modeling modules
and the class of each role in them. Every patch module reads its targets from here, so a new family (or a renamed
class) is one line.

Roles: ``gdn`` (the Gated DeltaNet layer), ``norm`` (the zero-centred RMSNorm of the decoder, final and q/k norms),
``mlp`` (the dense ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the decoder MLP, the MoE blocks' shared expert),
``attention`` (the gated full-attention layer: q_proj -> (query, gate) per head, q/k norms, partial RoPE) and
``decoder`` (the decoder layer: input norm -> token mixer -> residual add -> post-attention norm -> MLP -> residual
add). A family whose modeling module this transformers version lacks is skipped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

__all__ = ["Family", "FAMILIES", "ROLES", "class_names", "classes", "modules"]

# role -> the class name after the family's prefix
ROLES = {"gdn": "GatedDeltaNet", "norm": "RMSNorm", "mlp": "MLP", "attention": "Attention",
         "decoder": "DecoderLayer"}


def _qwen3_next() -> ModuleType:
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


def _qwen3_5() -> ModuleType:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _qwen3_5_moe() -> ModuleType:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    return modeling_qwen3_5_moe


@dataclass(frozen=True)
class Family:
    """One hybrid family: its name (``"qwen3_5"``), its modeling module's dotted name, the prefix of its class names
    (``"Qwen3_5"``) and the plain import of the module."""

    name: str
    module_name: str
    prefix: str
    load: Callable[[], ModuleType]

    def class_name(self, role: str) -> str:
        """The family's class name of ``role``: ``"Qwen3_5GatedDeltaNet"`` for qwen3_5's ``"gdn"``."""
        return self.prefix + ROLES[role]

    def module(self) -> ModuleType | None:
        """The modeling module, or None where this transformers version lacks the family."""
        try:
            return self.load()
        except ImportError:
            return None


FAMILIES = (
    Family("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3Next", _qwen3_next),
    Family("qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5", _qwen3_5),
    Family("qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe", _qwen3_5_moe),
)


def class_names(role: str) -> frozenset[str]:
    """Every family's class name of ``role`` (for checks by name that need no transformers import)."""
    return frozenset(f.class_name(role) for f in FAMILIES)


def modules() -> Iterator[tuple[Family, ModuleType]]:
    """(family, modeling module) of every family this transformers version has."""
    for family in FAMILIES:
        module = family.module()
        if module is not None:
            yield family, module


def classes(role: str) -> Iterator[tuple[Family, ModuleType, type]]:
    """(family, modeling module, class) of ``role`` in every family that has it."""
    for family, module in modules():
        cls = getattr(module, family.class_name(role), None)
        if cls is not None:
            yield family, module, cls
