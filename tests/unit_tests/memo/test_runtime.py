"""MEMO's token-wise swap/recompute: the same loss and gradients as keeping every activation; the
bytes it offloads are the paper's S_input + S_attn + alpha x the rest; its copies follow the
rounding-buffer schedule; its host memory stays within the pool it planned."""
import gc
from collections import Counter

import pytest
import torch

from megatron.longseq.memo.alpha import offloaded_rows
from megatron.longseq.memo.buffers import HostPool, MemoCapacityError
from megatron.longseq.memo.runtime import Memo
from megatron.longseq.memo.streams import Streams
from megatron.longseq.random import seed_everything
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks
from tests.unit_tests.memo.schedule import ScheduleError, check
from tests.unit_tests.model_utils import lm_loss, tiny_args, tiny_gpt

GQA_ROPE = ("--group-query-attention --num-query-groups 2 --position-embedding-type rope "
            "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights")
CASES = {
    "mha-learned": "--num-layers 4",
    "gqa-rope-swiglu-rms": "--num-layers 5 " + GQA_ROPE,
    # packed documents: attention by document pieces, saved and replayed like plain causal
    "gqa-rope-documents": "--num-layers 4 --reset-attention-mask " + GQA_ROPE,
    # torch's SDPA (it draws the dropout mask): everything it saves is offloaded whole
    "mha-attention-dropout": "--num-layers 4 --attention-dropout 0.25",
}


def managed(args, alpha, log=None):
    """A tiny GPT with every layer but the last two under MEMO, calibrated by one iteration."""
    model = tiny_gpt(args, grid_groups())
    memo = Memo(alpha, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()}, log)
    memo.wrap(model.decoder.layers)
    sizes = memo.calibrate(lambda: lm_loss(model, args).backward())
    model.zero_grad(set_to_none=True)
    memo.reset_stats()
    if log is not None:
        log.clear()
    return model, memo, sizes


def iteration(args, alpha):
    if alpha is None:
        model, memo = tiny_gpt(args, grid_groups()), None
    else:
        model, memo, _ = managed(args, alpha)
    seed_everything(7, 0, torch.device("cpu"))  # the same dropout masks with and without MEMO
    loss = lm_loss(model, args)
    loss.backward()
    del loss
    gc.collect()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, memo


