"""Errors of the perf layer. All are ValueErrors with one-line messages that say what to change."""
from __future__ import annotations


class UnknownNameError(ValueError):
    """A GPU or model name is not in its catalogue; the message lists the valid names."""


class DoesNotFitError(ValueError):
    """Model weights (plus the reserved working memory) do not fit the GPUs of one worker."""


class ParallelismError(ValueError):
    """A tensor-parallel degree the model or machine cannot run (e.g. tp > GPUs per node)."""


def unknown_name(kind: str, name: object, valid) -> UnknownNameError:
    """Build the one-line error for an unknown catalogue name."""
    return UnknownNameError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(valid))}")
