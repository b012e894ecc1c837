"""What a coordinator action asks of a worker: one vocabulary and one dispatcher for every shell.

The simulator's loops (tandem/sim/loop.py, host_loop.py) and the runtime's coordinator shell read each action as a
command to one worker through `commands`; the runtime's messages (tandem/runtime/messages.py) name the command
each carries, so `EARLY` below is the one statement of what a worker does while its model runs a step.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from tandem.core.actions import Cancel, Delivered, ExpectReturn, HistoryReady, KVArrived, Release, RunLocal, Submit, \
    Timer, ToolCall, Transfer

# commands to one worker (KV_IN: a peer's KV landed on it; BEGIN and AUDIT come from the shell, not the core;
# EXPECT: a tool's expected time, for the worker's host tier)
BEGIN, SUBMIT, SEND_KV, HISTORY_READY, KV_ARRIVED, DELIVERED, KV_IN, AUDIT, RUN_LOCAL, RELEASE, CANCEL, EXPECT = range(12)
# what the shell does itself: wait out a tool call, call the coordinator back at a time
TOOL_CALL, TIMER = 12, 13

# the command of each action type (a Transfer is a KV send by its source worker)
COMMAND: dict[type, int] = {Submit: SUBMIT, Transfer: SEND_KV, HistoryReady: HISTORY_READY, KVArrived: KV_ARRIVED,
                            Delivered: DELIVERED, RunLocal: RUN_LOCAL, Release: RELEASE, Cancel: CANCEL,
                            ToolCall: TOOL_CALL, Timer: TIMER, ExpectReturn: EXPECT}

# Commands a worker carries out while its model runs a step, in arrival order, as long as no command before them
# waits for the step's end. They queue work, pin KV, or move the KV of requests the running step does not include
# (a finished prefill's new KV, an idle session's history, a waiting task's, a peer's KV kept for its request):
# the step reads and writes only its own batch's blocks, and new blocks are handed out only when the next step is
# planned. AUDIT only reads which requests the worker holds. RUN_LOCAL, RELEASE and CANCEL may concern a request
# of the running batch, so they wait for the step's end.
EARLY = frozenset({BEGIN, SUBMIT, SEND_KV, HISTORY_READY, KV_ARRIVED, DELIVERED, KV_IN, AUDIT, EXPECT})


def commands(actions: Iterable[object]) -> Iterator[tuple[int, int, object]]:
    """(command, worker, action) for each action in order; worker is -1 for TOOL_CALL and TIMER."""
    for a in actions:
        kind = COMMAND.get(type(a))
        if kind is None:
            raise TypeError(f"unknown action {a!r}")
        if kind == SEND_KV:
            yield kind, a.src, a
        elif kind >= TOOL_CALL:
            yield kind, -1, a
        else:
            yield kind, a.worker, a