@pytest.mark.parametrize("case", CASES)
def test_every_alpha_gives_the_same_gradients(case):
    init_single_rank_world()
    args = tiny_args(CASES[case])
    reference, _ = iteration(args, None)
    offloaded, recomputed = [], []
    for alpha in (0.0, 0.25, 0.5, 1.0):
        grads, memo = iteration(args, alpha)
        for name, grad in grads.items():
            # The recompute runs the same per-token ops on fewer rows; on CPU the results are
            # bitwise those of the full rows. 1e-6 relative allows an fp32 BLAS that blocks rows
            # differently without hiding a wrong splice (in bf16 a GPU may pick another GEMM for
            # fewer rows: gradients then agree to bf16 rounding, not to this bound).
            torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-9, msg=f"alpha {alpha}: {name}")
        assert memo.stats["layers"] == args.num_layers - 2  # the last two layers keep theirs
        assert memo.host_bytes == 0  # every host block back in the pool after its layer's backward
        offloaded.append(memo.stats["offloaded_bytes"])
        recomputed.append(memo.stats["recomputed_tokens"])
    tokens = args.seq_length * (args.num_layers - 2)
    assert recomputed == [tokens, tokens * 3 // 4, tokens // 2, 0]
    assert offloaded == sorted(offloaded) and offloaded[0] > 0  # alpha 0 still offloads input + attention


# ---- the bytes: S_input + S_attn + alpha x the rest, per managed layer --------------------------------
FORMULA = {
    "mha": ("--num-layers 4", 1),
    "gqa-rope": ("--num-layers 4 " + GQA_ROPE, 1),
    "gqa-rope-ulysses": ("--num-layers 4 --context-parallel-size 2 --cp-comm-type a2a " + GQA_ROPE, 2),
    "gqa-rope-ring": ("--num-layers 4 --context-parallel-size 2 --cp-comm-type p2p " + GQA_ROPE, 2),
}


def _formula(flags, alphas):
    for alpha in alphas:
        _formula_at(flags, alpha)


def _formula_at(flags, alpha):
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.longseq.pipeline.seq1f1b import forward_backward_seq1f1b
    from megatron.training.data import random_batches
    from megatron.training.memo_setup import wrap_model
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup

    args = tiny_args(flags, world_size=dist.get_world_size())
    pgs = grid_groups(cp=args.context_parallel_size, hp=args.head_parallel_size)
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    memo, layers = wrap_model(state, alpha, torch.device("cpu"))

    def run():
        forward_backward_seq1f1b(forward_step_func=pretrain_gpt.forward_step,
                                 data_iterator=random_batches(args, pgs, seed=0), model=state.model,
                                 num_microbatches=args.num_microbatches, micro_batch_size=args.micro_batch_size,
                                 p2p_communicator=state.pipeline)

    sizes = memo.calibrate(run)
    memo.reset_stats()
    run()
    # independent of the runtime: the shapes the model must have (fp32 throughout)
    s, b, h = args.seq_length // args.context_parallel_size, args.micro_batch_size, args.hidden_size
    heads, groups, d = args.num_attention_heads, args.num_query_groups or args.num_attention_heads, args.kv_channels
    s_input, s_out, s_lse = s * b * h * 4, s * b * h * 4, b * heads * s * 4  # lse [b, heads/hp, s * hp]
    rows = {(s, b * heads * d * 4), (s, b * groups * d * 4)}
    for layer in sizes:
        assert layer.wholes == (s_input, s_out, s_lse)  # nothing but the input and S_attn goes whole
        assert rows <= set(layer.parts)  # q, k, v are token-wise: recomputed from the input
        assert all(r == s for r, _ in layer.parts)
    rest = sizes[0].other_bytes
    per_layer = s_input + s_out + s_lse + offloaded_rows(alpha, s) * rest // s
    units = len(layers) * args.num_microbatches
    assert memo.stats["layers"] == units
    assert memo.stats["offloaded_bytes"] == units * per_layer
    assert memo.stats["recomputed_tokens"] == units * (s - offloaded_rows(alpha, s))


@pytest.mark.parametrize("case", FORMULA)
def test_offloaded_bytes_are_input_attention_and_alpha_of_the_rest(case):
    flags, world = FORMULA[case]
    run_ranks(_formula, world, flags, (0.0, 0.25, 1.0))


# ---- the schedule ----------------------------------------------------------------------------------
def test_copies_follow_the_rounding_buffer_schedule():
    init_single_rank_world()
    args = tiny_args("--num-layers 7 " + GQA_ROPE)
    log = []
    model, memo, _ = managed(args, 0.5, log)
    lm_loss(model, args).backward()
    done = check(log)  # no read before its copy, no overwrite before the last reader
    first_read = {}
    for a in done:
        if a.stream == "compute" and a.op == "read":
            first_read.setdefault(a.owner, a.position)
    prefetch = {a.owner: a.position for a in done if a.stream == "prefetch" and a.op == "write"}
    managed_layers = args.num_layers - 2
    assert sorted(prefetch) == list(range(managed_layers))
    for layer in range(1, managed_layers):  # layer i-1's copies are under way before i's backward
        assert prefetch[layer - 1] < first_read[layer]
    # layer i+2's staging waits for layer i's offload: the two buffers alternate, the last two
    # layers' too -- they stay in theirs (resident: no copy to host memory and back)
    writes = [a.buffer for a in done if a.stream == "compute" and a.op == "write"]
    assert writes == [i % 2 for i in range(args.num_layers)]
    offloaded = {a.owner for a in done if a.stream == "offload"}
    assert offloaded == set(range(managed_layers))


def _held_after_forward(args, keep_last: int) -> int:
    """Bytes a training forward leaves allocated, MEMO's buffers and host pool made before."""
    from megatron.longseq.memo.trace import AllocationTracer, Trace

    model = tiny_gpt(args, grid_groups())
    memo = Memo(0.5, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()})
    memo.wrap(model.decoder.layers, keep_last=keep_last)
    memo.calibrate(lambda: lm_loss(model, args).backward())
    model.zero_grad(set_to_none=True)
    trace = Trace()
    with AllocationTracer(trace):
        trace.mark("start")
        loss = lm_loss(model, args)
        gc.collect()
        trace.mark("forward")
        loss.backward()
    now, at = 0, {}
    for kind, label, size in trace.events:
        now += size if kind == "malloc" else -size if kind == "free" else 0
        at[label] = now
    return at["forward"] - at["start"]


