"""Gated delta rule: reference, Hopper kernels and the public API."""
