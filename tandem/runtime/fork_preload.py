"""What the worker fork server imports once before it forks any worker (launcher.PRELOAD): torch, the modules torch
imports lazily on a model's first use (torch._dynamo), uvloop and the worker's own modules; then every object they
made is frozen out of the cyclic GC (gc.freeze, as before a fork in a pre-fork server): a worker's collections then
skip them, and do not write to (and so copy) the pages it shares with the fork server. They are unfrozen at exit, so
the interpreter's last collection frees them (nanobind, under triton, reports every object it finds unfreed)."""
from __future__ import annotations

import atexit
import contextlib
import gc

import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - imported by torch at a model's first weight init: 1-1.5 s on a loaded machine

import tandem.engine.llm_engine  # noqa: F401
import tandem.runtime.worker_main  # noqa: F401

with contextlib.suppress(ImportError):
    import uvloop  # noqa: F401 - a worker's event loop (0.2 s)

gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)
