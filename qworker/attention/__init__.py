"""Paged attention: the backend interface, the torch reference and the CUDA backend."""

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache"]
