"""Pipeline ranks simulated as threads (``verify --ranks`` under pipeline parallel).

Pipeline ranks run different programs (each its own stages), so they cannot share one
``LocalTensorMode``. :class:`Stages` runs each pipeline rank -- the slice of simulated ranks at one
pp index -- in a thread of torch's ``LocalRunnerMode`` under a mode of its own; one thread runs at a
time and hands over where it waits. :func:`across_stages` holds the adapters that make torch's
schedule, stages and collectives compute across those threads what real ranks compute:

- point-to-point traffic, metadata objects and a rank's index in a group, mapped from rank 0's
  groups (the fake world hands every rank rank 0's) to each simulated rank's own;
- all-reduces over groups that span pipeline ranks (the loss, the gradient norm) done across the
  threads; any other collective over several slices refused (torch's own would skip groups whose
  ranks are not all in the calling mode: a silent wrong result);
- ``loss_parallel()``'s process-wide handlers counted, so one stage's exit keeps another's.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pickle
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeWork, PythonCallbackWork, Work
from torch.distributed._local_tensor import (
    _PATCHED_DEVICE_MESH_METHODS,
    _PATCHED_RANDOM_FUNCTIONS,
    LocalRunnerMode,
    LocalTensor,
    LocalTensorMode,
    _c10d,
    local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup
from torch.distributed.tensor.parallel import loss as tp_loss

STALL_SECONDS = 60.0
"""A pipeline rank that has waited this long twice over, while every other waited and nothing was
sent, received or finished, is in a deadlock: the simulation stops with an error instead of hanging."""


class StageAborted(RuntimeError):
    """Raised in a pipeline rank's thread once another has failed (the first failure is reported)."""


def _pg(group: Any) -> ProcessGroup:
    return group if isinstance(group, ProcessGroup) else ProcessGroup.unbox(group)


