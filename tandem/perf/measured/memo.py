"""Memoised grid builders: a measured table is read and reshaped into a grid once per (system, framework, shape)."""
from __future__ import annotations

from tandem.perf.measured.source import MissingCostData

MEMOS: list[dict] = []


def memoised(fn):
    """Memoise a grid builder on (tables' system and framework, args); a table without one usable measurement for
    the shape (ValueError) becomes a one-line MissingCostData."""
    memo: dict = {}
    MEMOS.append(memo)

    def wrapped(tables, *args):
        key = (tables.system, tables.framework) + args
        if key not in memo:
            try:
                memo[key] = fn(tables, *args)
            except ValueError as e:
                raise MissingCostData(f"{tables.system} {tables.framework} {fn.__name__.strip('_')}{args}: {e}") \
                    from None
        return memo[key]
    wrapped.__doc__ = fn.__doc__
    return wrapped


def clear_memos() -> None:
    """Forget every memoised grid."""
    for memo in MEMOS:
        memo.clear()
