"""The dispatch helpers on CPU: the device query under ``torch.compile``."""
from __future__ import annotations

import ctypes

import torch

from flashqla_kernels import dispatch


def test_device_capability_is_a_constant_under_a_fullgraph_compile(monkeypatch):
    """torch.compile takes the capability as a constant instead of tracing the query (a traced get_device_name
    returns a str and breaks a fullgraph compile of the public op); ctypes stands in for a query dynamo cannot
    trace."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"H{ctypes.c_int(200).value}")
    dispatch._capability.cache_clear()

    def step(x):
        (major, minor), name = dispatch._capability(torch.device("cuda", 0))
        return x * major + minor if name == "H200" else x

    try:
        got = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2))
    finally:
        dispatch._capability.cache_clear()
    assert torch.equal(got, torch.full((2,), 9.0))
