"""The process group: the world a launcher set up, the default group on it (the ranks' store
listening on the rendezvous address only), and leaving it cleanly on every way out of a rank."""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardwise.config.notice import say
from shardwise.config.types import ConfigError
from shardwise.runtime.machine import (
    cap_cpu_threads,
    device_type,
    expandable_cuda_segments,
    keep_freed_cpu_memory,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def launched_world_size() -> int | None:
    """WORLD_SIZE set by torchrun / the elastic launcher, or None when run as a plain process."""
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws else None


def check_gpu_count(world_size: int) -> None:
    """One rank per GPU: more ranks on this machine than visible CUDA devices is refused in one line
    (each rank takes ``cuda:LOCAL_RANK``; one past the last GPU would fail inside CUDA with a
    traceback). The local count is the launcher's ``LOCAL_WORLD_SIZE``, else ``world_size`` before
    a launch, else this rank's own index plus one."""
    import torch

    launched = launched_world_size() is not None
    if os.environ.get("LOCAL_WORLD_SIZE"):
        local = int(os.environ["LOCAL_WORLD_SIZE"])
    else:
        local = int(os.environ.get("LOCAL_RANK", 0)) + 1 if launched else world_size
    gpus = torch.cuda.device_count()
    if local > gpus:
        how = "torchrun --nproc-per-node" if launched else "--nproc"
        raise ConfigError(f"{local} ranks on this machine but {gpus} CUDA device(s) visible (one rank per "
                          f"GPU): use {how} {gpus}, or run.device=cpu to run them on the CPU")


def init_distributed(requested_device: str, backend: str = "auto", cache_cpu_memory: bool = True
                     ) -> DistEnv:
    """Initialize the default process group: from torchrun's env, or a size-1 group otherwise.
    ``cache_cpu_memory``: on CPU, :func:`keep_freed_cpu_memory` (run.cpu_memory_cache)."""
    import torch
    import torch.distributed as dist

    dtype = device_type(requested_device)
    if dtype == "cpu":
        cap_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if cache_cpu_memory:
            keep_freed_cpu_memory()
    if backend == "auto":
        # On GPUs NCCL carries device tensors and gloo the CPU ones (checkpoint metadata, objects).
        backend = "cuda:nccl,cpu:gloo" if dtype == "cuda" else "gloo"
    world = launched_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(dtype, local_rank) if dtype == "cuda" else torch.device("cpu")
    if dtype == "cuda":
        expandable_cuda_segments()  # before the allocator first reads its settings
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if world is None:
            init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            store = rank_store(world)  # (None: env:// as torch does it, on the launcher's store)
            where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                              "world_size": world}
            init_process_group(backend, device_id=device if dtype == "cuda" else None, **where)
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), device)


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group``, less the rank prefix torch then puts on every later
    traceback (it wraps ``sys.excepthook`` and never unwraps it) in a process that is not a launched
    rank -- a notebook's ``shardwise.train`` or ``shardwise.plan`` (its fake world), a probe's
    one-rank group -- where the next unrelated error would read "[rank32]: ...". Launched ranks keep
    it: their tracebacks interleave."""
    import torch.distributed as dist

    hook = sys.excepthook
    dist.init_process_group(*args, **kwargs)
    if launched_world_size() is None:
        sys.excepthook = hook


def rank_store(world: int) -> torch.distributed.Store | None:
    """The store the ranks meet in, when rank 0 hosts it (``MASTER_ADDR:MASTER_PORT``, not the
    launcher's shared store): listening on ``MASTER_ADDR``'s address only. torch's own env://
    store binds every interface (``*:port``), unauthenticated, for the whole run; a local launch
    (MASTER_ADDR 127.0.0.1) then listens on loopback only, a multi-node one on the rendezvous
    interface only. None: the launcher's store serves (torchrun's agent store), or no address."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not addr or not port:
        return None
    rank, timeout = int(os.environ.get("RANK", 0)), timedelta(minutes=10)
    if rank != 0:
        return dist.TCPStore(addr, int(port), world, is_master=False, timeout=timeout)
    family, kind, proto, _, where = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(where[0]).is_loopback and world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        say(f"warning: MASTER_ADDR {addr} is {where[0]} (loopback) on rank 0's node: ranks on other "
            "machines cannot reach it; set MASTER_ADDR to this node's network address", err=True)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(where)
    except OSError as e:
        sock.close()
        raise ConfigError(f"rank 0 cannot listen on MASTER_ADDR {addr}:{port} ({e.strerror}): set "
                          "MASTER_ADDR to an address of this node, or MASTER_PORT to a free port") from None
    sock.listen(4096)
    return dist.TCPStore(addr, int(port), world, is_master=True, timeout=timeout,
                         master_listen_fd=sock.detach(), wait_for_workers=False)


def leave_distributed(timeout_s: float = 10.0) -> None:
    """Destroy the process groups, if any, while the interpreter is still whole: on every way out of
    a rank (an error too, after it is reported).

    A gloo worker thread frees a finished collective's tensors under the GIL; one still doing so
    when the interpreter finalizes is unwound by force and aborts the rank ("terminate called
    without an active exception", a second line beside the rank's error; pytorch/pytorch#190489).
    Destroying the groups joins those threads first. A collective that a diverged peer never joins
    holds the destroy until that peer exits, so this waits at most ``timeout_s``."""
    import threading

    dist = sys.modules.get("torch.distributed")  # commands that never started torch: nothing to do
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    leaving = threading.Thread(target=dist.destroy_process_group, name="shardwise-leave", daemon=True)
    leaving.start()
    leaving.join(timeout_s)
