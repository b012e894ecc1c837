"""The group's wiring, common to the driver and the other ranks: the torch.distributed process group (gloo on CPU,
NCCL on CUDA; chosen at run time), joined through a TCPStore listening on 127.0.0.1, and the one command the driver
broadcasts per model call (its inputs: token ids, positions, attention metadata with the block tables, pickled once,
tensors as bytes so a CUDA tensor lands on each rank's own device)."""
from __future__ import annotations

import datetime
import io
import pickle
import socket
from typing import Any

import torch
import torch.distributed as dist

STORE_TIMEOUT_S = 60.0          # a rank's store client waits this long for the driver's store
COLLECTIVE_TIMEOUT_S = 600.0    # a collective waits this long for a live but silent rank
_local_device = torch.device("cpu")    # where this process's received tensors go (each rank sets its own)


def listen_loopback() -> socket.socket:
    """A listening socket on 127.0.0.1 and a free port (the kernel's pick), for the driver's TCPStore."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def driver_store(sock: socket.socket, size: int) -> dist.TCPStore:
    """The rendezvous store served by the driver on its loopback socket (never on a wildcard address)."""
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], size, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S), master_listen_fd=sock.fileno(),
                         use_libuv=True)


def rank_store(port: int, size: int) -> dist.TCPStore:
    """A rank's client of the driver's store."""
    return dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def join_group(store: dist.Store, rank: int, size: int, device: torch.device) -> None:
    """Join the group's process group: NCCL between CUDA devices, else gloo, its pairs on the loopback device."""
    global _local_device
    _local_device = device
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=timeout,
                                device_id=device)
        return
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout, pg_options=opts)


def broadcast_command(command: tuple) -> None:
    """Driver: send one command (a tuple, tensors anywhere inside) to every other rank, once."""
    dist.broadcast_object_list([pack(command)], src=0)


def receive_command() -> tuple:
    """Rank: the driver's next command."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return unpack(box[0])


def _tensor_from(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype, device=_local_device)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return t if _local_device.type == "cpu" else t.to(_local_device)


class _Pickler(pickle.Pickler):
    """Tensors as (bytes, dtype, shape): only the elements a view shows travel, and a receiver rebuilds them on its
    own device."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous()
            raw = t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _tensor_from, (raw, t.dtype, tuple(t.shape))
        return NotImplemented


def pack(obj: Any) -> bytes:
    """obj pickled with its tensors as plain bytes."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def unpack(raw: bytes) -> Any:
    """The object `pack` made, its tensors on this process's device."""
    return pickle.loads(raw)
