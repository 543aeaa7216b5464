"""sparsekv: sparse attention over the KV cache of long-context LLMs."""

__version__ = "0.1.0"
