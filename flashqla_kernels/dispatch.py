"""One dispatcher for every op that has a TileLang kernel (the GDN chunk op, the decoder's glue stages, the SAE encode).

An op states its kernel's requirements as *verifiers*: zero-argument callables that return ``None`` when the
kernel can take the inputs, or one sentence naming the obstacle and the fix. ``decide`` runs them in order and
returns a :class:`Decision`; ``explain`` renders the same decision as text for the user.

``backend``: ``None`` picks the kernel when every verifier passes and the torch formulation otherwise; ``"torch"``
always runs torch; ``"tilelang"`` runs the kernel or raises one ``ValueError`` naming the reason. Inputs that require
grad are a verifier of their own (``grad=``) for the ops whose kernels are forward-only (the decoder's glue stages,
the recurrent GDN step): such a call takes the differentiable torch path, and the decision says so
(``grad_fallback``). An op with a backward kernel (the GDN chunk op) passes no ``grad=`` tensors.

Importing this module touches neither CUDA nor tilelang.

Example:
    >>> d = decide("rms_norm", None, lambda: hopper_reason(x), lambda: width_reason(x), grad=(x,))
    >>> d.backend, d.reasons
    ('torch', ('tilelang: not used: tensors are on cpu; ...', 'torch: runs every input the op accepts'))
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Backend", "BACKENDS", "Decision", "Verifier", "check_backend", "hopper_reason", "grad_reason", "decide",
           "explain"]

Backend = Literal["tilelang", "torch"]
# in order of preference for backend=None
BACKENDS: tuple[str, ...] = ("tilelang", "torch")
Verifier = Callable[[], "str | None"]


def check_backend(backend: str | None) -> None:
    """Raise ValueError unless ``backend`` is None, "tilelang" or "torch"."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None (automatic), 'tilelang' or 'torch'; got {backend!r}")


# a device's capability never changes: torch.compile calls this once while tracing and keeps the result as a
# constant (traced, torch.cuda.get_device_name returns a str, which breaks a fullgraph compile of the public op)
@functools.lru_cache(maxsize=16)
@torch.compiler.assume_constant_result
def _capability(device: torch.device) -> tuple[tuple[int, int], str]:
    return torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)


def hopper_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why tensors cannot go to an sm_90a kernel (not all on one CUDA device, or not an sm_90 GPU), or None.

    ``None`` entries are skipped.
    """
    xs = [x for x in tensors if x is not None]
    if not xs:
        return None
    if not all(x.is_cuda for x in xs):
        devices = sorted({str(x.device) for x in xs})
        return f"tensors are on {', '.join(devices)}; the TileLang kernels run on CUDA tensors of an sm_90 GPU only"
    if len({x.device for x in xs}) > 1:
        return f"tensors are on several devices {sorted({str(x.device) for x in xs})}; move them to one"
    device = xs[0].device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    (major, minor), name = _capability(device)
    if (major, minor) != (9, 0):
        return f"the TileLang kernels are built for sm_90a; {name} is sm_{major}{minor}"
    return None


def grad_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why a forward-only kernel must not run (an input requires grad under grad mode), or None."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        return "an input requires grad and this TileLang kernel is forward-only"
    return None


@dataclass(frozen=True)
class Decision:
    """What ``decide`` chose for one call.

    Attributes:
        op: the op's name, as the user knows it. backend: "tilelang" or "torch". reasons: one line per backend
        considered. grad_fallback: torch was chosen only because an input requires grad.
    """

    op: str
    backend: str
    reasons: tuple[str, ...]
    grad_fallback: bool = False

    @property
    def kernel(self) -> bool:
        """Whether the TileLang kernel runs."""
        return self.backend == "tilelang"

    def explain(self) -> str:
        """``"<op>: backend <name>"`` and one indented line per reason."""
        return "\n".join([f"{self.op}: backend {self.backend}", *("  " + r for r in self.reasons)])


_TORCH_ASKED = ("torch: requested with backend='torch'",)
_KERNEL_OK = ("tilelang: every verifier passed",)


def decide(op: str, backend: str | None, *verifiers: Verifier, grad: tuple = ()) -> Decision:
    """Choose the backend of one call of ``op``.

    Args:
        op: the op's name (for messages). backend: None, "tilelang" or "torch".
        verifiers: zero-argument callables, each returning None or the reason the kernel cannot run; run in order,
            the first reason decides (later ones are not evaluated).
        grad: the call's tensors; any requiring grad under grad mode sends the call to torch (``grad_fallback``).

    Returns:
        The :class:`Decision`.

    Raises:
        ValueError: an unknown ``backend``, or ``backend="tilelang"`` with a reason.
    """
    check_backend(backend)
    if backend == "torch":
        return Decision(op, "torch", _TORCH_ASKED)
    for verify in verifiers:
        reason = verify()
        if reason is not None:
            return _fallback(op, backend, reason)
    reason = grad_reason(*grad)
    if reason is not None:
        return _fallback(op, backend, reason, grad_fallback=True)
    return Decision(op, "tilelang", _KERNEL_OK)


def _fallback(op: str, backend: str | None, reason: str, grad_fallback: bool = False) -> Decision:
    if backend == "tilelang":
        fix = ("run under torch.no_grad() or detach the inputs, or pass backend=None for the differentiable torch path"
               if grad_fallback else "pass backend=None to fall back to the torch path automatically")
        raise ValueError(f"backend='tilelang' cannot run {op} on these inputs: {reason}; {fix}")
    torch_line = "torch: differentiable fallback" if grad_fallback else "torch: runs every input the op accepts"
    return Decision(op, "torch", (f"tilelang: not used: {reason}", torch_line), grad_fallback)


def explain(op: str, backend: str | None, *verifiers: Verifier, grad: tuple = ()) -> str:
    """``decide(...).explain()``, or ``"<op>: error: ..."`` where ``decide`` would raise."""
    try:
        return decide(op, backend, *verifiers, grad=grad).explain()
    except ValueError as err:
        return f"{op}: error: {err}"
