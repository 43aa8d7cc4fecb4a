"""Sparse autoencoders: TopK math, the Qwen-Scope release registry, loading, sae-lens interop, training."""
