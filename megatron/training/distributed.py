"""Data-parallel gradients: one contiguous buffer, bucketed reductions, optional overlap.

megatron-core's DistributedDataParallel allocates its buffers on CUDA; this is a device-agnostic
counterpart with the same contract:
- every parameter's data and gradient live in two flat buffers (params in model dtype, grads in
  fp32 when the model is bf16 -- Megatron accumulates and reduces bf16 gradients in fp32), padded
  as megatron-core pads them when the optimizer is sharded (bucket_layout);
- `param.main_grad` is the parameter's view of the gradient buffer; each micro-batch's `.grad`
  is added into it by a post-accumulate hook and then freed -- unless a fused weight-gradient GEMM
  (--gradient-accumulation-fusion on GPU) accumulated into main_grad itself: megatron-core's and
  Transformer Engine's linears then set `param.grad_added_to_main_grad` and hand a dummy `.grad`;
- buckets are reduced over the data-parallel group (dp x cp): all-reduce, or reduce-scatter when
  the optimizer is sharded (ZeRO-1, --use-distributed-optimizer), in which case each rank owns the
  same 1/dp slice of every bucket and the updated parameters are all-gathered back;
- with --num-distributed-optimizer-instances N the sharded reduction is two-level, as megatron-
  core's: reduce-scatter inside this rank's instance (`dp_group`, dp x cp / N ranks), then the
  shard is all-reduced with the same shard of the other instances (`across`); the all-gather of
  updated parameters stays inside the instance. One instance = `across` of size 1, no second step.
  Under --overlap-grad-reduce a bucket's second step starts when the next bucket's first does, so
  both overlap the rest of the backward without a wait for a collective just issued;
- with --overlap-grad-reduce a bucket's reduction starts asynchronously as soon as the last
  micro-batch's backward has produced all its gradients;
- a pipeline's tied embedding (the first stage's word embedding, the last stage's output layer)
  has a bucket of its own, as megatron-core's shared embedding: both stages shard it alike, so
  after the data-parallel reduction they sum only the range it left on each rank;
- with --overlap-param-gather the sharded optimizer's all-gather of updated parameters runs in
  the background after the step, and a module's forward waits only for the buckets holding its
  own parameters (a forward pre-hook), so the gathers overlap the next forward.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

DEFAULT_BUCKET_ELEMENTS = 40_000_000


@dataclass
class Bucket:
    """A contiguous range [start, end) of both flat buffers; its length is a multiple of the
    shard count so every shard is an equal slice."""

    params: List[torch.nn.Parameter]
    start: int
    end: int
    pending: set = field(init=False)  # params whose gradient the synced backward has not given yet
    handle: Optional[object] = None  # its reduction in flight
    across: bool = False  # whether that is the second level, across the optimizer instances
    gather: Optional[tuple] = None  # (work, its input) of an all-gather of params still in flight

    def __post_init__(self):
        self.pending = set(self.params)

    def shard_range(self, shard_rank: int, shards: int):
        size = (self.end - self.start) // shards
        return self.start + shard_rank * size, self.start + (shard_rank + 1) * size


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


PARAM_ALIGN = 64  # elements: 128-byte aligned starts for >= 16-bit parameters
BUCKET_ALIGN = 128  # elements: 256-byte aligned bucket (and so shard) starts


def bucket_layout(numels: List[int], bucket_elements: int, shards: int, aligned: bool, alone=frozenset()):
    """Where parameters of `numels` elements (in bucket order) lie in the flat buffers:
    ([(start, end, [their indices])] per bucket, [start] per parameter). A bucket closes once it
    spans `bucket_elements`; its length is a multiple of `shards`, so every shard is an equal slice.
    `aligned` (the sharded optimizer) is megatron-core's layout: each parameter starts at a multiple
    of PARAM_ALIGN elements and each bucket ends at a multiple of lcm(shards, BUCKET_ALIGN), so the
    shards, their fp32 main copies and the optimizer's multi-tensor kernels see aligned pointers
    (vectorized loads want 16 bytes) whatever the parameter sizes. The parameters whose indices
    are in `alone` get a bucket of their own, as megatron-core gives its shared embedding (the
    bucket before keeps the start padding the parameter took)."""
    param_align, end_align = (PARAM_ALIGN, math.lcm(shards, BUCKET_ALIGN)) if aligned else (1, shards)
    buckets, starts, members, start, pos = [], [], [], 0, 0
    for i, n in enumerate(numels):
        pos = round_up(pos, param_align)
        if i in alone and members:
            pos = start = _close(buckets, start, round_up(pos, end_align), members)
            members = []
        starts.append(pos)
        members.append(i)
        pos += n
        if pos - start >= bucket_elements or i in alone:
            pos = start = _close(buckets, start, round_up(pos, end_align), members)
            members = []
    if members:
        _close(buckets, start, round_up(pos, end_align), members)
    return buckets, starts


def _close(buckets: list, start: int, end: int, members: List[int]) -> int:
    """Add the bucket [start, end) of `members`; the next one starts at its end."""
    buckets.append((start, end, members))
    return end


class GradBuffer:
    """Flat param/grad storage for `params` and their data-parallel reduction."""

    def __init__(self, params: List[torch.nn.Parameter], dp_group, shard: bool, overlap: bool,
                 bucket_elements: Optional[int] = None, average: bool = True, tied=(),
                 average_in_collective: bool = False, across=None):
        self.dp_group = dp_group
        self.across = across if across is not None and dist.get_world_size(across) > 1 else None
        # Tied embeddings across pipeline stages: each gets a bucket of its own, so the first and the
        # last stage shard it alike and their sum can follow the data-parallel reduction, over the
        # range it leaves on this rank (reduced_grad): the bucket launches as early as any other,
        # and the sum moves a shard, not the whole embedding.
        self.tied = list(tied)
        self.average = average  # mean over dp (per-micro-batch losses) or sum (per-token loss)
        # --ddp-average-in-collective: NCCL averages inside the reduction (ReduceOp.AVG); gloo has no
        # such op, so there the sum is divided once it has arrived. Default: divide, then sum.
        self.average_in_collective = average and average_in_collective
        self.avg_op = self.average_in_collective and dist.get_backend(dp_group) == "nccl"
        # NCCL gathers in place (its input at the output's rank offset), as megatron-core's buffer
        # does: no copy of the shard a step; gloo takes a copy
        self.gather_in_place = dist.get_backend(dp_group) == "nccl"
        self.shards = dist.get_world_size(dp_group) if shard else 1
        # every replica of the model: this group's ranks in every instance (gradients average over all)
        self.dp_size = dist.get_world_size(dp_group) * (dist.get_world_size(across) if self.across else 1)
        self.dp_rank = dist.get_rank(dp_group)
        self.overlap = overlap
        self.sync_enabled = True
        self.previous: Optional[Bucket] = None  # the bucket the backward launched last
        device, dtype = params[0].device, params[0].dtype
        self.grad_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        # Backward produces gradients roughly in reverse registration order: buckets follow it,
        # so the first bucket is ready first.
        ordered = list(reversed(params))
        tied_ids = {id(p) for p in self.tied}
        spans, starts = bucket_layout([p.numel() for p in ordered], bucket_elements or DEFAULT_BUCKET_ELEMENTS,
                                      self.shards, aligned=shard,
                                      alone={i for i, p in enumerate(ordered) if id(p) in tied_ids})
        self.buckets = [Bucket([ordered[i] for i in members], lo, hi) for lo, hi, members in spans]
        self.offsets: Dict[torch.nn.Parameter, int] = dict(zip(ordered, starts))
        total = self.buckets[-1].end
        self.param_data = torch.zeros(total, dtype=dtype, device=device)
        self.grad_data = torch.zeros(total, dtype=self.grad_dtype, device=device)
        self._place()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in ordered]

    def _place(self):
        """Move every parameter into the flat buffer and give it a main_grad view."""
        self.bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                offset, n = self.offsets[p], p.numel()
                self.param_data[offset : offset + n].copy_(p.data.view(-1))
                p.data = self.param_data[offset : offset + n].view_as(p)
                p.main_grad = self.grad_data[offset : offset + n].view_as(p)
                p.grad_added_to_main_grad = False  # the fused linears' protocol (megatron-core's DDP)
                self.bucket_of[p] = bucket

    # ---- accumulation and reduction ------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        # A fused GEMM wrote its share into main_grad itself and handed a dummy .grad: empty, or zeros
        # (zero_out_wgrad: a weight tied on this stage) that autograd added the other use's share to.
        if p.grad is not None and (not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False)):
            p.main_grad.add_(p.grad)
        p.grad = None
        if self.overlap and self.sync_enabled:
            bucket = self.bucket_of[p]
            if p not in bucket.pending:  # its bucket may be reducing already: a second add would race it
                raise RuntimeError(f"a gradient of {tuple(p.shape)} arrived twice in the backward that reduces it")
            bucket.pending.discard(p)
            if not bucket.pending:
                self._launch(bucket)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches before the last only accumulate (megatron-core's no_sync_func)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def _launch(self, bucket: Bucket) -> None:
        """A bucket completed by the backward: its reduction inside the instance starts now. With
        instances, the bucket launched before goes across them now, rather than right after its own
        first level (megatron-core's order, on a stream of its own): the second level waits for the
        first, and a wait for a collective just issued holds the stream it is issued on -- under
        CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) every kernel behind it -- where a
        bucket's backward later the first level has most likely arrived."""
        if self.dp_size == 1:
            return
        bucket.handle = self._reduce_inside(bucket)
        previous, self.previous = self.previous, bucket
        if self.across is not None and previous is not None:
            self._go_across(previous)

    def _reduce_inside(self, bucket: Bucket):
        """The reduction inside this instance, to this rank's shard or the whole bucket: in flight."""
        grads = self.grad_data[bucket.start : bucket.end]
        if self.average and not self.average_in_collective:
            grads.div_(self.dp_size)  # before the sum, like Megatron's gradient scaling factor
        if self.shards > 1:
            lo, hi = self._reduced_range(bucket)
            return dist.reduce_scatter_tensor(self.grad_data[lo:hi], grads, op=self._op(), group=self.dp_group,
                                              async_op=True)
        return dist.all_reduce(grads, op=self._op(), group=self.dp_group, async_op=True)

    def _op(self):
        return dist.ReduceOp.AVG if self.avg_op else dist.ReduceOp.SUM

    def _reduced_range(self, bucket: Bucket):
        """Where a bucket's reduced gradients land: this rank's shard, or the whole bucket."""
        return bucket.shard_range(self.dp_rank, self.shards) if self.shards > 1 else (bucket.start, bucket.end)

    def reduced_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The reduced gradients of p's bucket on this rank: of a tied embedding, alone in its
        bucket, its shard (with the bucket's end padding, zeros) or all of it."""
        lo, hi = self._reduced_range(self.bucket_of[p])
        return self.grad_data[lo:hi]

    def _go_across(self, bucket: Bucket) -> None:
        """The second level, once the first has arrived (it reads what the first wrote, which a
        collective on another group would not wait for): the shard all-reduced with the same shard
        of the other instances."""
        bucket.handle.wait()
        lo, hi = self._reduced_range(bucket)
        bucket.handle = dist.all_reduce(self.grad_data[lo:hi], op=self._op(), group=self.across, async_op=True)
        bucket.across = True

    def finish_grad_sync(self) -> None:
        """After the last backward: every bucket reduced (launch what overlap did not: all of them
        without it, a bucket holding a parameter that got no gradient with it)."""
        for bucket in self.buckets if self.dp_size > 1 else ():
            if bucket.handle is None:
                bucket.handle = self._reduce_inside(bucket)
            if self.across is not None and not bucket.across:
                self._go_across(bucket)
            bucket.handle.wait()
            if self.average_in_collective and not self.avg_op:  # the average gloo could not take inside
                lo, hi = self._reduced_range(bucket)
                self.grad_data[lo:hi].div_(self.dp_size)
        self._rearm()

    def _rearm(self) -> None:
        """Every bucket waiting for all its params: the next synced backward launches each once."""
        for bucket in self.buckets:
            bucket.handle, bucket.across, bucket.pending = None, False, set(bucket.params)
        self.previous = None

    def zero_grad(self) -> None:
        """Start of an iteration: zero gradients, every bucket waiting for all its params."""
        self.grad_data.zero_()
        for p in self.offsets:
            p.grad_added_to_main_grad = False
        self._rearm()

    # ---- shards ----------------------------------------------------------------------------
    def owned_ranges(self):
        """(start, end) ranges of the flat buffers this rank's optimizer updates."""
        shard_rank = self.dp_rank if self.shards > 1 else 0
        return [b.shard_range(shard_rank, self.shards) for b in self.buckets]

    def first_of_replicas(self) -> bool:
        """Whether this rank comes first among the ranks owning the same pieces: a shard's copies in
        every instance, or every rank of the group when the buffer is not sharded."""
        first_here = self.shards > 1 or self.dp_rank == 0
        return first_here and (self.across is None or dist.get_rank(self.across) == 0)

    def replica_rank(self) -> int:
        """This rank's place among the dp_size replicas of the model part: its rank in the group,
        the instances one after another."""
        instance = dist.get_rank(self.across) if self.across is not None else 0
        return instance * dist.get_world_size(self.dp_group) + self.dp_rank

    def param_fragments(self):
        """(param, flat_start, flat_end) for every piece of a parameter inside an owned range."""
        for lo, hi in self.owned_ranges():
            for p, offset in self.offsets.items():
                start, end = max(lo, offset), min(hi, offset + p.numel())
                if start < end:
                    yield p, start, end

    def all_gather_params(self, async_op: bool = False) -> None:
        """After a sharded step: every rank's updated slice to everybody; in the background with
        async_op (see wait_params)."""
        self.gather_flat(self.param_data, async_op)

    def gather_flat(self, flat: torch.Tensor, async_op: bool = False) -> None:
        """In place: each rank's owned slices of `flat` (laid out like the buffers) to every shard.
        In forward order (the buckets follow backward's): gathers on one communicator run in launch
        order, and with async_op the next forward's first layer waits only for its own bucket."""
        if self.shards == 1:
            return
        for bucket in reversed(self.buckets):
            work, mine = self.gather_bucket(flat[bucket.start : bucket.end], bucket, async_op)
            if async_op:
                bucket.gather = (work, mine)  # the input lives until the gather is done

    def gather_bucket(self, piece: torch.Tensor, bucket: Bucket, async_op: bool = False):
        """In place: this rank's owned slice of `piece` (laid out like `bucket`) to every shard.
        Returns the work handle and the input, which must live until the gather is done."""
        lo, hi = bucket.shard_range(self.dp_rank, self.shards)
        mine = piece[lo - bucket.start : hi - bucket.start]
        if not self.gather_in_place:  # the output range contains the input range
            mine = mine.clone()
        return dist.all_gather_into_tensor(piece, mine, group=self.dp_group, async_op=async_op), mine

    def check_replicas(self, iteration: int) -> None:
        """Collective: every data-parallel replica holds the same weights, bit for bit (a flipped
        bit or a bad link would otherwise drift silently). Megatron's weight-hash check."""
        self.wait_params()
        digest = hashlib.sha256(self.param_data.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for group in (self.dp_group, self.across):  # equal inside every instance and across them
            if group is None:
                continue
            digests = [None] * dist.get_world_size(group)
            dist.all_gather_object(digests, digest, group=group)
            if len(set(digests)) > 1:
                ranks = dist.get_process_group_ranks(group)
                odd = [r for r, d in zip(ranks, digests) if d != digests[0]]
                raise RuntimeError(f"iteration {iteration}: the weights of data-parallel replicas {odd} differ "
                                   f"from rank {ranks[0]}'s")

    def wait_params(self, buckets=None) -> None:
        """The parameters of `buckets` (all by default) are whole again."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather is not None:
                bucket.gather[0].wait()
                bucket.gather = None

    def wait_params_before_forward(self, modules) -> list:
        """--overlap-param-gather: each module's forward first waits for the buckets of the
        parameters it owns directly. Returns the hook handles. A parameter read where its module's
        forward does not run (the chunked loss reads the output layer's weight) carries
        `wait_gathered`, which its reader calls first."""
        for p, bucket in self.bucket_of.items():
            p.wait_gathered = partial(self.wait_params, [bucket])
        hooks = []
        for module in modules:
            for sub in module.modules():
                buckets = {id(self.bucket_of[p]): self.bucket_of[p]
                           for p in sub.parameters(recurse=False) if p in self.bucket_of}
                if buckets:
                    mine = list(buckets.values())
                    hooks.append(sub.register_forward_pre_hook(lambda *_, b=mine: self.wait_params(b)))
        return hooks
