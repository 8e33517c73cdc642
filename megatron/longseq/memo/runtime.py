"""MEMO's token-wise activation swapping and recomputation (section 4.1), device-agnostic.

Every tensor a transformer layer saves for backward passes through autograd's saved-tensor hooks:
  - the layer input and the attention output (whole storages) are offloaded to host memory;
  - what the attention module itself saves (q, k, v, out, lse) is offloaded whole: attention is
    never recomputed;
  - every other saved tensor with the layer's tokens as leading dimension (layer norms, linear
    inputs, MLP activations, ...) has its first alpha of tokens offloaded and the rest dropped;
  - parameters and small tensors without a token dimension stay where they are.
Backward of layer i starts by rematerialising: the offloaded parts come back into rounding buffer
i % 2 (prefetched while layer i+1's backward ran), the dropped tokens are recomputed by running the
layer on those tokens alone -- every op but attention is token-wise, and attention returns its kept
output rows -- and each saved tensor is spliced back whole. The last two layers keep their
activations (their backward starts at once). On GPU, offload and prefetch run on their own streams
(pinned host memory, events); on CPU the same code makes plain copies.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

_ACTIVE: Optional["LayerState"] = None  # the layer whose forward or replay is running


def active_layer() -> Optional["LayerState"]:
    return _ACTIVE


@contextlib.contextmanager
def _activate(state: Optional["LayerState"]):
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
class _Offloaded:
    """Bytes sent to host memory, and where they come back."""

    host: torch.Tensor
    device_copy: Optional[torch.Tensor] = None


@dataclass
class _Saved:
    kind: str  # "keep", "storage" (whole storage, rebuilt by as_strided) or "tokens"
    tensor: Optional[torch.Tensor] = None  # keep
    key: Optional[int] = None  # storage: which offloaded storage; tokens: position in order
    view: tuple = ()  # storage: (size, stride, offset)


class Buffers:
    """Two rounding buffers: layer i's saved tensors are rebuilt in buffer i % 2 (MEMO Fig. 5).
    Each grows to the largest layer it has served and is then reused layer after layer."""

    def __init__(self, device):
        self.device = device
        self.bufs: List[Optional[torch.Tensor]] = [None, None]
        self.used = [0, 0]

    def reset(self, which: int, need: int) -> None:
        if self.bufs[which] is None or self.bufs[which].numel() < need:
            self.bufs[which] = torch.empty(need, dtype=torch.uint8, device=self.device)
        self.used[which] = 0

    def take(self, which: int, shape, dtype) -> torch.Tensor:
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        start = -(-self.used[which] // 64) * 64  # 64-byte aligned
        self.used[which] = start + nbytes
        return self.bufs[which][start : start + nbytes].view(dtype).view(shape)


class Memo:
    """The runtime of one training run: alpha, streams, host copies, rounding buffers."""

    def __init__(self, alpha: float, device: torch.device, param_storages=()):
        self.alpha = alpha
        self.device = device
        self.cuda = device.type == "cuda"
        self.offload_stream = torch.cuda.Stream(device) if self.cuda else None
        self.prefetch_stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = Buffers(device)
        self.param_storages = set(param_storages)
        self.last: Optional[LayerState] = None  # the previous managed layer of the running forward
        self.host_bytes = 0  # host memory held now by layers waiting for their backward
        self.allocator = None  # the planned allocator (allocator.py), when it serves this run
        self.window_handles: list = []  # hooks that mark the allocator's layer windows
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"offloaded_bytes": 0, "recomputed_tokens": 0, "layers": 0, "peak_host_bytes": self.host_bytes}

    # ---- copies: streams and pinned memory on GPU, plain copies on CPU --------------------------
    def to_host(self, t: torch.Tensor) -> _Offloaded:
        nbytes = t.numel() * t.element_size()
        self.stats["offloaded_bytes"] += nbytes
        self.host_bytes += nbytes
        self.stats["peak_host_bytes"] = max(self.stats["peak_host_bytes"], self.host_bytes)
        if not self.cuda:
            return _Offloaded(t.detach().clone())
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.offload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload_stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.offload_stream)  # the caching allocator keeps t until the copy is done
        return _Offloaded(host)

    def to_device(self, item: _Offloaded, dst: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(item.host)
        else:
            with torch.cuda.stream(self.prefetch_stream):
                dst.copy_(item.host, non_blocking=True)
        item.device_copy = dst

    def wait_prefetch(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.prefetch_stream)

    def offload_done_event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.offload_stream)
        return event

    # ---- the layer wrapper -----------------------------------------------------------------------
    def wrap(self, layers, keep_last: int = 2) -> None:
        """Manage every layer of `layers` but the last `keep_last` (in place, like recompute)."""
        managed = list(layers)[: max(len(layers) - keep_last, 0)]
        for index, layer in enumerate(managed):
            layer.forward = _memo_forward(self, layer.forward, index, first=index == 0)


def _memo_forward(memo: Memo, forward, index: int, first: bool):
    def run(hidden_states, **kwargs):
        if not torch.is_grad_enabled():
            return forward(hidden_states=hidden_states, **kwargs)
        if first:
            memo.last = None
        state = LayerState(memo, forward, index, hidden_states, kwargs, previous=memo.last)
        memo.last = state
        return state.forward()

    return run


def _release(memo: Memo, held: list) -> None:
    memo.host_bytes -= held[0]
    held[0] = 0


class LayerState:
    """One managed layer's forward: what it offloaded, and how to bring it back."""

    def __init__(self, memo: Memo, forward, index: int, hidden_states, kwargs, previous):
        self.memo, self.fn, self.index, self.kwargs = memo, forward, index, kwargs
        self.previous = previous
        self.input = hidden_states
        self.tokens = hidden_states.shape[0]
        self.n_off = int(round(memo.alpha * self.tokens))  # offloaded leading tokens
        self.held = [0]  # host bytes this layer holds (a box shared with its finalizer)
        self.storages: Dict[int, _Offloaded] = {}  # storage ptr -> offloaded copy (whole storages)
        self.storage_keys: Dict[int, int] = {}
        self._alive: List[torch.Tensor] = []
        self.token_parts: List[tuple] = []  # (offloaded leading rows or None, full shape, dtype)
        self.token_index: Dict[tuple, int] = {}
        self.in_attention = False
        self.attention_key: Optional[int] = None
        self.phase = "forward"
        self.rebuilt: Optional[Dict[int, torch.Tensor]] = None
        self.event = None

    # ---- forward -----------------------------------------------------------------------------
    def forward(self):
        # MEMO: the layer input always goes to host memory whole
        self.input_key = self._storage(self.input)
        self._input_view = (tuple(self.input.shape), self.input.stride(), self.input.storage_offset())
        self._input_grad = self.input.requires_grad
        with _activate(self), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            out = self.fn(hidden_states=self.input, **self.kwargs)
        self.event = self.memo.offload_done_event()
        self.memo.stats["layers"] += 1
        self.held[0] = self._host_bytes()
        # a forward that never gets a backward releases when it is dropped (the finalizer must
        # not reference the state itself, or the state could never be dropped)
        weakref.finalize(self, _release, self.memo, self.held)
        self.input = None  # only the host copies stay
        self._alive = []
        return out

    def _host_bytes(self) -> int:
        items = list(self.storages.values()) + [p[0] for p in self.token_parts if p[0] is not None]
        return sum(i.host.numel() * i.host.element_size() for i in items)

    def _storage(self, t: torch.Tensor) -> int:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.storage_keys:
            # Keyed by address: the storage must outlive the forward, or a new tensor could take
            # its address and pass for it.
            self._alive.append(t)
            self.storage_keys[ptr] = len(self.storage_keys)
            self.storages[self.storage_keys[ptr]] = self.memo.to_host(_whole(t))
        return self.storage_keys[ptr]

    def attention(self):
        """The attention module's own saved tensors: offloaded whole (it is never recomputed)."""
        state = self

        @contextlib.contextmanager
        def scope():
            state.in_attention = True
            try:
                yield
            finally:
                state.in_attention = False

        return scope()

    def keep_attention_output(self, out: torch.Tensor) -> None:
        """The attention output [s, b, h*d]: offloaded whole; the replay answers from it."""
        self.attention_key = self._storage(out)
        self._attention_view = (tuple(out.shape), out.stride(), out.storage_offset())
        self._attention_grad = out.requires_grad

    def pack(self, t: torch.Tensor) -> _Saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.memo.param_storages:
            return _Saved("keep", t)
        view = (tuple(t.shape), t.stride(), t.storage_offset())
        if ptr in self.storage_keys or self.in_attention:
            return _Saved("storage", key=self._storage(t), view=view)
        if t.dim() >= 1 and t.shape[0] == self.tokens:
            return _Saved("tokens", key=self._token_part(t))
        return _Saved("keep", t)

    def _token_part(self, t: torch.Tensor) -> int:
        key = (t.untyped_storage().data_ptr(),) + (tuple(t.shape), t.stride(), t.storage_offset())
        if key not in self.token_index:
            self._alive.append(t)
            self.token_index[key] = len(self.token_parts)
            head = self.memo.to_host(t[: self.n_off].contiguous()) if self.n_off else None
            self.token_parts.append((head, tuple(t.shape), t.dtype))
        return self.token_index[key]

    # ---- backward ----------------------------------------------------------------------------
    def unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.kind == "keep":
            return saved.tensor
        if self.rebuilt is None:
            self.rematerialize()
        if saved.kind == "tokens":
            return self.rebuilt[saved.key]
        return _rebuild(self.storages[saved.key].device_copy, saved.view)

    def prefetch(self) -> None:
        """Bring this layer's host copies into rounding buffer index % 2 (prefetch stream)."""
        if any(item.device_copy is not None for item in self.storages.values()):
            return
        which = self.index % 2
        if self.event is not None:  # the offload must be complete before the copy back
            self.memo.prefetch_stream.wait_event(self.event)
        if self.memo.cuda:  # and the buffer free: the layer that used it has finished
            self.memo.prefetch_stream.wait_stream(torch.cuda.current_stream(self.memo.device))
        items = list(self.storages.values()) + [p[0] for p in self.token_parts if p[0] is not None]
        full = sum(p[2].itemsize * torch.Size(p[1]).numel() + 64 for p in self.token_parts)
        self.memo.buffers.reset(which, sum(i.host.numel() * i.host.element_size() + 64 for i in items) + full)
        for item in self.storages.values():
            self.memo.to_device(item, self.memo.buffers.take(which, item.host.shape, item.host.dtype))

    def rematerialize(self) -> None:
        self.prefetch()  # normally already done while the next layer's backward ran
        if self.previous is not None:
            self.previous.prefetch()  # overlap: layer i-1's copies come back during our backward
        self.memo.wait_prefetch()
        which = self.index % 2
        recomputed = self._recompute() if self.n_off < self.tokens else [None] * len(self.token_parts)
        rebuilt = {}
        for k, (head, shape, dtype) in enumerate(self.token_parts):
            full = self.memo.buffers.take(which, shape, dtype)
            if head is not None:
                self.memo.to_device(head, full[: self.n_off])
            if recomputed[k] is not None:
                full[self.n_off :].copy_(recomputed[k])
            rebuilt[k] = full
        self.memo.wait_prefetch()
        self.rebuilt = rebuilt
        self._drop_host_copies()

    def _drop_host_copies(self) -> None:
        """Rebuilt on the device: the host copies (and the link to the previous layer) can go."""
        for item in self.storages.values():
            item.host = None
        self.token_parts = [(None, shape, dtype) for _, shape, dtype in self.token_parts]
        self.previous = None
        _release(self.memo, self.held)

    def _recompute(self) -> List[Optional[torch.Tensor]]:
        """Run the layer on its dropped tokens only; collect their saved tensors in order."""
        # Autograd saves only what gradients of inputs that need them use: the replay's inputs
        # need gradients exactly when the forward's did, or other tensors would be saved.
        x = _rebuild(self.storages[self.input_key].device_copy, self._input_view)[self.n_off :]
        x = x.detach().requires_grad_(self._input_grad)
        out_rows = self._attention_rows()
        parts: List[Optional[torch.Tensor]] = [None] * len(self.token_parts)
        replay = _Replay(self, x, out_rows, parts)
        with torch.enable_grad(), _activate(replay), torch.autograd.graph.saved_tensors_hooks(replay.pack, lambda t: t):
            self.fn(hidden_states=x, **self.kwargs)
        self.memo.stats["recomputed_tokens"] += self.tokens - self.n_off
        return parts

    def _attention_rows(self) -> torch.Tensor:
        if self.attention_key is None:
            raise RuntimeError("MEMO needs the layer's core attention to be LongSeqCoreAttention")
        rows = _rebuild(self.storages[self.attention_key].device_copy, self._attention_view)[self.n_off :]
        return rows.detach().requires_grad_(self._attention_grad)


class _Replay:
    """The recompute of the dropped tokens: the same ops, attention answered from its kept output;
    saved tensors are matched to the forward's by order, classified the same way."""

    phase = "replay"

    def __init__(self, state: LayerState, x, out_rows, parts):
        self.state, self.x, self.out_rows, self.parts = state, x, out_rows, parts
        self.inputs = {x.untyped_storage().data_ptr()}
        self.order: Dict[tuple, int] = {}

    def attention_rows(self):
        return self.out_rows

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        tokens = self.state.tokens - self.state.n_off
        if ptr in self.state.memo.param_storages or ptr in self.inputs or ptr == self.out_rows.untyped_storage().data_ptr():
            return t
        if t.dim() >= 1 and t.shape[0] == tokens:
            key = (ptr, tuple(t.shape), t.stride(), t.storage_offset())
            if key not in self.order:
                k = self.order[key] = len(self.order)
                if k >= len(self.parts) or tuple(t.shape[1:]) != self.state.token_parts[k][1][1:]:
                    raise RuntimeError(f"MEMO layer {self.state.index}: the recompute saved a different tensor "
                                       f"sequence than the forward (tensor {k}, shape {tuple(t.shape)})")
                self.parts[k] = t.detach()
        return t