def test_the_kept_layers_stay_in_the_rounding_buffers():
    """Section 4.1: the two rounding buffers hold every layer's skeletal activations, the last two
    layers' too (their backward follows at once: they stay in their buffer instead of going to the
    host). So keeping them costs the device nothing beyond the buffers: a forward leaves as much
    allocated as one where every layer is managed (before: two layers' activations more)."""
    init_single_rank_world()
    args = tiny_args("--num-layers 4 " + GQA_ROPE)
    assert _held_after_forward(args, keep_last=2) == _held_after_forward(args, keep_last=0)


class _Marks:
    """Layer windows (profiler.mark_layer_windows) as positions in the stream log."""

    def __init__(self, log):
        self.log, self.at = log, {}

    def mark(self, label):
        self.at.setdefault(label, []).append(len(self.log))


def _seq1f1b(args, alpha, recompute_kept, log=None, marks=None, keep_none=False):
    """One Seq1F1B iteration (the last two layers full-recomputed when `recompute_kept`); MEMO over
    the rest unless alpha is None -- over every layer with `keep_none`, as on a pipeline stage
    before the last, the schedule telling it about units -- its streams logged into `log` after
    calibration, the kept layers' windows marked on `marks`. Returns the gradients, the managed
    layers and the runtime."""
    import pretrain_gpt
    from megatron.longseq.pipeline.seq1f1b import forward_backward_seq1f1b
    from megatron.longseq.memo.profiler import mark_layer_windows
    from megatron.longseq.recompute import apply_full_recompute
    from megatron.training.data import random_batches
    from megatron.training.memo_setup import wrap_model
    from megatron.training.model import build_model_chunks, unwrap
    from megatron.training.training import setup

    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    layers = unwrap(state.model)[0].decoder.layers
    if recompute_kept:  # as the trainer builds it: recompute wrapped first, MEMO around it
        apply_full_recompute(layers[-2:], "block", 2)

    def run():
        forward_backward_seq1f1b(forward_step_func=pretrain_gpt.forward_step,
                                 data_iterator=random_batches(args, pgs, seed=0), model=state.model,
                                 num_microbatches=args.num_microbatches, micro_batch_size=args.micro_batch_size,
                                 p2p_communicator=state.pipeline)

    managed, memo = [], None
    if alpha is not None and keep_none:
        memo, managed = Memo(alpha, torch.device("cpu"), {state.optimizer.buffer.param_data.data_ptr()}), layers
        memo.wrap(layers, keep_last=0)
        state.pipeline.unit_hooks = memo
    elif alpha is not None:
        memo, managed = wrap_model(state, alpha, torch.device("cpu"))
    if memo is not None:
        memo.calibrate(run)
        state.optimizer.zero_grad()
        memo.streams = Streams(torch.device("cpu"), log)
    if marks is not None:
        mark_layer_windows(layers[-2:], marks)
    run()
    return {n: p.main_grad.clone() for n, p in unwrap(state.model)[0].named_parameters()}, managed, memo


@pytest.mark.parametrize("recompute_kept", [False, True], ids=["kept-layers-stored", "kept-layers-recomputed"])
def test_the_last_managed_layers_prefetch_runs_during_the_kept_layers_backward(recompute_kept):
    """Section 4.1: layer i-1's copies overlap layer i's backward -- also for the last managed
    layer, whose successor is a kept layer resident in its rounding buffer: its prefetch is issued
    as that kept layer's backward begins, before it reads its buffer, not with its own backward.
    Seq1F1B runs two segments' forwards before their backwards, so the first segment's kept layers
    move out of the buffers the second one's forward takes (the schedule check covers it)."""
    init_single_rank_world()
    args = tiny_args("--num-layers 5 --pipe-sp-splits 2 --global-batch-size 4 " + GQA_ROPE)
    log = []
    marks = _Marks(log)
    grads, managed, _ = _seq1f1b(args, 0.5, recompute_kept, log, marks)
    done = check(log)  # no read before its copy, no overwrite before the last reader
    n, last = args.num_layers, len(managed) - 1  # every layer's forward takes an id, a unit's count up
    units = args.num_microbatches * args.pipe_sp_splits
    prefetched = {a.owner: a.position for a in done if a.stream == "prefetch" and a.op == "write"}
    first_read = {}
    for a in done:
        if a.stream == "compute" and a.op == "read":
            first_read.setdefault(a.owner, a.position)
    kept_done = marks.at[f"end bwd L{n - 1}"]  # the first kept layer's backward is over
    assert len(kept_done) == units
    for unit in range(units):
        owner = unit * n + last
        assert any(prefetched[owner] < at < first_read[owner] for at in kept_done), f"unit {unit}"
    assert not any(a.owner % n > last for a in done if a.stream in ("offload", "prefetch"))  # residents stay
    reference, _, _ = _seq1f1b(args, None, recompute_kept)
    for name, grad in grads.items():  # bitwise on CPU; the bound of the alpha test above
        torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-9, msg=name)


