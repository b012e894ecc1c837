"""Deployments: how many prefill, decode or co-located workers run at which tensor-parallel degree, and over how
many of each worker's GPUs a mixture-of-experts model's experts are sharded (`tp8ep8`: expert parallelism 8;
without `ep`, every expert is sharded tensor-parallel)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.policy.task import Role

ROLES = {"P": Role.PREFILL, "D": Role.DECODE, "C": Role.COLOCATED}
_PART = re.compile(r"^\s*([PDC])\s*:\s*tp(\d+)(?:\s*ep(\d+))?\s*x\s*(\d+)\s*$", re.IGNORECASE)


class DeploymentError(ValueError):
    """A deployment string is malformed or does not fit the GPUs given."""


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    """`count` replicas of one role, each spanning `tp` GPUs, its experts sharded over `ep` of them."""

    role: Role
    tp: int
    count: int
    ep: int = 1


@dataclass(frozen=True, slots=True)
class Deployment:
    """A whole deployment; `str()` gives back the form `tandem simulate --deploy` takes."""

    groups: tuple[WorkerGroup, ...]

    @property
    def gpus(self) -> int:
        return sum(g.tp * g.count for g in self.groups)

    @property
    def disaggregated(self) -> bool:
        return any(g.role != "colocated" for g in self.groups)

    def workers(self) -> list[tuple[str, int]]:
        """(role, tp) of every worker in placement order."""
        return [(g.role, g.tp) for g in self.groups for _ in range(g.count)]

    def expert_parallel(self) -> list[int]:
        """The expert-parallel degree of every worker, in the order of `workers()`."""
        return [g.ep for g in self.groups for _ in range(g.count)]

    def __str__(self) -> str:
        inv = {v: k for k, v in ROLES.items()}
        return ",".join(f"{inv[g.role]}:tp{g.tp}{f'ep{g.ep}' if g.ep > 1 else ''}x{g.count}" for g in self.groups)


def parse_deploy(text: str, gpus: int | None = None) -> Deployment:
    """Parse "P:tp4x2,D:tp8x1", "C:tp4x2" or "C:tp8ep8x1"; check roles are consistent and the GPU count suffices."""
    if not text or not text.strip():
        raise DeploymentError("empty deployment; expected e.g. 'P:tp4x2,D:tp8x1' or 'C:tp4x2'")
    groups = []
    for part in text.split(","):
        m = _PART.match(part)
        if not m:
            raise DeploymentError(f"cannot parse deployment part {part.strip()!r}; expected ROLE:tpNxM or "
                                  f"ROLE:tpNepExM with ROLE in P, D, C")
        role, tp, count = ROLES[m.group(1).upper()], int(m.group(2)), int(m.group(4))
        ep = int(m.group(3)) if m.group(3) else 1
        if tp < 1 or tp & (tp - 1):
            raise DeploymentError(f"tensor-parallel degree must be a power of two, got tp{tp} in {part.strip()!r}")
        if ep < 1 or tp % ep:
            raise DeploymentError(f"expert-parallel degree must divide the worker's tp, got ep{ep} in {part.strip()!r}")
        if count < 1:
            raise DeploymentError(f"replica count must be at least 1 in {part.strip()!r}")
        groups.append(WorkerGroup(role, tp, count, ep))
    roles = {g.role for g in groups}
    if "colocated" in roles and roles != {"colocated"}:
        raise DeploymentError("a deployment is either co-located (C:...) or disaggregated (P:...,D:...), not both")
    if "colocated" not in roles and roles != {"prefill", "decode"}:
        raise DeploymentError("a disaggregated deployment needs at least one prefill (P:) and one decode (D:) group")
    dep = Deployment(tuple(groups))
    if gpus is not None and dep.gpus > gpus:
        raise DeploymentError(f"deployment {dep} needs {dep.gpus} GPUs but only {gpus} are given (--gpus)")
    return dep
