"""Where to read and write inside a Qwen model: family adapters, named hook points, capture and intervention."""
