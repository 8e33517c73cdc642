"""Every rank of one context-parallel group on one device: a process per rank, joined by loopback
groups that take the calls the attention makes on torch.distributed (all_to_all_single,
all_reduce, a batch of sends and receives) on the same buffers.

Why: one GPU cannot host two NCCL ranks, yet the GPU kernels of ring, double-ring, Ulysses and 2D
attention must see the slices, strides and dtypes of a multi-GPU run. Here they do: the attention
code is the trainer's (comm.py sends a call to a loopback group instead of torch.distributed), and
only the transport differs -- tensors travel through the host between processes, so a message
costs a copy out and a copy in, and timings of a loopback run mean nothing. The transport holds
the calls to NCCL's contract, which a copy would let pass: buffers contiguous, a message received
into a buffer of its shape, dtype and device, a sent buffer left alone until its request is
waited for.

Processes, not threads: autograd runs the backward of CUDA tensors on one engine thread per
device, so two ranks' backwards in one process would wait for each other's messages on that one
thread forever.
"""
from __future__ import annotations

import collections
import io
import queue
import threading
from functools import partial
from typing import Callable, Dict, List, Sequence

import torch
import torch.multiprocessing as mp

from megatron.longseq.parallel_state import ProcessGroups, RankGrid

CP_GROUPS = ("cp", "hp", "ring", "inner", "outer")
TIMEOUT = 300.0  # seconds a receive waits: a rank that failed leaves its peers waiting


class Mailbox:
    """This rank's inbound queue, with the messages that came before they were asked for.
    Between processes a message is serialised when sent: the sender may reuse its buffer once the
    batch is waited for, and may exit before the message is read (a shared tensor would die with
    it). Between threads it is a copy on the same device and stream."""

    def __init__(self, rank: int, queues: Sequence, threads: bool = False):
        self.rank, self.queues = rank, queues
        self.pack, self.unpack = (torch.Tensor.clone, lambda t: t) if threads else (_dumps, _loads)
        self.early: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def send(self, group: str, dst: int, tensor: torch.Tensor) -> None:
        _require(tensor.is_contiguous(), f"rank {self.rank} sends a non-contiguous {tuple(tensor.shape)} on {group}")
        self.queues[dst].put((group, self.rank, self.pack(tensor.detach()), _meta(tensor)))

    def receive(self, group: str, src: int, into: torch.Tensor) -> None:
        """The next message from `src` on `group` (per sender and group in order, as NCCL's) into
        `into`, which must be contiguous and of the message's shape, dtype and device."""
        key = (group, src)
        while not self.early[key]:
            try:
                name, sender, tensor, meta = self.queues[self.rank].get(timeout=TIMEOUT)
            except queue.Empty:
                raise TimeoutError(f"loopback rank {self.rank}: nothing from rank {src} on {group} "
                                   f"in {TIMEOUT:.0f} s") from None
            self.early[(name, sender)].append((tensor, meta))
        tensor, meta = self.early[key].popleft()
        _require(into.is_contiguous() and meta == _meta(into), f"rank {self.rank} receives {meta} from rank {src} "
                                                               f"on {group} into a buffer {_meta(into)}, contiguous: "
                                                               f"{into.is_contiguous()}")
        into.copy_(self.unpack(tensor))


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device.type


def _require(ok: bool, what: str) -> None:
    """NCCL's side of a call, which a loopback copy would let pass."""
    if not ok:
        raise RuntimeError(f"loopback: {what} (NCCL would hang or deliver wrong values)")


class _Done:
    """A request of `LoopbackGroup.batch`, one per send or receive: a receive happens in wait()."""

    def __init__(self, finish: Callable[[], None] = lambda: None):
        self.finish = finish

    def wait(self) -> bool:
        self.finish()
        return True


class LoopbackGroup:
    """One named group of this rank, taking torch.distributed's calls (comm.py's `_backend`)."""

    loopback = True

    def __init__(self, name: str, members: List[int], mailbox: Mailbox):
        self.name, self.members, self.mailbox = name, members, mailbox

    def size(self) -> int:
        return len(self.members)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group=None):
        """Piece i of `input` to member i; member i's piece for us into piece i of `output`
        (flat buffers, split sizes in elements, as comm.py calls it)."""
        for buf, sizes in ((input, input_split_sizes), (output, output_split_sizes)):
            _require(buf.is_contiguous() and sum(sizes) == buf.numel() and len(sizes) == self.size(),
                     f"all_to_all_single on {self.name}: split sizes {list(sizes)} for a buffer of {buf.numel()}, "
                     f"contiguous: {buf.is_contiguous()}")
        for dst, piece in zip(self.members, torch.split(input, input_split_sizes)):
            self.mailbox.send(self.name, dst, piece)
        for src, piece in zip(self.members, torch.split(output, output_split_sizes)):
            self.mailbox.receive(self.name, src, piece)

    def all_reduce(self, tensor, group=None):
        for dst in self.members:
            self.mailbox.send(self.name, dst, tensor)
        total = torch.zeros_like(tensor)
        for src in self.members:
            part = torch.empty_like(tensor)
            self.mailbox.receive(self.name, src, part)
            total += part
        tensor.copy_(total)

    def batch(self, sends, recvs) -> List[_Done]:
        """Sends [(tensor, rank)] go out now; each receive [(buffer, rank)] fills its buffer when
        its request is waited for (comm.py's `_start_batch`). A sent tensor written before its
        request is waited for is refused there: NCCL may still be reading it."""
        for t, dst in sends:
            self.mailbox.send(self.name, dst, t)
        return [_Done(partial(_unchanged, t, t._version, self.name)) for t, _ in sends] + [
            _Done(partial(self.mailbox.receive, self.name, src, buf)) for buf, src in recvs]


