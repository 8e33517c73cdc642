"""The Seq1F1B executor: runs this rank's schedule (plan.py) on its model chunks.

Same contract as megatron-core's forward_backward_* functions (see schedules.py); the extra
pipeline knowledge -- links, segment lengths, activation shape -- comes in `p2p_communicator`
(a Pipeline). P = 1 and k = 1 is plain gradient accumulation: every layout runs this one path.

Per micro-batch the executor pulls one batch, cuts it into the k segments (per-token tensors along
the sequence) and gives each segment's forward a SegmentSlot (cross-segment attention state). The
loss of a segment is scaled only when its backward runs -- by then the micro-batch's every segment
has been forwarded, so it is divided by the token count of the whole sequence.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from megatron.core.utils import get_model_config
from megatron.longseq.attention.placement import DOCUMENT_STARTS, SEGMENT_LENGTHS
from megatron.longseq.attention.segments import SegmentSlot, SegmentState
from megatron.longseq.pipeline.p2p import Inbox, Outbox, receive_points
from megatron.longseq.pipeline.plan import Op, rank_schedule
from megatron.longseq.pipeline.simulate import prefix_needs


@dataclass
class Pipeline:
    """This rank's place in the pipeline (built by build_pipeline)."""

    size: int  # P
    rank: int  # stage index
    chunks: int  # v
    segment_tokens: List[int]  # this rank's tokens of each segment of a micro-batch (its cp share)
    hidden: int  # activation width ([tokens, b, hidden] between stages)
    links: Dict[tuple, object]
    members: List[int]  # global ranks of the pipeline group, by stage
    group: Optional[int] = None  # interleaved: units per chunk group (default: the pipeline size)
    record_timeline: bool = False
    # Meter saved activations (a saved-tensor hook on every forward: Python per saved tensor, and
    # torch.compile guards on it), only when the log reports them (--timing-log-level >= 1).
    measure_activations: bool = False
    stats: dict = field(default_factory=dict)
    # whole-sequence tokens per rank token of a micro-batch (cp): a micro-batch whose packed
    # documents chose its own segments (SEGMENT_LENGTHS) is cut by them
    token_divisor: int = 1
    # sequence parallelism: tp ranks split a segment's tokens between the layers, so what one stage
    # sends the next is [segment tokens / tp, b, hidden] (the micro-batch itself is whole on each)
    sequence_parallel: int = 1
    # told when a unit's forward ends and before its backward waits for its gradient (MEMO's
    # runtime: forward_done(unit), backward_begins(unit) with unit = (chunk, micro-batch, segment))
    unit_hooks: Optional[object] = None

    @property
    def splits(self) -> int:
        return len(self.segment_tokens)

    def tokens_of(self, batch: dict) -> List[int]:
        """This rank's tokens of each segment of the micro-batch."""
        if SEGMENT_LENGTHS not in batch:
            return self.segment_tokens
        return [n // self.token_divisor for n in batch[SEGMENT_LENGTHS].tolist()]


class _ActivationMeter:
    """Bytes autograd saves for backward, per operation (parameters excluded: they live in the
    flat parameter buffer), and the peak of what is alive between a forward and its backward;
    apart from them, the peak of what the micro-batches' segment states hold (`held()`: the
    cross-segment gradients and key/value copies), read after every forward and backward."""

    def __init__(self, param_ptrs, held=lambda: 0):
        self.param_ptrs, self.live, self.peak, self.of = param_ptrs, 0, 0, {}
        self.key, self.seen = None, set()
        self.held, self.peak_held = held, 0

    def count(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.param_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.of[self.key] = self.of.get(self.key, 0) + t.untyped_storage().nbytes()

    @contextlib.contextmanager
    def forward(self, key):
        global _METERING
        self.key, self.seen, _METERING = key, set(), self
        try:
            # module-level hooks: the same objects in every iteration, as torch.compile (megatron-
            # core's fused ops) guards on the identity of the saved-tensor hooks in force
            with torch.autograd.graph.saved_tensors_hooks(_pack_counted, _unpack):
                yield
        finally:
            _METERING = None
        self.live += self.of.get(key, 0)
        self.peak = max(self.peak, self.live)
        self.peak_held = max(self.peak_held, self.held())

    def backward_done(self, key):
        self.live -= self.of.pop(key, 0)
        self.peak_held = max(self.peak_held, self.held())


_METERING: Optional[_ActivationMeter] = None  # the meter of the forward running now


def _pack_counted(t):
    _METERING.count(t)
    return t


def _unpack(t):
    return t


class _Runner:
    def __init__(self, forward_step_func, data_iterator, chunks, pipe: Pipeline, m: int, mbs: int,
                 forward_only: bool):
        self.step_func, self.data, self.chunks, self.pipe = forward_step_func, data_iterator, chunks, pipe
        self.m, self.mbs, self.forward_only = m, mbs, forward_only
        self.config = get_model_config(chunks[0])
        self.p, self.v, self.k = pipe.size, pipe.chunks, pipe.splits
        self.last_vs = self.p * self.v - 1
        self.segments: Dict[int, List[dict]] = {}
        self.tokens: Dict[int, List[int]] = {}  # this rank's tokens of each segment, per micro-batch
        self.read = 0  # micro-batches read so far
        self.states: Dict[int, SegmentState] = {}
        self.stored: Dict[tuple, tuple] = {}  # unit -> (its input, its output's gradient edge)
        self.losses: Dict[int, Dict[int, tuple]] = {}
        self.reports: List[dict] = []
        self.total_tokens = 0
        self.timeline: List[tuple] = []
        device = next(chunks[0].parameters()).device
        # what travels between stages: the config's pipeline dtype, as megatron-core's p2p takes it
        # (the parameters' own dtype only where a config leaves it unset)
        dtype = getattr(self.config, "pipeline_dtype", None) or next(chunks[0].parameters()).dtype
        self.meter = None  # only when the log reports activations: no set of parameter pointers otherwise
        if pipe.measure_activations and not forward_only:
            self.meter = _ActivationMeter({p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()},
                                          lambda: sum(state.held_bytes() for state in self.states.values()))
        self.inbox, self.outbox = self._links(device, dtype)

    # ---- links --------------------------------------------------------------------------------
    def _links(self, device, dtype):
        pipe, inbox, outbox = self.pipe, {}, {}
        if self.p == 1:
            return inbox, outbox
        me, prv, nxt = pipe.members[pipe.rank], pipe.members[pipe.rank - 1], pipe.members[(pipe.rank + 1) % self.p]
        ops = self._ops()
        needs = _needs_of(self.p, self.m, self.k, self.v, pipe.group, self.forward_only, pipe.rank)
        for purpose, src, dst in (("act", prv, me), ("grad", nxt, me)):
            sender = pipe.members.index(src)
            points = receive_points(ops[sender], needs[sender], self.p, sender, self.v, purpose)
            # a link no message takes (last -> first without interleaving) may not exist
            inbox[purpose] = Inbox(pipe.links.get((purpose, src, dst)), src, iter(points), self._shape, dtype, device)
        outbox["act"] = Outbox(pipe.links.get(("act", me, nxt)), nxt, "act")
        outbox["grad"] = Outbox(pipe.links.get(("grad", me, prv)), prv, "grad")
        return inbox, outbox

    def _ops(self) -> List[List[Op]]:
        """Every stage's operations (forwards only for an evaluation)."""
        return _stage_ops(self.p, self.m, self.k, self.v, self.pipe.group, self.forward_only)

    def _shape(self, key):
        """[segment tokens (/ tp under sequence parallelism), micro-batch, hidden]: activations and
        their gradients alike."""
        _, m, s = key
        self._read_through(m)  # a receive posted ahead may come before the micro-batch's forward
        return (self.tokens[m][s] // self.pipe.sequence_parallel, self.mbs, self.pipe.hidden)

    # ---- data -----------------------------------------------------------------------------------
    def _read_through(self, m: int) -> None:
        """Read micro-batches up to m (they arrive in order on every rank) and cut each into its
        segments: [b, s] -> k x [b, n_s] along the sequence (per-token tensors; the whole
        samples' document starts and the segment lengths go to every segment as they are)."""
        while self.read <= m:
            batch = next(self.data)
            tokens = self.pipe.tokens_of(batch)
            bounds = [0]
            for n in tokens:
                bounds.append(bounds[-1] + n)
            whole = (DOCUMENT_STARTS, SEGMENT_LENGTHS)
            self.segments[self.read] = [{key: val if key in whole else _columns(val, a, b)
                                         for key, val in batch.items()} for a, b in zip(bounds, bounds[1:])]
            self.tokens[self.read], self.states[self.read] = tokens, SegmentState(len(tokens))
            self.read += 1

    def _segment(self, m: int, s: int) -> dict:
        self._read_through(m)
        seg = dict(self.segments[m][s])
        if self.k > 1:
            seg["segment"] = SegmentSlot(self.states[m], s)
        return seg

    # ---- operations ----------------------------------------------------------------------------
    def forward(self, op: Op) -> None:
        c, (m, s) = op.chunk, op.unit
        vs = c * self.p + self.pipe.rank
        batch = self._segment(m, s)
        inp = None
        if vs > 0:
            inp = self.inbox["act"].get((c, m, s))
            inp.requires_grad_(not self.forward_only)
        self._mark_ready()
        chunk = self.chunks[c]
        chunk.set_input_tensor(inp)
        with self.meter.forward((c, m, s)) if self.meter is not None else contextlib.nullcontext():
            output, loss_func = self.step_func(iter([batch]), chunk)
        self._unit_event("forward_done", (c, m, s))
        if vs == self.last_vs:
            parts = loss_func(output)
            self.losses.setdefault(m, {})[s] = parts
            output = parts[0]
        else:
            self.outbox["act"].send(output)
        if not self.forward_only:
            # Only where the output's gradient enters the graph is kept, not the output: its values
            # are the next stage's, and holding them to this unit's backward would keep one
            # [segment tokens, b, h] per unit in flight (P units on stage 0 under 1F1B) after the
            # send is done. The last stage's backward starts from the loss.
            self.stored[(c, m, s)] = (inp, None if vs == self.last_vs else get_gradient_edge(output))

    def _unit_event(self, name: str, unit: tuple) -> None:
        if self.pipe.unit_hooks is not None:
            getattr(self.pipe.unit_hooks, name)(unit)

    def _mark_ready(self) -> None:
        """When the op's input is in hand: the timeline shows waiting for it as a gap. On GPU a
        receive's wait only orders the compute stream after NCCL's, so while a timeline is being
        recorded the compute stream is drained first (the input has then truly arrived)."""
        if self.pipe.record_timeline:
            _drain_compute()
        self.ready = time.time()

    def _loss_to_backprop(self, m: int, s: int):
        parts = self.losses[m][s]
        if len(parts) == 2:
            # (loss, report): the segment's mean already, weighted by the segment's share of the
            # sequence (segments differ under uniform_comp). Exact for a mean over every token; a
            # masked loss is exact as (sum, count, report). Times the context-parallel size, as
            # megatron-core scales this form: the gradients are averaged over dp x cp after.
            tokens = self.tokens[m]
            return parts[0] * (tokens[s] / sum(tokens)) * self.pipe.token_divisor / self.m
        loss, _, _ = parts
        if self.config.calculate_per_token_loss:
            return loss
        tokens = sum(p[1] for p in self.losses[m].values())  # the whole sequence's
        # a micro-batch with every token masked (all EOD under --eod-mask-loss) adds nothing, not 0/0
        return loss / torch.as_tensor(tokens).clamp(min=1) / self.m

    def backward(self, op: Op, last_of_chunk: bool) -> None:
        c, (m, s) = op.chunk, op.unit
        vs = c * self.p + self.pipe.rank
        inp, edge = self.stored.pop((c, m, s))
        no_sync = self.config.no_sync_func if (self.config.no_sync_func and not last_of_chunk) else contextlib.nullcontext
        self._unit_event("backward_begins", (c, m, s))
        grad = None if vs == self.last_vs else self.inbox["grad"].get((c, m, s))
        self._mark_ready()
        with no_sync():
            if grad is None:
                loss = self._loss_to_backprop(m, s)
                scale = getattr(self.config, "grad_scale_func", None)  # --fp16: megatron-core's loss-scale hook
                torch.autograd.backward(scale(loss) if scale is not None else loss)
            else:
                torch.autograd.backward(edge, grad_tensors=grad)
        if vs > 0:
            self.outbox["grad"].send(inp.grad)
        if self.meter is not None:
            self.meter.backward_done((c, m, s))

    def finish_microbatch(self, m: int) -> None:
        self.segments.pop(m, None)
        tokens = self.tokens.pop(m, None)
        state = self.states.pop(m, None)
        if state is not None:
            state.release()
        if m in self.losses:
            self._report(self.losses.pop(m), tokens)

    def _report(self, parts: Dict[int, tuple], tokens: List[int]) -> None:
        """The micro-batch's report from its segments': [sum, count] pairs add up; a report of one
        value (a segment's mean) is weighted by the segment's share of the tokens."""
        reports = [p[-1] for _, p in sorted(parts.items())]
        shares = [n / sum(tokens) for n in tokens]
        merged = {key: sum(r[key] * (shares[s] if r[key].numel() == 1 else 1) for s, r in enumerate(reports))
                  for key in reports[0]}
        self.reports.append(merged)
        if len(next(iter(parts.values()))) == 3:
            self.total_tokens = self.total_tokens + sum(p[1] for p in parts.values())

    def _last_use(self, op: Op) -> bool:
        """The micro-batch's last operation on this rank: chunk 0's backward of segment 0 (LIFO
        over segments, chunks backwards), or without backwards the last chunk's last forward."""
        if self.forward_only:
            return op.chunk == self.v - 1 and op.unit[1] == self.k - 1
        return op.kind == "B" and op.chunk == 0 and op.unit[1] == 0

    def run(self, ops: List[Op]) -> None:
        last_backward = {op.chunk: i for i, op in enumerate(ops) if op.kind == "B"}
        for i, op in enumerate(ops):
            for box in self.inbox.values():
                box.advance(i)
            if op.kind == "F":
                self.forward(op)
            else:
                self.backward(op, last_backward[op.chunk] == i)
            if self.pipe.record_timeline:
                _drain_compute()
                # wall clock: comparable across the ranks of a machine
                self.timeline.append((str(op), self.ready, time.time()))
            if self._last_use(op):
                self.finish_microbatch(op.unit[0])
        for box in self.outbox.values():
            box.flush()


def _columns(val: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Tokens a:b of a per-token [b, s, ...] tensor, contiguous, and pinned where the loader's batch
    is: a copy to the GPU from pageable memory may wait for the compute stream on the host, which
    would hold back the sends and receives issued after it. (Micro-batch 1: a view, pinned as is.)"""
    piece = val[:, a:b]
    if piece.is_contiguous() or not val.is_pinned():
        return piece.contiguous()
    return piece.contiguous().pin_memory()


# The schedules and their dependencies are the same every iteration: computed once.
@functools.lru_cache(maxsize=8)
def _stage_ops(p: int, m: int, k: int, v: int, group: Optional[int], forward_only: bool) -> List[List[Op]]:
    ops = [rank_schedule(p, stage, m, k, v, group).ops for stage in range(p)]
    return [[op for op in row if op.kind == "F"] for row in ops] if forward_only else ops


@functools.lru_cache(maxsize=8)
def _needs_of(p: int, m: int, k: int, v: int, group: Optional[int], forward_only: bool, stage: int):
    """How many of `stage`'s operations each operation of every stage needs (simulate.prefix_needs)."""
    return prefix_needs(_stage_ops(p, m, k, v, group, forward_only), v, k, of=stage)


def _on_device(count, device) -> torch.Tensor:
    """The token count as an int64 scalar on `device`. A stage without losses holds a Python 0:
    made there, not copied from host memory (on CUDA a blocking copy, which waits for the backward)."""
    if not isinstance(count, torch.Tensor):
        return torch.full((), count, dtype=torch.int64, device=device)
    return count.reshape(()).to(torch.int64)


def _drain_compute() -> None:
    """Wait for the compute stream only, never the whole device: a device synchronize would also
    wait for the receives posted ahead (p2p.Inbox), which land when their senders get there -- the
    other stages' time, not this operation's."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def forward_backward_seq1f1b(
    *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int = None,
    micro_batch_size: int = None, decoder_seq_length: int = None, forward_only: bool = False,
    collect_non_loss_data: bool = False, first_val_step: bool = None, adjust_tensor_shapes_fn=None,
    p2p_communicator: Optional[Pipeline] = None, pg_collection=None,
):
    """Run one iteration's schedule on this rank. `model` is the list of this rank's chunks;
    returns the loss reports (one per micro-batch, summed over its segments) on the last stage."""
    if collect_non_loss_data:
        raise NotImplementedError("collect_non_loss_data is not supported")
    chunks = model if isinstance(model, list) else [model]
    pipe = p2p_communicator or Pipeline(1, 0, 1, [seq_length], 0, {}, [dist.get_rank()])
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    runner = _Runner(forward_step_func, data_iterator, chunks, pipe, num_microbatches, micro_batch_size, forward_only)
    ops = runner._ops()[pipe.rank]
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_ctx:
        runner.run(ops)
    meter = runner.meter
    pipe.stats = {"peak_activation_bytes": meter.peak if meter else 0, "peak_segment_state_bytes":
                  meter.peak_held if meter else 0, "timeline": runner.timeline}
    config = runner.config
    if not forward_only and config.finalize_model_grads_func is not None:
        tokens = None
        if config.calculate_per_token_loss:
            tokens = _on_device(runner.total_tokens, next(chunks[0].parameters()).device)
        config.finalize_model_grads_func(chunks, tokens)
    return runner.reports
