"""The Gated DeltaNet op: float64 reference, fused TileLang Hopper kernels, FLA/FlashQLA-compatible API, transformers patch.

Importing this package touches neither CUDA nor tilelang.
"""
