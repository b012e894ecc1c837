"""Closed-loop clients of a simulated run: each runs one session at a time and starts the next waiting one when it
sees its session end."""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Container, Sequence

from tandem.workload.records import SessionRecord
from tandem.workload.session import Session


class ClosedLoop:
    """The sessions no client has started yet (in arrival order), the session each busy client runs, and the records
    read so far of the coordinator's list, to tell which client sessions ended."""

    def __init__(self, order: Sequence[Session]) -> None:
        self.waiting: deque[Session] = deque(order)
        self.busy: list[str] = []                       # the session each busy client runs
        self.recorded: dict[str, SessionRecord] = {}    # client sessions' records, until they end
        self.read = 0                                   # coordinator records read into `recorded`

    def start(self, at: float) -> Session:
        """The next waiting session, sent by a client at `at` (its arrival time in the records)."""
        s = self.waiting.popleft()
        if s.arrival_s != at:
            s = dataclasses.replace(s, arrival_s=at)
        self.busy.append(s.session_id)
        return s

    def ended(self, records: Sequence[SessionRecord], live: Container[str]) -> list[SessionRecord]:
        """The records of the client sessions that ended since the last call, in client order; their clients are
        free (a session not at the coordinator yet, or under way, keeps its client busy)."""
        seen = self.recorded
        for rec in records[self.read:]:
            seen[rec.session_id] = rec
        self.read = len(records)
        ended: list[SessionRecord] = []
        busy: list[str] = []
        for sid in self.busy:
            rec = seen.get(sid)
            if rec is None or sid in live:
                busy.append(sid)
            else:
                ended.append(seen.pop(sid))
        self.busy = busy
        return ended

    def dropped(self, n: int) -> None:
        """`n` records left the head of the coordinator's list (handed to a record stream)."""
        self.read = max(0, self.read - n)


__all__ = ["ClosedLoop"]
