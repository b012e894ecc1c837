"""Paged attention: per-step metadata, KV cache tensors, and the attention backends (sdpa, flash)."""
from tandem.engine.attention.base import AttentionBackend, write_kv
from tandem.engine.attention.metadata import AttnMetadata, allocate_kv_cache, kv_bytes_per_block
from tandem.engine.attention.registry import backend_names, flash_available, get_backend, register_backend

__all__ = ["AttnMetadata", "AttentionBackend", "allocate_kv_cache", "backend_names", "flash_available",
           "get_backend", "kv_bytes_per_block", "register_backend", "write_kv"]
