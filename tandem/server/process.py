"""Settings of the serving process (the coordinator: HTTP server, event loop, preparation threads).

* Freed request memory goes back to the OS (glibc): large bodies are parsed into large objects, and glibc's
  dynamic mmap threshold grows after the first big free, so later big allocations come from the heap and stay
  there after they are freed (a hostile-input run left the server 15% larger for good). A fixed threshold keeps
  allocations of at least 128 KiB mmapped, so freeing them unmaps them.
* A short GIL switch interval: while a preparation thread templates or tokenizes a large prompt, the event loop
  thread, each time it releases the GIL (a socket send, a select), waited up to the default 5 ms to get it back;
  with hundreds of requests arriving at once that added up to seconds of /health latency. 1 ms bounds it.
* The objects made at startup (modules, the tokenizer, the cluster's state) are frozen out of the cyclic garbage
  collector, as vLLM does after it starts: a full collection otherwise walks them all, and under a burst of
  requests that pause stalled the event loop for 100-300 ms at a time.
* What libraries load lazily on a first request is loaded at startup (`warm_up`): anyio's asyncio backend (the
  first streamed response), pydantic.v1 (FastAPI's first validation error) and the chat template's compiled
  form. On the event loop, on a first burst of requests, these imports took 50-100 ms (py-spy)."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
from typing import Any

log = logging.getLogger("tandem.server")
M_MMAP_THRESHOLD = -3            # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 << 10
SWITCH_INTERVAL_S = 0.001
GC_THRESHOLDS = (20_000, 20, 50)   # fewer, not longer, young collections while hundreds of streams allocate


def return_large_frees_to_the_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; False (and nothing changed) without glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed: freed request memory may stay in the heap", threshold)
    return ok


def tune_for_serving() -> None:
    """Apply this module's settings to the current (serving) process."""
    return_large_frees_to_the_os()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def warm_up(tokenizer: Any = None) -> None:
    """Load now what the first requests would otherwise load on the event loop (see the module doc)."""
    import warnings

    import anyio._backends._asyncio  # noqa: F401 - anyio imports its backend at the first task group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pydantic.v1  # noqa: F401 - FastAPI's _compat imports it at its first validation error
        except ImportError:  # pragma: no cover - a pydantic without v1
            pass
    if tokenizer is not None:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        for tools in (None, [tool]):                 # the template may differ with tools
            try:
                tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
            except Exception as e:  # noqa: BLE001 - a model without a usable template: its requests will say so
                log.info("chat template not warmed up: %s", e)


def freeze_startup_objects() -> None:
    """Move every object alive now out of the cyclic GC's reach (call once the server is up)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
