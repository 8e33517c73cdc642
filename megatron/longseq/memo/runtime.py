"""MEMO's token-wise activation swapping and recomputation (section 4.1), device-agnostic.

Every tensor a managed transformer layer saves for backward passes through autograd's saved-
tensor hooks and is classed as
  - whole: the layer input (S_input), and the attention output and its log-sum-exp (S_attn, saved
    by attention.core's kept attention): offloaded whole;
  - tokens: every other saved tensor with the layer's tokens as leading dimension (norm inputs,
    q, k and v, linear inputs, MLP activations, ...): its first alpha of tokens offloaded, the
    rest dropped;
  - kept: parameters and small tensors without a token dimension stay where they are.
The forward of layer i ends by staging what goes to host memory in rounding buffer i % 2 (compute
stream, once the offload of layer i-2 has left that buffer) and copying it from there into a
block of the host pool (offload stream); the layer's own tensors are then free at once.
The backward of layer i begins by issuing its prefetch (if not already running) and layer i-1's
into the other buffer -- it runs during this backward -- then waits for its own prefetch only,
recomputes the dropped tokens by running the layer on them alone (every op but attention is
token-wise; attention hands back its kept output rows and records q, k, v of those tokens) and
completes each token-wise tensor in place in the buffer. The last two layers keep their
activations (their backward starts at once) and are resident: everything they save stays in their
rounding buffer, as the paper's two buffers hold every layer's skeletal activations, so keeping
them costs the device nothing beyond the buffers. The first of them issues the last managed
layer's prefetch as its backward begins, like any layer i for layer i-1. Where a schedule runs
another unit's forward before a resident layer's backward (Seq1F1B segments), the resident moves
out of the buffer the new forward takes, into memory of its own. A pipeline stage without kept
layers is told by the schedule (Pipeline.unit_hooks) when a unit's backward begins, before the
gradient arrives.

`Memo.measure` runs an iteration without host memory to size the buffers and the pool before
any is allocated: alpha 0, the layer input left where it is, everything else recomputed in
backward (the kept attention's output too), so it holds what full recompute holds;
`Memo.allocate` allocates them.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron.longseq.memo.alpha import LayerSizes, offloaded_rows
from megatron.longseq.memo.buffers import HostPool, RoundingBuffers, aligned
from megatron.longseq.memo.replay import TokenReplay
from megatron.longseq.memo.streams import Streams

_ACTIVE: Optional["LayerState"] = None  # the layer whose forward or replay is running


def active_layer() -> Optional["LayerState"]:
    return _ACTIVE


@contextlib.contextmanager
def _activate(state):
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, state
    try:
        yield
    finally:
        _ACTIVE = previous


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over t's entire storage (for offloading a storage once, whatever its views)."""
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // t.element_size(),))


def _rebuild(copy: torch.Tensor, view: tuple) -> torch.Tensor:
    """The saved view (size, stride, offset within its storage) over the 1-D copy of that storage;
    the copy may itself start anywhere in a rounding buffer."""
    size, stride, offset = view
    return torch.as_strided(copy, size, stride, copy.storage_offset() + offset)


@dataclass
class _Item:
    """One storage saved whole, or one token-wise tensor, of a layer's forward."""

    whole: bool
    dtype: torch.dtype
    shape: tuple  # whole: (elements of the storage,); tokens: the tensor's shape
    rows: int  # leading rows sent to host memory (whole: all)
    tensor: Optional[torch.Tensor] = None  # the original, until staged (measuring: until backward)
    slot: int = 0  # byte offset in the rounding buffer
    host: int = 0  # byte offset in the layer's host block

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        return self.shape[0] * self.row_bytes

    @property
    def sent_bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass
class _Saved:
    kind: str  # "keep", "whole" (a storage, rebuilt by as_strided) or "tokens"
    tensor: Optional[torch.Tensor] = None  # keep
    key: int = -1  # the item
    view: tuple = ()  # whole: (size, stride, offset)


