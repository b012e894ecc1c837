"""Attention backends by name: `sdpa` (pure PyTorch, any device) and `flash` (flash-attn on CUDA).

The registry imports the built-in backends; backends never import the registry (they share `base`).
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from tandem.engine.attention.base import AttentionBackend, write_kv
from tandem.engine.attention.flash import FlashBackend
from tandem.engine.attention.sdpa import SdpaBackend

__all__ = ["AttentionBackend", "backend_names", "flash_available", "get_backend", "register_backend", "write_kv"]

_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"sdpa": SdpaBackend, "flash": FlashBackend}


def register_backend(name: str) -> Callable[[type], type]:
    """Class decorator registering another attention backend under `name`."""
    def deco(cls: type) -> type:
        cls.name = name
        _BACKENDS[name] = cls
        return cls
    return deco


def backend_names() -> list[str]:
    """The registered backend names."""
    return sorted(_BACKENDS)


def flash_available() -> bool:
    """Whether the flash_attn package is importable (it only runs on CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def get_backend(name: str | None, device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`; None or "auto" picks flash on CUDA when flash_attn imports, else sdpa."""
    dev = torch.device(device)
    if name is None or name == "auto":
        name = "flash" if dev.type == "cuda" and flash_available() else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (valid: auto, {', '.join(sorted(_BACKENDS))})")
    if name == "flash" and dev.type != "cuda":
        raise ValueError(f"attention backend 'flash' needs a CUDA device, got {dev}")
    return _BACKENDS[name]()
