"""Shared pieces of the Hopper stages: the sm_90a target, pass configs, dtype names and the kernel cache.

Every stage module builds a TileLang ``prim_func`` from a few integers and dtype names and compiles it once per
specialisation through :func:`compile_kernel`. Compiling needs nvcc but no GPU, so CI can build every kernel.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import tilelang
import torch
from tvm.target import Target

CHUNK = 64
LOG2E = 1.4426950408889634

TARGET = {"kind": "cuda", "arch": "sm_90a"}
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def tl_dtype(dtype: torch.dtype) -> str:
    """TileLang's name for a torch dtype (bfloat16, float16 or float32)."""
    return _TORCH_TO_TL[dtype]


def trailing_flags(*flags: bool) -> tuple:
    """A builder's optional trailing bool flags without the trailing False ones, so a kernel keeps the compile-cache
    key it had before later flags existed (``trailing_flags(False, True, False) == (False, True)``)."""
    flags = list(flags)
    while flags and not flags[-1]:
        flags.pop()
    return tuple(flags)


def compile_kernel(builder: Callable, *args):
    """Compile ``builder(*args)`` for sm_90a once per argument tuple; returns the callable JIT kernel."""
    return _compile_cached(builder, tuple(args))


@functools.lru_cache(maxsize=None)
def _compile_cached(builder: Callable, args: tuple):
    func = builder(*args)
    configs = {**PASS_CONFIGS, **getattr(builder, "pass_configs", {})}
    return tilelang.compile(func, target=Target(TARGET), pass_configs=configs)
