"""A tensor-parallel rank other than the driver: it loads its shard of the weights, holds its heads' paged KV, and
runs every model call the driver broadcasts (forward, logits, KV allocation, swaps, a session's KV out to the driver or
in from it, or rank to rank through its own KV endpoint: parallel/kv_ranks.py) until told to stop; the host KV tier's
copies it runs beside those, on copy threads of its own (parallel/rank_tier.py), reporting their ends on its notice
pipe. It samples nothing; its only I/O is the KV endpoint the runtime gives it and its notice pipe to the driver; it
exits by itself when the driver dies."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)
ORPHAN_EXIT = 75             # exit code of a rank that noticed its driver died
DRIVER_POLL_S = 0.2          # how often a rank checks that its driver is alive


@dataclass(frozen=True)
class RankSpec:
    """What a rank process is started with."""

    rank: int
    size: int
    port: int                 # the driver's TCPStore on 127.0.0.1
    driver_pid: int
    config: Any               # the EngineConfig
    device: str
    threads: int              # torch CPU threads of this rank
    env: dict[str, str]       # the driver's environment when it started the group
    notices: Any = None       # the write end of this rank's notice pipe to the driver (driver.RankGroup.listen)
    cpus: tuple[int, ...] | None = None   # its OpenMP threads' CPUs, one each (cpu_omp_threads_bind); None: unbound


def ready_key(rank: int) -> str:
    """The store key a rank sets once its shard is loaded ("ok", or the error that stopped it)."""
    return f"tandem/tp/ready/{rank}"


def _driver_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_driver(pid: int) -> None:
    """Exit at once (no cleanup) when the driver or the process that forked this one is gone: no orphan ranks, even
    after a SIGKILL of the driver."""
    forked_by = os.getppid()

    def loop() -> None:
        while True:
            if os.getppid() != forked_by or not _driver_alive(pid):
                os._exit(ORPHAN_EXIT)
            time.sleep(DRIVER_POLL_S)
    threading.Thread(target=loop, name="tp-driver-watch", daemon=True).start()


def rank_main(spec: RankSpec) -> None:
    """Entry point of a rank process: watch the driver, load the shard, report, join the group, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # Ctrl-C is the driver's to handle
    _watch_driver(spec.driver_pid)
    os.environ.clear()
    os.environ.update(spec.env)
    torch.set_num_threads(spec.threads)
    if spec.cpus:
        from tandem.engine.omp_affinity import bind_threads
        bind_threads(spec.cpus)
    from tandem.engine.parallel import channel
    store = channel.rank_store(spec.port, spec.size)
    try:
        shard = _Shard(spec)
    except Exception as e:  # noqa: BLE001 - reported to the driver in one line, which fails the engine's start
        store.set(ready_key(spec.rank), f"{type(e).__name__}: {e}")
        return
    store.set(ready_key(spec.rank), "ok")
    channel.join_group(store, spec.rank, spec.size, shard.device)
    shard.serve()


class _Shard:
    """This rank's model shard, KV caches and swap space, and the command loop."""

    def __init__(self, spec: RankSpec) -> None:
        from tandem.engine.attention import native
        from tandem.engine.kv_transfer import SwapSpace
        from tandem.engine.loader import load_model
        from tandem.engine.parallel.group import TPGroup
        cfg = spec.config
        self.device = torch.device(spec.device)
        self.rank, self.size = spec.rank, spec.size
        self.model, self.mc = load_model(cfg.model, dtype_for=lambda ckpt: cfg.torch_dtype(ckpt, self.device),
                                         device=self.device, backend=cfg.attention_backend,
                                         tp=TPGroup(spec.rank, spec.size))
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = cfg.block_size
        self.kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        self.kv_caches: list[torch.Tensor] = []
        self.swap_space = SwapSpace()
        self.tier = None                                # the host KV tier's share of this rank (tier_alloc)
        self.notices = spec.notices                     # this rank's notice pipe to the driver
        self.kv_plane = None                         # this rank's KV endpoint (parallel/kv_ranks.py), once opened
        if self.device.type == "cpu" and self.dtype == torch.float32:
            native.load()

    @torch.inference_mode()
    def serve(self) -> None:
        """Run the driver's commands in order until "stop". A command that raises here raises on the driver too
        (same code, same inputs), so the rank goes on with the next one."""
        from tandem.engine.attention import allocate_kv_cache
        from tandem.engine.parallel import kv_group, kv_ranks
        from tandem.engine.parallel.channel import receive_command
        import torch.distributed as dist
        while True:
            cmd = receive_command()
            op = cmd[0]
            try:
                if op == "forward":
                    _, ids, positions, kv, meta = cmd
                    self.model(ids, positions, self.kv_caches if kv == "pool" else kv, meta)
                elif op == "logits":
                    self.model.compute_logits(cmd[1])
                elif op == "alloc":
                    self.kv_caches = []
                    self.kv_caches = allocate_kv_cache(self.mc.num_hidden_layers, cmd[1], self.block_size,
                                                       self.kv_heads, self.mc.head_dim, self.dtype, self.device)
                elif op == "swap":
                    self.swap_space.apply(self.kv_caches, cmd[1], self.block_size)
                elif op.startswith("tier_"):            # the host KV tier (parallel/rank_tier.py)
                    self._tier_command(cmd)
                elif op == "kv_export":
                    kv_group.rank_export(self.rank, self.kv_caches, *cmd[1:], self.device)
                elif op == "kv_import":
                    kv_group.rank_import(self.kv_caches, *cmd[1:], self.device)
                elif op == "kv_plane":
                    mc = self.mc
                    self.kv_plane = kv_ranks.rank_open(cmd[1], self.rank, self.size, mc.num_key_value_heads,
                                                       mc.num_hidden_layers, mc.head_dim, self.dtype, cmd[2])
                elif op == "kv_send":
                    kv_ranks.rank_send(self.kv_plane, self.size, self.device, self.kv_caches, *cmd[1:])
                elif op == "kv_peers":
                    kv_ranks.rank_peers(self.kv_plane, cmd[1])
                elif op == "kv_place":
                    kv_ranks.rank_place(self.kv_plane, self.kv_caches, *cmd[1:])
                elif op == "stop":
                    break
            except Exception as e:  # noqa: BLE001 - the driver raises the same error to its caller
                log.debug("rank command %s failed: %s", op, e)
        if self.kv_plane is not None:
            self.kv_plane.close()
        if self.tier is not None:
            self.tier.close()
        dist.destroy_process_group()

    def _tier_command(self, cmd: tuple) -> None:
        """The host KV tier's commands: allocate this rank's pool and copy threads, start copies (no wait), test
        hooks, and the bit-for-bit comparison of host slots with GPU blocks (every rank answers it)."""
        from tandem.engine.parallel import rank_tier
        op = cmd[0]
        if op == "tier_alloc" or self.tier is None:      # no pool without "tier_alloc": each copy then fails
            pool_blocks = cmd[1] if op == "tier_alloc" else 0
            if self.tier is not None:
                self.tier.close()
            self.tier = rank_tier.RankTier.open(self.rank, pool_blocks, self.block_size, lambda: self.kv_caches,
                                                self.notices, self.device)
        if op == "tier_copies":
            self.tier.start(cmd[1])
        elif op == "tier_hooks" and cmd[1] == self.rank:
            self.tier.hooks(*cmd[2:])
        elif op == "tier_compare":
            rank_tier.gather_objects(self.size, rank_tier.compare(self.tier.pool, self.kv_caches, *cmd[1:]))