class Stages(LocalRunnerMode):
    """One thread per slice of simulated ranks (a pipeline rank's), each under its own
    ``LocalTensorMode``, running ``fn()``; ``results`` holds each slice's return, ``failed`` the
    first error. One thread runs at a time and hands over where it waits: for a tensor or object
    another sends, or for the others' part of a collective over ranks of several slices."""

    def __init__(self, slices: list[frozenset[int]], fn: Callable[[], Any]) -> None:
        # (no ranks for torch's own send/recv queues, one per pair of ranks -- a million at 1,024
        # ranks: the traffic here is matched by deliver/claim/collect)
        super().__init__(frozenset(), len(slices), self._stage)
        self.slices, self.fn = slices, fn
        self.results: list[Any] = [None] * len(slices)
        self.failed: BaseException | None = None
        self.alive, self.waiting, self.progress = len(slices), 0, 0
        self.sent: dict[tuple[int, int], list] = defaultdict(lambda: [0, {}])
        self.posted: dict[tuple[int, int], int] = defaultdict(int)
        self.mail: dict[tuple, deque] = defaultdict(deque)
        self.board: dict[tuple, dict] = {}
        self.calls: dict[tuple, int] = defaultdict(int)
        self._groups: dict[str, dict[int, tuple[list[int], int]]] = {}
        self.entered: list[int] = []  # slices in the order their modes were entered

    def _stage(self, index: int) -> None:
        # One intra-op thread per stage thread: an OpenMP region a non-main thread opens costs
        # milliseconds here (a 0.35 ms attention backward took 3.9 ms on 2 threads, 0.3 ms on one),
        # and a simulated rank's operations are small. The caller restores its own count.
        torch.set_num_threads(1)
        mode = LocalTensorMode(self.slices[index])
        mode.__enter__()
        self.entered.append(index)
        try:
            self.results[index] = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller once every thread stops
            if self.failed is None:  # (later ones are its echo: StageAborted)
                self.failed = e
        finally:
            self.alive -= 1
            self._progressed()
            # Each mode patches torch's DeviceMesh methods process-wide on entry and puts back what it
            # found on exit: a slice leaving first would unpatch them under the others still running
            # (their next mesh coordinates rank 0's), and the last would leave them patched. So no
            # slice leaves before every one is done, and they leave in the reverse order of entry.
            while self.alive or self.entered[-1] != index:
                self._run_cond.wait()
            self.entered.pop()
            mode.__exit__(None, None, None)
            self._progressed()

    def _progressed(self) -> None:
        self.progress += 1
        self._run_cond.notify_all()

    def index(self) -> int | None:
        """The calling thread's slice (None outside the runner's threads)."""
        return getattr(LocalRunnerMode.runner_context, "id", None)

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Hand over until ``ready()``; raise if another thread failed or every thread waits."""
        mode = local_tensor_mode()
        if mode is not None and mode._disable:
            # Disabling a mode restores torch's DeviceMesh methods for every thread: the thread that
            # runs next would compute rank 0's mesh coordinates for all its ranks.
            raise AssertionError("a pipeline rank waited with its LocalTensorMode disabled")
        seen, idle = self.progress, 0
        while not ready():
            if self.failed is not None:
                raise StageAborted("another pipeline rank failed")
            self.waiting += 1
            woke = self._run_cond.wait(timeout=STALL_SECONDS)
            self.waiting -= 1
            if self.progress != seen:
                seen, idle = self.progress, 0
            elif not woke and self.waiting + 1 >= self.alive:
                idle += 1
                if idle >= 2:
                    raise RuntimeError(f"the simulated pipeline is in a deadlock: every pipeline rank "
                                       f"waits, this one for {what}")
        self.progress += 1

    def deliver(self, src: int, dst: int, value: torch.Tensor) -> None:
        """Rank ``src``'s next message to ``dst``."""
        box = self.sent[(src, dst)]
        box[1][box[0]] = value
        box[0] += 1
        self._progressed()

    def claim(self, src: int, dst: int) -> int:
        """A receive posted by ``dst``: its message is the next one from ``src`` not yet claimed
        (gloo and NCCL match receives to sends in the order they are posted, not waited on)."""
        n = self.posted[(src, dst)]
        self.posted[(src, dst)] = n + 1
        return n

    def collect(self, src: int, dst: int, ticket: int) -> torch.Tensor:
        messages = self.sent[(src, dst)][1]
        self.wait_until(lambda: ticket in messages, f"rank {dst} receiving from rank {src}")
        return messages.pop(ticket)

    def groups(self, group: Any) -> dict[int, tuple[list[int], int]]:
        """{rank: (the ranks of its own group of ``group``'s shape, its index there)}: ``group`` is
        rank 0's, as the fake world hands every rank."""
        pg = _pg(group)
        if pg.group_name not in self._groups:
            ranks, offsets, _ = _c10d._prepare_collective_groups(pg)
            out = {}
            for o in offsets:
                members = [o + r for r in ranks]
                out.update({r: (members, i) for i, r in enumerate(members)})
            self._groups[pg.group_name] = out
        return self._groups[pg.group_name]

    def group_rank(self, group: Any) -> int | None:
        """The calling slice's index in ``group`` where every rank of the slice has the same one."""
        i = self.index()
        if i is None:
            return None
        at = self.groups(group)
        found = {at[r][1] for r in self.slices[i]}
        return found.pop() if len(found) == 1 else None

    def spans_slices(self, group: Any) -> bool:
        """Whether the calling slice's groups of ``group``'s shape hold ranks of other slices."""
        i = self.index()
        at = self.groups(group)
        return i is not None and any(not set(at[r][0]) <= self.slices[i] for r in self.slices[i])

    def all_reduce(self, local: dict[int, torch.Tensor], group: Any, op: Any) -> None:
        """An all-reduce over groups holding ranks of several slices: each slice leaves a copy of
        its part and waits for the rest; torch's reduction of each group is copied into its own."""
        at, name = self.groups(group), _pg(group).group_name
        self.calls[(self.index(), name)] += 1
        key = (name, self.calls[(self.index(), name)])  # (every slice issues them in one order)
        slot = self.board.setdefault(key, {"parts": {}, "read": set(), "every": set()})
        slot["parts"].update({r: t.clone() for r, t in local.items()})
        for r in local:
            slot["every"].update(at[r][0])
        self._progressed()
        need = {m for r in local for m in at[r][0]}
        self.wait_until(lambda: need <= slot["parts"].keys(), f"an all-reduce over group {name}")
        reduced: dict[tuple, torch.Tensor] = {}
        for r, t in local.items():
            members = tuple(at[r][0])
            if members not in reduced:
                reduced[members] = _c10d._local_reduce(op, [slot["parts"][m] for m in members])
            t.copy_(reduced[members])
        slot["read"].update(local)
        if slot["read"] >= slot["every"]:
            del self.board[key]

    def post(self, key: tuple, payload: bytes) -> None:
        self.mail[key].append(payload)
        self._progressed()

    def take(self, key: tuple) -> bytes:
        box = self.mail[key]
        self.wait_until(lambda: bool(box), f"an object over group {key[0]} from its rank {key[1]}")
        return box.popleft()


