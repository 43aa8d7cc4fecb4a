"""Sparse autoencoders: TopK math, the Qwen-Scope release registry, loading, sae-lens interop, training."""
from saes.registry import Release, get_release, list_releases, parse_repo_id
from saes.topk import SparseCodes, TopKSAE

__all__ = [
    "Release", "SparseCodes", "TopKSAE", "get_release", "list_releases", "parse_repo_id",
]