def _unchanged(t: torch.Tensor, version: int, group: str) -> None:
    _require(t._version == version, f"a tensor sent on {group} was written before its request was waited for")


def loopback_groups(grid: RankGrid, rank: int, mailbox: Mailbox) -> ProcessGroups:
    """This rank's context-parallel groups of `grid` (tp = dp = pp = 1) as loopback groups,
    members from the grid as build_process_groups takes them."""
    if grid.world_size != grid.cp:
        raise ValueError(f"a loopback run holds one context-parallel group, not {grid.describe()}")
    pgs = ProcessGroups(grid=grid, rank=rank)
    for name, group_list in grid.all_groups().items():
        for members in group_list:
            if rank in members:
                pgs.members[name] = members
                pgs.groups[name] = LoopbackGroup(name, members, mailbox) if name in CP_GROUPS else None
    return pgs


def _dumps(obj) -> bytes:
    """Tensors (anywhere in obj) as host bytes, dtype and strides kept."""
    buf = io.BytesIO()
    torch.save(_to_host(obj), buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _to_host(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_host(x) for x in obj)
    return obj


def _entry(rank: int, fn, grid: RankGrid, queues, results, args) -> None:
    torch.set_num_threads(1)
    results.put((rank, _dumps(fn(loopback_groups(grid, rank, Mailbox(rank, queues)), *args))))


def run_group(fn, grid: RankGrid, *args, start_method: str = "spawn") -> list:
    """fn(pgs, *args) on every rank of `grid` (one context-parallel group), each a process of its
    own; their results by rank, tensors on the host. fn must be a module-level function. A
    process never forked from one that started CUDA: "spawn", or a preloaded "forkserver"."""
    ctx = mp.get_context(start_method)
    queues = [ctx.Queue() for _ in range(grid.world_size)]
    results = ctx.Queue()
    procs = mp.start_processes(_entry, args=(fn, grid, queues, results, args), nprocs=grid.world_size,
                               join=False, start_method=start_method)
    out = {}
    while len(out) < grid.world_size:
        try:
            rank, data = results.get(timeout=1.0)
            out[rank] = _loads(data)
        except queue.Empty:
            procs.join(timeout=0)  # raises with a failed rank's traceback
    while not procs.join():
        pass
    return [out[r] for r in range(grid.world_size)]


class RankThreads:
    """Every rank of `grid` as a thread of this process that lives from call to call, messages
    copied on the device. Only for work that calls no autograd backward on CUDA (see above): the
    ring's forward and backward functions called directly, as the benchmark does. A rank keeps its
    thread, and with it what libraries keep per thread: cuDNN's attention graphs are, and a new
    thread per call would rebuild them in every timed call."""

    def __init__(self, grid: RankGrid):
        self.grid, self.jobs = grid, [queue.Queue() for _ in range(grid.world_size)]
        for rank in range(grid.world_size):
            threading.Thread(target=self._serve, args=(rank,), daemon=True).start()

    def _serve(self, rank: int) -> None:
        for job in iter(self.jobs[rank].get, None):
            job()

    def run(self, fn, *args) -> list:
        """fn(pgs, *args) on every rank; their results by rank (the first failure raised)."""
        n = self.grid.world_size
        queues, out, failed, done = [queue.Queue() for _ in range(n)], [None] * n, [], threading.Semaphore(0)

        def job(rank):
            try:
                out[rank] = fn(loopback_groups(self.grid, rank, Mailbox(rank, queues, threads=True)), *args)
            except BaseException as e:  # noqa: B036 -- handed to the caller below
                failed.append(e)
            finally:
                done.release()

        for rank in range(n):
            self.jobs[rank].put(partial(job, rank))
        for _ in range(n):
            done.acquire()
        if failed:
            raise failed[0]
        return out

    def close(self) -> None:
        for jobs in self.jobs:
            jobs.put(None)


def run_threads(fn, grid: RankGrid, *args) -> list:
    """fn(pgs, *args) once on every rank of `grid`, as threads (RankThreads); results by rank."""
    threads = RankThreads(grid)
    try:
        return threads.run(fn, *args)
    finally:
        threads.close()