def test_a_stage_without_kept_layers_prefetches_before_its_gradient_arrives(monkeypatch):
    """On a pipeline stage before the last, no kept layer comes after the managed ones: the schedule
    tells MEMO that a unit's backward begins before it waits for the gradient from the next stage,
    and the last managed layer's copies start there (issued by that call, before any of the unit's
    backward), not with the layer's own backward."""
    init_single_rank_world()
    args = tiny_args("--num-layers 3 --pipe-sp-splits 2 --global-batch-size 4 " + GQA_ROPE)
    log, calls = [], []
    begins = Memo.backward_begins

    def logged(memo, unit):  # where in the stream log the call began and ended
        start = len(log)
        begins(memo, unit)
        calls.append((unit, start, len(log)))

    monkeypatch.setattr(Memo, "backward_begins", logged)
    grads, managed, memo = _seq1f1b(args, 0.5, False, log, keep_none=True)
    done = check(log)
    n = len(managed)
    calls = calls[-args.num_microbatches * args.pipe_sp_splits:]  # the logged iteration's units
    prefetched = {a.owner: a.position for a in done if a.stream == "prefetch" and a.op == "write"}
    # units' backwards run in the reverse order of their forwards (LIFO over segments, micro-batches
    # in order): the k-th backward is the unit whose managed forwards ended with id n-1 + n*unit
    starts = [start for _, start, _ in calls]
    ends = [end for _, _, end in calls]
    tails = sorted(owner for owner in prefetched if owner % n == n - 1)
    assert len(tails) == len(calls)
    assert all(any(s <= prefetched[t] < e for s, e in zip(starts, ends)) for t in tails), (calls, prefetched)
    assert not memo.tails  # every unit's tail was taken
    reference, _, _ = _seq1f1b(args, None, False)
    for name, grad in grads.items():  # bitwise on CPU; the bound of the alpha test above
        torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-9, msg=name)


class _NoComputeWaits(Streams):
    def wait(self, name, event):
        if name != "compute":
            super().wait(name, event)


def test_the_schedule_check_catches_a_missing_wait():
    init_single_rank_world()
    args = tiny_args("--num-layers 5")
    log = []
    model, memo, _ = managed(args, 0.5, log)
    memo.streams = _NoComputeWaits(torch.device("cpu"), log)
    lm_loss(model, args).backward()
    with pytest.raises(ScheduleError, match="before"):
        check(log)


# ---- the measuring iteration -------------------------------------------------------------------------
def _measured(args):
    """A measuring iteration under the allocation tracer: its sizes, its bytes (`_bytes`) and its
    gradients; and the sizes a training iteration's forwards save."""
    from megatron.longseq.memo import runtime
    from megatron.longseq.memo.trace import AllocationTracer, Trace

    model = tiny_gpt(args, grid_groups())
    memo = Memo(0.5, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()})
    memo.wrap(model.decoder.layers)
    trace = Trace()
    allocate = memo.allocate
    memo.allocate = lambda *sizes: trace.mark("measured") or allocate(*sizes)

    def run():
        seed_everything(7, 0, torch.device("cpu"))  # the reference's dropout masks
        loss = lm_loss(model, args)
        gc.collect()
        trace.mark("begin backward")
        loss.backward()

    with AllocationTracer(trace):  # the parameters, made before, are no allocations of the trace
        trace.mark("parameters")
        sizes = memo.calibrate(run)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    states = []
    original = runtime.LayerState.forward
    runtime.LayerState.forward = lambda self: states.append(self) or original(self)
    try:
        lm_loss(model, args).backward()
    finally:
        runtime.LayerState.forward = original
    return sizes, _bytes(trace), grads, [s.sizes() for s in states if not s.resident]


def _bytes(trace):
    """Bytes beyond the parameters: alive when the forward is over (what the backward holds on
    to), at the peak, and alive when measuring is over (before the buffers are allocated)."""
    now, peak, at, alive = 0, 0, {}, {}
    for kind, label, size in trace.events:
        now += size if kind == "malloc" else -size if kind == "free" else 0
        at[label] = now
        if kind != "mark" and "parameters" in at and "measured" not in at:
            peak = max(peak, now)
        if kind == "malloc" and "begin backward" not in at:  # what the forward leaves, by size:
            alive[label] = size                                 # named when a count is off
        elif kind == "free" and "begin backward" not in at:
            alive.pop(label, None)
    base = at["parameters"]
    sizes = Counter(alive.values())
    return {"forward": at["begin backward"] - base, "peak": peak - base, "measured": at["measured"] - base,
            "sizes": sizes}


