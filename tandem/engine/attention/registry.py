"""Attention backends by name: `sdpa` (pure PyTorch, any device) and `flash` (flash-attn on CUDA)."""
from __future__ import annotations

import importlib.util
from typing import Callable, Protocol

import torch

from tandem.engine.attention.metadata import AttnMetadata


class AttentionBackend(Protocol):
    """Writes a step's K/V into the paged cache, then runs causal attention of each sequence over its whole KV."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv [2, blocks, block_size, Hkv, D] -> out [T, Hq, D]."""
        ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type], type]:
    """Class decorator registering an attention backend under `name`."""
    def deco(cls: type) -> type:
        cls.name = name
        _BACKENDS[name] = cls
        return cls
    return deco


def backend_names() -> list[str]:
    """The registered backend names."""
    _ensure_builtin()
    return sorted(_BACKENDS)


def flash_available() -> bool:
    """Whether the flash_attn package is importable (it only runs on CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter a step's K and V rows into the paged cache at their slots (shared by every backend)."""
    flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv.dtype))


def get_backend(name: str | None, device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`; None or "auto" picks flash on CUDA when flash_attn imports, else sdpa."""
    _ensure_builtin()
    dev = torch.device(device)
    if name is None or name == "auto":
        name = "flash" if dev.type == "cuda" and flash_available() else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (valid: auto, {', '.join(sorted(_BACKENDS))})")
    if name == "flash" and dev.type != "cuda":
        raise ValueError(f"attention backend 'flash' needs a CUDA device, got {dev}")
    return _BACKENDS[name]()


def _ensure_builtin() -> None:
    from tandem.engine.attention import flash, sdpa  # noqa: F401  (registers them)