class Memo:
    """The runtime of one training run: alpha, streams, rounding buffers, host pool."""

    def __init__(self, alpha: float, device: torch.device, param_storages=(), log: Optional[list] = None):
        self.alpha = alpha
        self.device = device
        self.cuda = device.type == "cuda"
        self.streams = Streams(device, log)
        self.buffers: Optional[RoundingBuffers] = None
        self.pool: Optional[HostPool] = None
        self.param_storages = set(param_storages)
        self.last: Optional[LayerState] = None  # the previous layer of the running forward
        # the running forward's last layer, until the schedule's end of the unit's forward
        self.tail: Optional[LayerState] = None
        self.tails: Dict[tuple, weakref.ref] = {}  # those last layers by schedule unit, until its backward
        self.measuring: Optional[List[LayerSizes]] = None  # sizes of every forward, while measuring
        self.resident_bytes = 0  # the largest resident layer's buffer share, measured
        self.live = self.peak_live = 0  # managed layers between forward and backward
        self.forwards = 0  # wrapped layers' forwards so far: layer i of a unit stages in buffer i % 2
        self.reading: Optional[tuple] = None  # (buffer, layer) the running backward reads
        self.allocator = None  # the planned allocator (allocator.py), when it serves this run
        self.window_handles: list = []  # hooks that mark the allocator's layer windows
        self.reset_stats()

    @property
    def host_bytes(self) -> int:
        """Host memory held now by layers waiting for their backward."""
        return self.pool.in_use if self.pool is not None else 0

    def reset_stats(self) -> None:
        self.stats = {"offloaded_bytes": 0, "recomputed_tokens": 0, "layers": 0, "peak_host_bytes": self.host_bytes}

    # ---- sizing ----------------------------------------------------------------------------------
    def measure(self, run: Callable[[], None]) -> List[LayerSizes]:
        """Run `run` (an iteration) with nothing sent to host memory: alpha 0, each layer's input
        left on the device, the rest recomputed. Returns what every managed forward saved;
        `peak_live` is set."""
        self.measuring, self.peak_live = [], 0
        try:
            run()
            return self.measuring
        finally:  # the last layers' states hold whole tensors when measuring: not while allocating
            self.measuring, self.reading, self.forwards, self.last, self.tail = None, None, 0, None, None

    def allocate(self, buffer_bytes: int, blocks: int, block_bytes: int) -> None:
        """The two rounding buffers and the host pool, once, before training: replacing them would
        free memory the side streams may still be copying to or from."""
        if self.pool is not None:
            raise RuntimeError("MEMO's rounding buffers and host pool are allocated once, before training")
        self.buffers = RoundingBuffers(max(buffer_bytes, self.resident_bytes), self.device)
        self.pool = HostPool(blocks, block_bytes, pin=self.cuda)

    def calibrate(self, run: Callable[[], None]) -> List[LayerSizes]:
        """Measure with `run`, then allocate for the current alpha (no LP: for tests; the trainer and
        tools/plan_memory.py size alpha with memo_setup.choose_alpha)."""
        sizes = self.measure(run)
        if sizes:  # a pipeline stage may manage no layer
            self.allocate(max(s.buffer_bytes for s in sizes), self.peak_live,
                          max(s.host_bytes(self.alpha) for s in sizes))
        return sizes

    def make_room(self, b: int) -> None:
        """Buffer b is about to be written: a resident layer in it whose backward has not begun
        moves to memory of its own first (schedules with several units' forwards before their
        backwards: Seq1F1B segments, a pipeline's warm-up)."""
        ref, self.buffers.resident[b] = self.buffers.resident[b], None
        state = ref() if ref is not None else None
        if state is not None and state.rebuilt is None:
            state.move_out()

    def reads_done(self) -> None:
        """For the log: the backward that read a buffer last is over (it was issued on the compute
        stream before now: the next layer's backward or a forward has begun)."""
        if self.reading is not None:
            self.streams.access("read", "compute", *self.reading)
            self.reading = None

    # ---- the layer wrapper -----------------------------------------------------------------------
    def wrap(self, layers, keep_last: int = 2) -> None:
        """Manage every layer of `layers` but the last `keep_last` (in place, like recompute);
        those keep their activations, in the rounding buffers (resident), when any is managed."""
        layers = list(layers)
        managed = max(len(layers) - keep_last, 0)
        wrapped = layers if managed else []  # no managed layer: no buffers for the kept ones either
        for index, layer in enumerate(wrapped):
            layer.forward = _memo_forward(self, layer.forward, index, first=index == 0,
                                          last=index == len(wrapped) - 1, resident=index >= managed)

    # ---- the pipeline schedule's units (seq1f1b.Pipeline.unit_hooks) ------------------------------
    def forward_done(self, unit: tuple) -> None:
        """The forward of schedule unit (chunk, micro-batch, segment) is over: its last layer waits
        for the unit's backward (a resident one has nothing to prefetch)."""
        state, self.tail = self.tail, None
        if state is not None:
            self.tails[unit] = weakref.ref(state)

    def backward_begins(self, unit: tuple) -> None:
        """Before the unit's backward waits for its gradient (a stage without kept layers): its last
        managed layer's copies run while the gradient is on its way (section 4.1: a layer's copies
        overlap what runs before its backward)."""
        ref = self.tails.pop(unit, None)
        if ref is not None:
            _start_prefetch(ref)


