"""Shared pytest setup: offline hub, deterministic seeds, and auto-skipping hardware markers."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads; on a 2-core CI box extra threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _is_hopper() -> bool:
    return _has_cuda() and torch.cuda.get_device_capability()[0] == 9


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_hopper = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(skip_gpu)
        if "hopper" in item.keywords and not _is_hopper():
            item.add_marker(skip_hopper)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