@pytest.mark.parametrize("case", CASES)
def test_the_measuring_iteration_holds_the_layer_inputs_only_and_is_exact(case):
    """Memo.measure keeps what full recompute keeps -- each managed layer's input -- instead of
    input and attention output and lse (about twice as much): it runs where training fits. Its
    peak grows by what a layer holds from its forward to its backward or by its gradients,
    whichever is more: no layer's forward or replay outlives that layer's backward, and nothing
    outlives the measuring but the gradients."""
    init_single_rank_world()
    sizes, grads, nbytes = {}, {}, {}
    for layers in (4, 6):  # two managed layers more: what each one holds, the rest cancels
        args = tiny_args(CASES[case] + f" --num-layers {layers}")
        sizes[layers], nbytes[layers], grads[layers], trained = _measured(args)
        assert sizes[layers] == trained  # what the training forwards save, measured
        reference, _ = iteration(args, None)
        for name, grad in grads[layers].items():  # bitwise on CPU; the bound of the alpha test
            torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-9, msg=name)
        assert nbytes[layers]["measured"] == sum(g.untyped_storage().nbytes() for g in grads[layers].values())
    held = nbytes[6]["forward"] - nbytes[4]["forward"]
    s_input = args.seq_length * args.micro_batch_size * args.hidden_size * 4
    extra = f"left by the forward, by size: {nbytes[6]['sizes'] - nbytes[4]['sizes']} more at 6 layers, " \
            f"{nbytes[4]['sizes'] - nbytes[6]['sizes']} more at 4"
    if "dropout" in case:  # SDPA's saved tensors stay: its dropout mask cannot be drawn again
        assert held > 2 * s_input, extra
    else:
        assert held == 2 * s_input, extra
    layer_grads = 2 * sum(p.numel() * 4 for p in tiny_gpt(args, grid_groups()).decoder.layers[0].parameters())
    assert nbytes[6]["peak"] - nbytes[4]["peak"] == max(held, layer_grads)


def test_training_iterations_leave_no_bytes_behind():
    """The replay frees what it recomputed once its layer's backward is over. A replay graph tied
    to itself (RMSNorm's rsqrt saves its own output) is beyond Python's gc: it kept the dropped
    tokens' recomputed tensors of every managed layer, one more set each iteration."""
    from megatron.longseq.memo.trace import AllocationTracer, Trace

    init_single_rank_world()
    args = tiny_args(CASES["gqa-rope-swiglu-rms"])
    model, memo, _ = managed(args, 0.5)
    trace, alive = Trace(), []
    with AllocationTracer(trace):
        for _ in range(3):  # the first makes the gradients; the others add into them
            lm_loss(model, args).backward()
            gc.collect()
            alive.append(sum(size if kind == "malloc" else -size if kind == "free" else 0
                             for kind, _, size in trace.events))
    assert alive[2] == alive[1] == alive[0]


# ---- memory sized once -------------------------------------------------------------------------------
def test_buffers_and_pool_are_sized_once_and_refuse_to_grow():
    init_single_rank_world()
    args = tiny_args(CASES["gqa-rope-swiglu-rms"])
    model, memo, sizes = managed(args, 0.5)
    # a managed layer's share, or a resident one's (all it saved, whole storages), the larger
    managed_share = max(s.buffer_bytes for s in sizes)
    assert memo.resident_bytes > 0 and memo.buffers.nbytes == max(managed_share, memo.resident_bytes)
    assert memo.pool.blocks == args.num_layers - 2 and memo.pool.block_bytes == sizes[0].host_bytes(0.5)
    longer = tiny_args(CASES["gqa-rope-swiglu-rms"] + " --seq-length 64")
    with pytest.raises(MemoCapacityError, match="rounding buffer"):
        lm_loss(model, longer).backward()
    with pytest.raises(RuntimeError, match="allocated once"):  # the side streams may still use the old ones
        memo.allocate(memo.buffers.nbytes, memo.pool.blocks, memo.pool.block_bytes)