def _memo_forward(memo: Memo, forward, index: int, first: bool, last: bool, resident: bool = False):
    def run(hidden_states, **kwargs):
        if not torch.is_grad_enabled():
            return forward(hidden_states=hidden_states, **kwargs)
        if first:
            memo.last = None
        state = LayerState(memo, forward, index, hidden_states, kwargs, previous=memo.last, resident=resident)
        memo.last = state
        out = state.forward()
        if last:
            memo.tail = state
        return out

    return run


def _start_prefetch(state_ref) -> None:
    state = state_ref()
    if state is not None:
        state.memo.reads_done()  # the previous backward read its buffer before now
        state.prefetch()


def _release(memo: Memo, held: list) -> None:
    """A layer's host block back to the pool (also when a forward never gets its backward)."""
    block, held[0] = held[0], None
    if block is not None:
        memo.pool.give_back(block, held[1])
    memo.live -= held[2]
    held[2] = 0


class LayerState:
    """One wrapped layer's forward (managed, or resident): what it saved, where it went, and how
    it comes back."""

    def __init__(self, memo: Memo, forward, index: int, hidden_states, kwargs, previous, resident: bool = False):
        self.memo, self.fn, self.index, self.kwargs = memo, forward, index, kwargs
        self.previous = previous
        self.input = hidden_states
        self.tokens = hidden_states.shape[0]
        # resident: one of the last layers, whose backward follows at once -- everything it saved
        # stays in its rounding buffer, nothing goes to host memory and nothing is recomputed
        self.resident = resident
        self.home: Optional[torch.Tensor] = None  # a resident's own memory, once moved out of its buffer
        self.n_off = self.tokens if resident else 0 if memo.measuring is not None else offloaded_rows(
            memo.alpha, self.tokens)
        self.buffer = memo.forwards % 2
        self.id = memo.forwards
        memo.forwards += 1
        self.items: List[_Item] = []
        self.storage_keys: Dict[int, int] = {}  # storage ptr -> item (whole storages)
        self.token_index: Dict[tuple, int] = {}  # (ptr, shape, stride, offset) -> item
        self._alive: List[torch.Tensor] = []
        self.in_attention = False
        self.attention_key: Optional[int] = None
        self.attention_keys: tuple = ()  # the kept attention's (out, lse) items
        self.phase = "forward"
        self.rebuilt: Optional[Dict[int, torch.Tensor]] = None
        self.held = [None, None, 0]  # host block, (order, event) after its prefetch, live count
        self.prefetched = None  # event: this layer's prefetch copies are done

    # ---- forward -----------------------------------------------------------------------------
    def forward(self):
        # MEMO: the layer input always goes to host memory whole
        self.input_key = self._whole_item(self.input)
        self._input_view = (tuple(self.input.shape), self.input.stride(), self.input.storage_offset())
        self._input_grad = self.input.requires_grad
        # a resident layer is never replayed: its attention takes the plain path (no kept output)
        active = contextlib.nullcontext() if self.resident else _activate(self)
        with active, torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            out = self.fn(hidden_states=self.input, **self.kwargs)
        if self.resident:
            self._stay()
        else:
            self._managed_forward_done()
        # a forward that never gets a backward releases when it is dropped (the finalizer must
        # not reference the state itself, or the state could never be dropped)
        weakref.finalize(self, _release, self.memo, self.held)
        self.input = None
        self._alive = []
        return out

    def _managed_forward_done(self) -> None:
        self.memo.stats["layers"] += 1
        self.memo.live += 1
        self.held[2] = 1
        self.memo.peak_live = max(self.memo.peak_live, self.memo.live)
        if self.memo.measuring is not None:
            self.memo.measuring.append(self.sizes())
            self._drop_measured()
        else:
            self._offload()

    def _drop_measured(self) -> None:
        """Measuring: the replay recomputes every token, and the kept attention's (out, lse) from
        its q, k, v, so the layer holds its input only, as full recompute does. SDPA's saved
        tensors stay (its dropout mask cannot be drawn again)."""
        dropped = set(self.attention_keys)
        for k, item in enumerate(self.items):
            if not item.whole or k in dropped:
                item.tensor = None

    def sizes(self) -> LayerSizes:
        wholes = [i.full_bytes for i in self.items if i.whole]
        return LayerSizes(tuple(wholes), tuple((i.shape[0], i.row_bytes) for i in self.items if not i.whole))

    def _whole_item(self, t: torch.Tensor) -> int:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.storage_keys:
            # Keyed by address: the storage must outlive the forward, or a new tensor could take
            # its address and pass for it.
            self._alive.append(t)
            flat = _whole(t)
            self.storage_keys[ptr] = len(self.items)
            self.items.append(_Item(True, t.dtype, tuple(flat.shape), flat.shape[0], flat))
        return self.storage_keys[ptr]

    def _token_item(self, t: torch.Tensor) -> int:
        key = (t.untyped_storage().data_ptr(), tuple(t.shape), t.stride(), t.storage_offset())
        if key not in self.token_index:
            self._alive.append(t)
            self.token_index[key] = len(self.items)
            self.items.append(_Item(False, t.dtype, tuple(t.shape), self.n_off, t))
        return self.token_index[key]

    def attention(self):
        """A scope whose saved tensors are all offloaded whole: attention that cannot hand back
        (out, lse) -- torch's SDPA, for document masks and attention dropout."""
        state = self

        @contextlib.contextmanager
        def scope():
            state.in_attention = True
            try:
                yield
            finally:
                state.in_attention = False

        return scope()

    def keep_attention_output(self, out: torch.Tensor, lse: Optional[torch.Tensor] = None) -> None:
        """The attention output [s, b, h*d] (and its lse): S_attn, offloaded whole; the replay
        answers from the output, attention's backward from both."""
        self.attention_key = self._whole_item(out)
        self.attention_saved_qkv = lse is not None  # the kept attention; SDPA saved its own, whole
        if lse is not None:
            self.attention_keys = (self.attention_key, self._whole_item(lse))
        self._attention_view = (tuple(out.shape), out.stride(), out.storage_offset())
        self._attention_grad = out.requires_grad

    def pack(self, t: torch.Tensor) -> _Saved:
        # Off the run's device (on a GPU, SDPA's philox seed and offset: host scalars its backward
        # reads through a host pointer): kept where it is.
        if t.device.type != self.memo.device.type:
            return _Saved("keep", t)
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.memo.param_storages:
            return _Saved("keep", t)
        view = (tuple(t.shape), t.stride(), t.storage_offset())
        if ptr in self.storage_keys or self.in_attention or self.resident:  # a resident stages all whole
            return _Saved("whole", key=self._whole_item(t), view=view)
        if t.dim() >= 1 and t.shape[0] == self.tokens:
            return _Saved("tokens", key=self._token_item(t))
        return _Saved("keep", t)

    def _layout(self) -> tuple:
        """Slots in the rounding buffer (every tensor whole) and in the host block (what is
        sent), in saving order; returns the bytes of each."""
        slot = host = 0
        for item in self.items:
            item.slot, item.host = slot, host
            slot += aligned(item.full_bytes)
            host += aligned(item.sent_bytes)
        return slot, host

    def _offload(self) -> None:
        """Stage what goes to host memory in this layer's buffer, then copy it to a host block."""
        memo, streams, b = self.memo, self.memo.streams, self.buffer
        memo.reads_done()
        if memo.buffers is None:
            raise RuntimeError("MEMO: no rounding buffers yet; Memo.calibrate or Memo.allocate comes before training")
        buffer_need, host_need = self._layout()
        memo.buffers.check(buffer_need, self.index)
        self.held[0] = memo.pool.take(host_need, self.index)
        memo.make_room(b)
        streams.wait("compute", memo.buffers.offloaded[b])  # layer i-2's offload has left buffer b
        streams.access("write", "compute", b, self.id)
        sent = [item for item in self.items if item.sent_bytes]
        for item in sent:
            staged = self._slot(item, item.sent_bytes).view(item.dtype).view((item.rows,) + item.shape[1:])
            streams.copy("compute", staged, item.tensor[: item.rows])
        for item in self.items:
            item.tensor = None
        staged = streams.event("compute")
        streams.wait("offload", staged)
        streams.wait("offload", memo.pool.released)  # the block's previous bytes have been read back
        streams.access("read", "offload", b, self.id)
        streams.access("write", "offload", ("host", self.held[0]), self.id)
        for item in sent:
            streams.copy("offload", memo.pool.view(self.held[0], item.host, item.sent_bytes),
                         self._slot(item, item.sent_bytes))
        memo.buffers.offloaded[b] = streams.event("offload")
        memo.stats["offloaded_bytes"] += sum(item.sent_bytes for item in self.items)
        memo.stats["peak_host_bytes"] = max(memo.stats["peak_host_bytes"], memo.host_bytes)

    def _slot(self, item: _Item, nbytes: int) -> torch.Tensor:
        if self.home is not None:
            return self.home[item.slot : item.slot + nbytes]
        return self.memo.buffers.view(self.buffer, item.slot, nbytes)

    def _stay(self) -> None:
        """A resident layer: everything it saved, whole, into its rounding buffer, where its
        backward reads it (section 4.1: the two buffers hold every layer's skeletal activations;
        the last two need no copy to host memory). Measuring: left where it is, the buffer's
        size noted."""
        memo, streams, b = self.memo, self.memo.streams, self.buffer
        self.staged_bytes, _ = self._layout()
        if memo.measuring is not None:
            memo.resident_bytes = max(memo.resident_bytes, self.staged_bytes)
            return
        memo.reads_done()
        memo.buffers.check(self.staged_bytes, self.index)
        memo.make_room(b)
        streams.wait("compute", memo.buffers.offloaded[b])  # layer i-2's offload has left buffer b
        streams.access("write", "compute", b, self.id)
        for item in self.items:
            streams.copy("compute", self._slot(item, item.full_bytes).view(item.dtype).view(item.shape), item.tensor)
            item.tensor = None
        self.prefetched = streams.event("compute")
        memo.buffers.resident[b] = weakref.ref(self)

    def move_out(self) -> None:
        """This resident layer's bytes from its buffer into memory of its own (compute stream:
        before anything issued after it writes the buffer)."""
        streams = self.memo.streams
        home = torch.empty(self.staged_bytes, dtype=torch.uint8, device=self.memo.device)
        streams.access("read", "compute", self.buffer, self.id)
        streams.copy("compute", home, self.memo.buffers.view(self.buffer, 0, self.staged_bytes))
        self.home = home

    # ---- backward ----------------------------------------------------------------------------
    def unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.kind == "keep":
            return saved.tensor
        if self.rebuilt is None:
            self.rematerialize()
        if saved.kind == "tokens":
            return self.rebuilt[saved.key]
        return _rebuild(self._whole_copy(saved.key), saved.view)

    def _whole_copy(self, key: int) -> torch.Tensor:
        item = self.items[key]
        if item.tensor is not None:  # measuring: the original, left on the device
            return item.tensor
        return self._slot(item, item.full_bytes).view(item.dtype)

    def prefetch(self) -> None:
        """Bring this layer's host block back into its rounding buffer (prefetch stream)."""
        if self.prefetched is not None or self.memo.measuring is not None or self.held[0] is None:
            return
        streams, b = self.memo.streams, self.buffer
        self.memo.make_room(b)
        # the buffer is free once the backward of the layer before in it (i+2, or for the last
        # managed layer an earlier unit's) is over: it was issued on the compute stream before
        # now; and once the offloads that read it are done
        # (this layer's, or a newer forward's staged in this buffer): they run in order, so the
        # buffer's newest covers them all and this layer's host block; the other buffer's offloads
        # touch neither
        streams.wait("prefetch", streams.event("compute"))
        streams.wait("prefetch", self.memo.buffers.offloaded[b])
        streams.access("write", "prefetch", b, self.id)
        streams.access("read", "prefetch", ("host", self.held[0]), self.id)
        for item in (item for item in self.items if item.sent_bytes):
            host = self.memo.pool.view(self.held[0], item.host, item.sent_bytes)
            streams.copy("prefetch", self._slot(item, item.sent_bytes), host)
        self.prefetched = streams.event("prefetch")
        self.held[1] = self.memo.pool.prefetched(self.prefetched)

    def rematerialize(self) -> None:
        streams = self.memo.streams
        self.memo.reads_done()
        self.prefetch()  # normally issued while the next (managed or kept) layer's backward ran
        if self.previous is not None:
            self.previous.prefetch()  # overlap: layer i-1's copies come back during our backward
        streams.wait("compute", self.prefetched)  # our own copies only
        if self.home is None:
            streams.access("read", "compute", self.buffer, self.id)
            self.memo.reading = (self.buffer, self.id)
        recomputed = self._recompute() if self.n_off < self.tokens else {}
        rebuilt = {}
        for k, item in enumerate(self.items):
            if item.whole:
                continue
            full = self._full(item)
            if k in recomputed:
                full[self.n_off :].copy_(recomputed[k])
            rebuilt[k] = full
        self.rebuilt = rebuilt
        self.previous = None
        _release(self.memo, self.held)

    def _full(self, item: _Item) -> torch.Tensor:
        """A token-wise tensor whole: its slot, the prefetched rows first (measuring: a resident's
        own tensor, a managed layer's a new one)."""
        if item.tensor is not None:
            return item.tensor
        if self.memo.measuring is not None:
            return torch.empty(item.shape, dtype=item.dtype, device=self.memo.device)
        return self._slot(item, item.full_bytes).view(item.dtype).view(item.shape)

    def _recompute(self) -> Dict[int, torch.Tensor]:
        """Run the layer on its dropped tokens only; collect their saved tensors in order."""
        # Autograd saves only what gradients of inputs that need them use: the replay's inputs
        # need gradients exactly when the forward's did, or other tensors would be saved.
        x = _rebuild(self._whole_copy(self.input_key), self._input_view)[self.n_off :]
        x = x.detach().requires_grad_(self._input_grad)
        dropped = self.memo.measuring is not None and self.attention_keys  # see _drop_measured
        replay = TokenReplay(self, x, None if dropped else self._attention_rows())
        with torch.enable_grad(), _activate(replay), torch.autograd.graph.saved_tensors_hooks(replay.pack, lambda t: t):
            self.fn(hidden_states=x, **self.kwargs)
        self.memo.stats["recomputed_tokens"] += self.tokens - self.n_off
        return replay.parts

    def attend_again(self, attend) -> torch.Tensor:
        """Measuring: (out, lse) were dropped; `attend` runs the kept attention again on the
        replay's q, k, v -- the forward's, bitwise, and without dropout on this path: exact."""
        with torch.no_grad():  # as in _KeptAttention.forward: it saves nothing of its own
            out, lse = attend()
        for key, t in zip(self.attention_keys, (out, lse)):
            item, flat = self.items[key], _whole(t)
            if (flat.dtype, tuple(flat.shape)) != (item.dtype, item.shape):  # the saved views need its layout
                raise RuntimeError(f"MEMO layer {self.index}: attention computed again gave a {flat.dtype} storage "
                                   f"of {tuple(flat.shape)}, the forward's was {item.dtype} of {item.shape}")
            item.tensor = flat
        return self._attention_rows()

    def _attention_rows(self) -> torch.Tensor:
        if self.attention_key is None:
            raise RuntimeError("MEMO needs the layer's core attention to be LongSeqCoreAttention")
        rows = _rebuild(self._whole_copy(self.attention_key), self._attention_view)[self.n_off :]
        return rows.detach().requires_grad_(self._attention_grad)