@contextlib.contextmanager
def across_stages(stages: Stages) -> Iterator[None]:
    """While ``stages`` runs: torch's point-to-point and collective implementations, ``dist``'s
    blocking and object point-to-point and ``get_rank``, and ``loss_parallel``'s handlers, replaced
    by their across-thread versions (restored after)."""
    replaced = {**_c10d_adapters(stages), **_dist_adapters(stages), **_loss_parallel_counted()}
    originals = {(m, n): getattr(m, n) for m, n in [*replaced, *_patched_by_modes()]}
    for (module, name), fn in replaced.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def _patched_by_modes() -> list[tuple[Any, str]]:
    """What each thread's ``LocalTensorMode`` patches process-wide on entry (DeviceMesh's coordinate
    methods, torch's seeding functions) and puts back on exit as it found them: threads that exit in
    another order than they entered would leave the patches on (restored here with the rest)."""
    out: list[tuple[Any, str]] = [(DeviceMesh, n) for n in _PATCHED_DEVICE_MESH_METHODS]
    for name, _ in _PATCHED_RANDOM_FUNCTIONS:
        module, attr = name.rsplit(".", 1)
        out.append((importlib.import_module(module), attr))
    return out


def _c10d_adapters(stages: Stages) -> dict[tuple, Callable]:
    """LocalTensorMode's c10d implementations: send/recv expanded per simulated rank to its own
    peer, all-reduce across threads, and every other collective refused across slices."""
    def send(tensors: list, group: Any, dst: int, tag: int) -> Any:
        at = stages.groups(group)
        for r, value in tensors[0]._local_tensors.items():  # (a copy: a real send does not alias)
            stages.deliver(r, at[r][0][dst], value.detach().clone())
        return Work.boxed(FakeWork())

    def recv(tensors: list, group: Any, src: int, tag: int) -> Any:
        at, t = stages.groups(group), tensors[0]
        tickets = {r: (at[r][0][src], stages.claim(at[r][0][src], r)) for r in t._local_tensors}

        def wait(timeout: object) -> bool:
            got = {r: stages.collect(peer, r, n) for r, (peer, n) in tickets.items()}  # (mode enabled)
            with maybe_disable_local_tensor_mode():
                for r, buffer in t._local_tensors.items():
                    buffer.copy_(got[r])
            return True
        return Work.boxed(PythonCallbackWork(wait))

    original_all_reduce = _c10d._local_all_reduce_

    def all_reduce(tensors: list, group: Any, op_so: Any, sparse: Any = None, async_op: bool = True,
                   timeout: int = -1) -> Any:
        if not stages.spans_slices(group):
            return original_all_reduce(tensors, group, op_so, sparse, async_op, timeout)
        stages.all_reduce(tensors[0]._local_tensors, group, op_so.op())
        return tensors, Work.boxed(FakeWork())

    kept = ("_local_send", "_local_recv_", "_local_recv_any_source_", "_local_all_reduce_", "_local_reduce",
            "_local_barrier", "_local_monitored_barrier_")
    out = {(_c10d, n): _refused_across(stages, n, getattr(_c10d, n)) for n in vars(_c10d)
           if n.startswith("_local_") and n not in kept}
    return {**out, (_c10d, "_local_send"): send, (_c10d, "_local_recv_"): recv,
            (_c10d, "_local_all_reduce_"): all_reduce}


