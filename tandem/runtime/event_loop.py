"""The event loop the project's processes run on: uvloop's when installed (as uvicorn's and vLLM's servers use),
else asyncio's default. Cheaper callbacks and socket wake-ups for the coordinator's HTTP loop and for each
worker's message loop, which runs beside the model's steps."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory when installed, else None (asyncio's default)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run on the loop event_loop_factory() gives."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(main)