def test_eval_forward_is_untouched():
    init_single_rank_world()
    args = tiny_args(CASES["mha-learned"])
    model = tiny_gpt(args, grid_groups())
    memo = Memo(0.5, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()})
    memo.wrap(model.decoder.layers)
    with torch.no_grad():
        lm_loss(model, args)
    assert memo.stats["layers"] == 0 and memo.host_bytes == 0


def test_layer_states_are_freed_after_backward():
    import weakref

    from megatron.longseq.memo import runtime

    init_single_rank_world()
    args = tiny_args(CASES["mha-learned"])
    states = []
    original = runtime.LayerState.forward

    def tracking(self):
        states.append(weakref.ref(self))
        return original(self)

    runtime.LayerState.forward = tracking
    try:
        iteration(args, 0.5)
    finally:
        runtime.LayerState.forward = original
    gc.collect()
    alive = [s for s in states if s() is not None and s() is not s().memo.last]
    # two forwards (calibration and training) of 4 layers, 2 managed and 2 resident; only the
    # runtime's pointer to the last layer may remain
    assert len(states) == 2 * args.num_layers and not alive


def test_pinned_host_memory_is_exactly_what_was_asked_and_unpinned_when_freed(monkeypatch):
    """On a GPU the host pool is plain memory registered with CUDA: torch's pinned allocator would
    round it up to a power of two (a 33 GiB pool pins 64 GiB) and keep it cached after the free."""
    from megatron.longseq.memo import streams

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    nbytes = 3 * 2**20 + 512  # not a power of two
    before = streams.HOST["now"]
    t = streams.host_empty(nbytes, pin=True)
    ptr = t.data_ptr()
    assert calls == [("register", ptr, nbytes)] and t.numel() == nbytes
    assert streams.HOST["now"] - before == nbytes
    del t
    gc.collect()
    assert calls[1:] == [("unregister", ptr)] and streams.HOST["now"] == before
    streams.host_empty(4096, pin=False)
    assert len(calls) == 2  # unpinned on CPU


def test_forked_processes_do_not_inherit_the_host_pool():
    """Data-loader workers are forked after MEMO took its host memory. Pinned pages are copied into
    a child at fork, not shared: on a GPU each worker would copy the whole pool (21 GiB at 64K
    tokens on an H100 stalled the run). The child must not have the pool mapped at all."""
    import os

    from megatron.longseq.memo import streams

    t = streams.host_empty(5 * 2**20 + 100, pin=False)
    t.fill_(7)
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    pid = os.fork()
    if pid == 0:  # the child: is any byte of the pool in one of its mappings?
        with open("/proc/self/maps") as maps:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
        os._exit(1 if any(lo < end and start < hi for lo, hi in spans) else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "a forked child has the host pool mapped"
    assert int(t.sum()) == 7 * t.numel()  # the parent's copy is whole
    assert streams.host_empty(0, pin=True).numel() == 0


class _SavesAnotherDevicesScalar(torch.autograd.Function):
    """What torch's SDPA does on a GPU with dropout: it saves its philox seed and offset as host
    scalars, which its backward reads through a host pointer (here a meta tensor stands for a tensor
    off the run's device)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.empty((), dtype=torch.int64, device="meta"))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        assert seed.device.type == "meta", seed.device  # handed back where it was, not copied
        return grad


def test_tensors_saved_off_the_runs_device_are_kept_where_they_are(monkeypatch):
    from megatron.longseq.attention.core import LongSeqCoreAttention

    real = LongSeqCoreAttention._sdpa
    monkeypatch.setattr(LongSeqCoreAttention, "_sdpa",
                        lambda self, *a: _SavesAnotherDevicesScalar.apply(real(self, *a)))
    init_single_rank_world()
    args = tiny_args(CASES["mha-attention-dropout"])
    reference, _ = iteration(args, None)
    grads, memo = iteration(args, 0.5)
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, atol=0, rtol=0, msg=name)


def test_the_host_pool_waits_for_the_newest_prefetch_whatever_order_blocks_come_back():
    """An offload into a given-back host block waits for `released`, the newest prefetch that read
    a block back. A layer whose backward never ran gives its block back late, with an older
    prefetch's event: `released` must not go back to it (the newer prefetch may still be reading)."""
    pool = HostPool(3, 512, pin=False)
    first, second, never_read = (pool.take(512, layer) for layer in range(3))
    older, newer = pool.prefetched("older"), pool.prefetched("newer")  # events: any value here
    pool.give_back(second, newer)
    pool.give_back(first, older)
    pool.give_back(never_read, None)
    assert pool.released == "newer" and pool.in_use == 0