def _refused_across(stages: Stages, name: str, fn: Callable) -> Callable:
    sig = inspect.signature(fn)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs).arguments
        group = bound.get("process_group_so")
        if group is None:
            group = _c10d._resolve_pg_or_name(bound["group_name"])
        if stages.spans_slices(group):
            raise NotImplementedError(f"verify --ranks: {name.strip('_')} over ranks of several pipeline "
                                      "stages is not simulated")
        return fn(*args, **kwargs)
    return guarded


def _dist_adapters(stages: Stages) -> dict[tuple, Callable]:
    """``dist.send``/``recv`` (torch's stages send plain tensors of votes), ``send_object_list`` /
    ``recv_object_list`` (the stages' metadata: one object per slice, the same on its every rank)
    and ``get_rank`` of a group (a slice's own index where all its ranks share one)."""
    get_rank = dist.get_rank

    def as_local(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, LocalTensor):
            return t
        return LocalTensor({r: t.clone() for r in stages.slices[stages.index()]})

    def blocking_send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                      group_dst: int | None = None) -> None:
        dist.isend(as_local(tensor), dst=dst, group=group, tag=tag, group_dst=group_dst).wait()

    def blocking_recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                      group_src: int | None = None) -> int:
        buffer = as_local(tensor)
        dist.irecv(buffer, src=src, group=group, tag=tag, group_src=group_src).wait()
        if buffer is not tensor:  # a plain tensor: what every rank of the slice received, alike
            values = list(buffer._local_tensors.values())
            if any(not torch.equal(v, values[0]) for v in values):
                raise NotImplementedError("verify --ranks: a pipeline rank's ranks received different "
                                          "values into one plain tensor")
            with maybe_disable_local_tensor_mode():
                tensor.copy_(values[0])
        return src if src is not None else dist.get_global_rank(group, group_src)

    def mailbox(group: Any, peer: int | None, group_peer: int | None, sending: bool) -> tuple:
        group = group or dist.group.WORLD
        other = group_peer if group_peer is not None else dist.get_group_rank(group, peer)
        me = stages.group_rank(group)
        return (_pg(group).group_name, me, other) if sending else (_pg(group).group_name, other, me)

    def send_object_list(object_list: list, dst: int | None = None, group: Any = None, device: Any = None,
                         group_dst: int | None = None, use_batch: bool = False) -> None:
        stages.post(mailbox(group, dst, group_dst, True), pickle.dumps(object_list))

    def recv_object_list(object_list: list, src: int | None = None, group: Any = None, device: Any = None,
                         group_src: int | None = None, use_batch: bool = False) -> int:
        key = mailbox(group, src, group_src, False)
        object_list[:] = pickle.loads(stages.take(key))  # noqa: S301 - this process's own objects
        return dist.get_global_rank(group or dist.group.WORLD, key[1])

    def rank_in(group: Any = None) -> int:
        mine = stages.group_rank(group or dist.group.WORLD)
        return mine if mine is not None else get_rank(group)

    return {(dist, "send"): blocking_send, (dist, "recv"): blocking_recv,
            (dist, "send_object_list"): send_object_list, (dist, "recv_object_list"): recv_object_list,
            (dist, "get_rank"): rank_in}


def _loss_parallel_counted() -> dict[tuple, Callable]:
    """torch's ``loss_parallel()`` installs DTensor handlers process-wide and removes them on exit:
    with pipeline ranks as threads, one's exit must not take away another's (counted)."""
    enable, disable, inside = tp_loss._enable_custom_loss_ops, tp_loss._disable_custom_loss_ops, [0]

    def entered() -> None:
        inside[0] += 1
        if inside[0] == 1:
            enable()

    def left() -> None:
        inside[0] -= 1
        if inside[0] == 0:
            disable()
    return {(tp_loss, "_enable_custom_loss_ops"): entered, (tp_loss, "_disable_custom_loss_ops"): left}
