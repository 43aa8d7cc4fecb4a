"""The one TileLang toolkit every kernel of the project builds with: the sm_90a target, pass configs, TileLang's dtype
names, the compile cache, and output allocation that tests can poison with NaN.

A kernel module defines ``build_<name>(*ints_and_dtype_names) -> prim_func`` and its launcher calls
``compile_kernel(build_<name>, *args)``: compiled once per argument tuple per process (and TileLang's disk cache
across processes). Compiling needs nvcc but no GPU, so CI on a CPU machine builds every kernel.

Importing this module does not import tilelang (the kernels' modules do, on their first call), so the dispatcher and
the public ops can import it anywhere.

``FLASHQLA_KERNELS_DIRECT_LAUNCH=1`` makes compiled kernels call TileLang's TVM FFI executable directly
(``DirectKernel``), without its Python adapter.

Example:
    >>> from flashqla_kernels import toolkit
    >>> kernel = toolkit.compile_kernel(build_rms_norm, 2048, toolkit.tl_dtype(torch.bfloat16), 1e-6)
    >>> y = toolkit.empty_like(x)                # NaN-filled inside ``with toolkit.poisoned_outputs():``
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch

__all__ = ["TARGET", "LOG2E", "DIRECT_LAUNCH", "DirectKernel", "tl_dtype", "pass_configs", "compile_kernel",
           "compile_many", "poisoned_outputs", "empty", "empty_like", "unread"]

TARGET = {"kind": "cuda", "arch": "sm_90a"}
LOG2E = 1.4426950408889634

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_poison = False
# A call of TileLang's JIT kernel goes through its Python adapter (about 7 us on a CPU: it walks the parameters to
# place outputs, which no kernel here asks it to allocate) before the TVM FFI executable, which checks every argument
# in C and launches. With FLASHQLA_KERNELS_DIRECT_LAUNCH=1 (read at import) calls go to the executable itself; off by
# default until a GPU run has compared the two.
DIRECT_LAUNCH = os.environ.get("FLASHQLA_KERNELS_DIRECT_LAUNCH") == "1"


def tl_dtype(dtype: torch.dtype) -> str:
    """TileLang's name for a torch dtype (bfloat16, float16 or float32).

    Raises:
        ValueError: for any other dtype.
    """
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError:
        raise ValueError(f"no TileLang kernel takes {dtype}; expected one of {tuple(_TORCH_TO_TL)}") from None


def pass_configs(fast_math: bool = True) -> dict:
    """The pass configs every kernel compiles with; ``fast_math`` (default on) maps exp2 / rsqrt to the fast
    hardware instructions, which the kernels' error budgets assume."""
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: fast_math}


def compile_kernel(builder: Callable, *args):
    """Compile ``builder(*args)`` for sm_90a once per argument tuple; returns the callable JIT kernel.

    A builder may carry a ``pass_configs`` dict attribute that overrides the defaults of :func:`pass_configs`.
    """
    return _compile_cached(builder, tuple(args))


def compile_many(specs, workers: int = 1) -> list[tuple[Callable, tuple, str]]:
    """Compile every ``(builder, args)`` of ``specs`` into TileLang's disk cache, each once, in a fixed order; with
    ``workers`` > 1 on that many spawned processes (each nvcc run is single-threaded, so a CPU machine filling a
    cache for a GPU one goes about ``workers`` times faster). A kernel that fails does not stop the others.

    Returns:
        The failures, as (builder, args, error text); empty when every kernel compiled.
    """
    specs = sorted({(b, tuple(a)) for b, a in specs}, key=lambda s: (s[0].__name__, str(s[1])))
    if workers <= 1:
        errors = [_compile_reporting(spec) for spec in specs]
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            errors = list(ex.map(_compile_reporting, specs))
    return [(b, a, err) for (b, a), err in zip(specs, errors) if err]


def _compile_reporting(spec) -> str | None:
    builder, args = spec
    try:
        compile_kernel(builder, *args)
    except Exception as e:  # noqa: BLE001 - returned: the caller reports every failure at once
        return f"{type(e).__name__}: {str(e)[-300:]}"
    return None


@functools.lru_cache(maxsize=None)
def _compile_cached(builder: Callable, args: tuple):
    import tilelang
    from tvm.target import Target

    configs = {**pass_configs(), **getattr(builder, "pass_configs", {})}
    kernel = tilelang.compile(builder(*args), target=Target(TARGET), pass_configs=configs)
    return DirectKernel(kernel) if DIRECT_LAUNCH and DirectKernel.applies(kernel) else kernel


class DirectKernel:
    """A compiled kernel whose calls go straight to its TVM FFI executable (``DIRECT_LAUNCH``); everything else
    (``get_kernel_source`` and the rest) is the JIT kernel's."""

    __slots__ = ("jit", "_run")

    def __init__(self, jit):
        self.jit = jit
        self._run = jit.adapter._get_executable()

    @staticmethod
    def applies(jit) -> bool:
        """The executable takes exactly the kernel's arguments: TVM FFI's adapter, no outputs it allocates."""
        adapter = getattr(jit, "adapter", None)
        return hasattr(adapter, "_get_executable") and not getattr(adapter, "result_idx", None)

    def __call__(self, *args):
        return self._run(*args)

    def __getattr__(self, name):
        return getattr(self.jit, name)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Inside, every kernel output is allocated filled with NaN (integers with -1), so a test proves each element is
    written. Restores the previous setting on exit."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for a kernel's output (NaN / -1 filled under :func:`poisoned_outputs`)."""
    if _poison:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous output with ``x``'s shape and device (and ``dtype`` or x's), poisoned as :func:`empty`."""
    return empty(x.shape, dtype or x.dtype, x.device)


def unread(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A kernel argument its specialisation never reads or writes (an absent h0, l2norm factors without l2norm, a
    final state not asked for): one tensor per (shape, dtype, device), kept, so a call allocates nothing for it.
    Under :func:`poisoned_outputs` a fresh NaN / -1 filled one instead, so a kernel that does read it shows NaN."""
    if _poison:
        return empty(shape, dtype, device)
    return _unread(tuple(shape), dtype, device)


@functools.lru_cache(maxsize=128)
def _unread(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
