"""Steered generation on static buffers: a decode engine whose step is one CUDA graph replayed per token.

    from qwen_scope.engine import DecodeEngine
    engine = DecodeEngine(scope.model, scope.saes)
    result = engine.generate([ids], edits=[[add(12, 4242, 20.0)]], max_new_tokens=64)

Modules, one job each: ``state`` (preallocated caches and outputs, the memory check), ``layers`` (each decoder
layer's decode form from the HF modules' weights), ``steer_buffers`` (steering edits as per-row device buffers),
``sampling`` (token choice on the device), ``prefill`` (the model's own forward, caches copied in), ``step`` (the
graph-safe decode step), ``engine`` (the driver: sessions, capture and replay, results), ``batches`` (the verbs
``Scope`` uses: steered generations and sweeps as one batch).
"""
from qwen_scope.engine.engine import DecodeEngine, EngineResult, EngineRow
from qwen_scope.engine.sampling import SamplingConfig
from qwen_scope.engine.state import EngineMemoryError, StateLayout

__all__ = ["DecodeEngine", "EngineResult", "EngineRow", "SamplingConfig", "EngineMemoryError", "StateLayout"]
