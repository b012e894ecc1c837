"""A session's KV in and out of a tensor-parallel worker, whose ranks each hold their own KV heads: `export` gathers
the positions asked for on the driver with every KV head once, in head order (the wire layout, the same at every
degree); `import_` hands each rank exactly its heads of such a payload (head_map.py says which). Point-to-point
sends within the group (gloo on CPU, NCCL on CUDA): a replicated head travels from one holder only.

This is the driver path, kept as the fallback: the payload leaves and enters the worker through its driver (the
worker's one KV inbox), driver to driver, regrouped here on each side. Between workers whose ranks have KV endpoints
(every worker the runtime starts, locally or as Ray actors whose endpoints the peers can reach) KV goes rank to rank
instead (parallel/kv_ranks.py); the driver path runs for tp=1 to tp=1, for a worker whose ranks could not open their
endpoints, and for a transfer whose parts could not reach the receiving ranks. `forwarded_bytes` on the group counts
what the driver moved for its other ranks here."""
from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar

import torch

from tandem.engine.kv_transfer import KVPayload, KVTransferError, dtype_name, export_kv, import_kv
from tandem.engine.parallel.head_map import kv_head_spans, wire_sources

T = TypeVar("T")


class RankGroup(Protocol):
    """What this module needs of the driver's group (parallel/driver.py's RankGroup)."""

    size: int
    device: torch.device
    forwarded_bytes: int

    def send(self, *command: Any) -> None: ...

    def run(self, fn: Callable[[], T]) -> T: ...


def wire_shape(kv_caches: list[torch.Tensor], total_kv_heads: int, tokens: int) -> tuple[int, ...]:
    """(layers, 2, tokens, every KV head, head_dim): a payload's shape on the wire."""
    return (len(kv_caches), 2, tokens, total_kv_heads, int(kv_caches[0].shape[-1]))


def _comm_device(group: RankGroup) -> torch.device:
    return group.device if group.device.type == "cuda" else torch.device("cpu")


def export(group: RankGroup, kv_caches: list[torch.Tensor], total_kv_heads: int, block_table: list[int],
           block_size: int, start: int, end: int) -> KVPayload:
    """Driver: positions [start, end) of a sequence with every KV head, gathered from the ranks that hold them."""
    local = export_kv(kv_caches, block_table, block_size, start, end)     # raises before any rank is asked
    n = local.num_tokens
    shape = wire_shape(kv_caches, total_kv_heads, n)
    sources = wire_sources(total_kv_heads, group.size)
    needed = sorted(set(sources) - {0})
    if n == 0:
        return KVPayload(0, local.dtype, shape, torch.empty(shape, dtype=local.data.dtype))
    group.send("kv_export", list(block_table), block_size, start, end, needed)
    parts = {0: local.data}
    dev = _comm_device(group)

    def receive() -> None:
        import torch.distributed as dist
        for r in needed:
            buf = torch.empty(local.data.shape, dtype=local.data.dtype, device=dev)
            dist.recv(buf, src=r)
            parts[r] = buf.cpu()
    group.run(receive)
    group.forwarded_bytes += sum(parts[r].numel() * parts[r].element_size() for r in needed)
    spans = kv_head_spans(total_kv_heads, group.size)
    out = torch.empty(shape, dtype=local.data.dtype)
    for h, r in enumerate(sources):
        out[:, :, :, h] = parts[r][:, :, :, h - spans[r][0]]
    return KVPayload(n, local.dtype, shape, out)


def import_(group: RankGroup, kv_caches: list[torch.Tensor], total_kv_heads: int, block_table: list[int],
            block_size: int, start: int, payload: KVPayload) -> None:
    """Driver: scatter a wire payload into positions [start, start + num_tokens) of a sequence, each rank taking
    exactly its KV heads."""
    want = wire_shape(kv_caches, total_kv_heads, payload.num_tokens)
    if tuple(payload.shape) != want or payload.dtype != dtype_name(kv_caches[0].dtype):
        raise KVTransferError(f"KV payload {tuple(payload.shape)} {payload.dtype} does not fit this cache "
                              f"({want} {dtype_name(kv_caches[0].dtype)})")
    spans = kv_head_spans(total_kv_heads, group.size)
    import_kv(kv_caches, block_table, block_size, start, _heads(payload, *spans[0]))   # raises before the ranks act
    if payload.num_tokens == 0:
        return
    group.send("kv_import", list(block_table), block_size, start, payload.num_tokens)
    dev = _comm_device(group)

    def scatter() -> None:
        import torch.distributed as dist
        for r in range(1, group.size):
            part = _heads(payload, *spans[r])
            dist.send(part.data.to(dev), dst=r)
            group.forwarded_bytes += part.nbytes
    group.run(scatter)


def _heads(payload: KVPayload, first: int, count: int) -> KVPayload:
    data = payload.data[:, :, :, first:first + count].contiguous()
    return KVPayload(payload.num_tokens, payload.dtype, tuple(data.shape), data)


def rank_export(rank: int, kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int,
                end: int, needed: list[int], device: torch.device) -> None:
    """A rank's side of `export`: its heads of the positions, sent to the driver when the driver needs them."""
    local = export_kv(kv_caches, block_table, block_size, start, end)
    if rank in needed:
        import torch.distributed as dist
        dist.send(local.data.to(device if device.type == "cuda" else torch.device("cpu")), dst=0)


def rank_import(kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int, tokens: int,
                device: torch.device) -> None:
    """A rank's side of `import_`: receive its heads of the positions from the driver and write them."""
    import torch.distributed as dist
    c0 = kv_caches[0]
    buf = torch.empty((len(kv_caches), 2, tokens, c0.shape[-2], c0.shape[-1]), dtype=c0.dtype,
                      device=device if device.type == "cuda" else torch.device("cpu"))
    dist.recv(buf, src=0)
    data = buf.cpu()
    import_kv(kv_caches, block_table, block_size, start,
              KVPayload(tokens, dtype_name(c0.dtype), tuple(data.shape), data))
