"""TileLang kernels for sm_90a, one stage per file (a builder and its launcher)."""
