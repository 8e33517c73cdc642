"""Gradient buffer + AdamW on 2 data-parallel ranks against one process training on the full batch."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.training.distributed import GradBuffer
from megatron.training.optimizer import DistributedAdam, no_weight_decay
from tests.unit_tests.dist_utils import grid_groups, run_ranks

OPT_ARGS = SimpleNamespace(lr=1e-2, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1,
                           clip_grad=0.5, check_for_nan_in_loss_and_grad=True, overlap_param_gather=False,
                           log_params_norm=False)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Parameter(torch.ones(3))  # never gets a gradient: zeros counted

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def batches(step):
    """4 micro-batches of the global batch of `step`; rank r of 2 gets micro-batches 2r, 2r+1."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)) for _ in range(4)]


def reference_training(steps):
    torch.manual_seed(0)
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if not no_weight_decay(n, p)]
    other = [p for n, p in model.named_parameters() if no_weight_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=OPT_ARGS.lr,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches(step)) / 4
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT_ARGS.clip_grad).item())
        opt.step()
    return model, norms


def ddp_training(model, buffer, opt, steps, start=0):
    rank, dtype = dist.get_rank(), next(model.parameters()).dtype
    n = 4 // dist.get_world_size()  # micro-batches per rank
    norms, zeros = [], []
    for step in range(start, start + steps):
        opt.zero_grad()
        mine = batches(step)[n * rank : n * rank + n]
        for i, (x, y) in enumerate(mine):
            ctx = buffer.no_sync() if i < n - 1 else torch.enable_grad()
            with ctx:
                (torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) / n).backward()
        buffer.finish_grad_sync()
        _, norm, num_zeros = opt.step(count_zeros=True)
        norms.append(norm)
        zeros.append(num_zeros)
    return norms, zeros


def _build(shard, overlap, bucket, dtype=torch.float32, gather=False, avg=False, instances=1):
    pgs = grid_groups(instances=instances)
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    # the groups training.setup passes: one instance's dp ranks, and the same shard in the others
    buffer = GradBuffer(list(model.parameters()), pgs.dp_cp_intra, shard=shard, overlap=overlap,
                        bucket_elements=bucket, average_in_collective=avg, across=pgs.dp_cp_inter)
    if gather:
        buffer.wait_params_before_forward([model])
    args = SimpleNamespace(**{**vars(OPT_ARGS), "overlap_param_gather": gather})
    return pgs, model, buffer, DistributedAdam(model.named_parameters(), buffer, pgs, args)


def _check_against_reference(shard, overlap, bucket, gather=False, avg=False, instances=1):
    pgs, model, buffer, opt = _build(shard, overlap, bucket, gather=gather, avg=avg, instances=instances)
    assert buffer.shards == (dist.get_world_size() // instances if shard else 1)
    assert buffer.dp_size == dist.get_world_size()
    assert len(buffer.buckets) == (1 if bucket > 1000 else len(buffer.buckets)) and len(buffer.buckets) >= 1
    norms, zeros = ddp_training(model, buffer, opt, steps=4)
    if gather:  # the last step's gathers are still in flight: nothing has run a forward since
        assert len(buffer.buckets) > 1 and all(b.gather is not None for b in buffer.buckets)
        model(torch.zeros(1, 8))  # the forward pre-hooks, and nothing else, wait for them
        assert all(b.gather is None for b in buffer.buckets)
    ref, ref_norms = reference_training(steps=4)
    # fp32: the two paths sum the same terms in a different order (per-rank halves, then the
    # all-reduce); Adam divides by sqrt(v) so relative gradient rounding (~1e-7) moves parameters by
    # ~lr * 1e-7 per step. 1e-6 absolute on O(0.1-1) parameters is far above that and far below a bug.
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    for got, want in zip(norms, ref_norms):
        assert abs(got - want) <= 1e-6 * want
    assert all(z >= 3 for z in zeros)  # the unused parameter's 3 zero gradients
    buffer.check_replicas(iteration=4)  # every replica, in every instance, holds the same weights


@pytest.mark.parametrize("shard, overlap, bucket, gather, avg", [
    (False, False, 10**8, False, False), (True, False, 10**8, False, False), (False, True, 50, False, False),
    (True, True, 50, False, False), (True, True, 50, True, False), (True, True, 50, False, True),
], ids=["allreduce", "distopt", "overlap-buckets", "distopt-overlap-buckets", "distopt-overlap-param-gather",
        "distopt-overlap-average-in-collective"])
def test_two_ranks_match_full_batch_adamw(shard, overlap, bucket, gather, avg):
    """With --overlap-param-gather each step's forward first waits, per module, for the gathers
    of its own buckets: the same parameters as gathering at once. With
    --ddp-average-in-collective the mean is taken after the sum (gloo has no AVG op)."""
    run_ranks(_check_against_reference, 2, shard, overlap, bucket, gather, avg)


@pytest.mark.parametrize("avg", [False, True], ids=["divide-first", "average-in-collective"])
def test_two_distributed_optimizer_instances_match_full_batch_adamw(avg):
    """--num-distributed-optimizer-instances 2 on 4 ranks: reduce-scatter inside each pair, the
    shards all-reduced across the pairs, parameters gathered inside the pair; overlapped buckets."""
    run_ranks(_check_against_reference, 4, True, True, 50, True, avg, 2)


def _nccl_on_gloo():
    """NCCL's branches of the buffer on gloo: the backend reads as nccl (in-place gathers, the
    reductions' ReduceOp.AVG), and AVG, which gloo lacks, is its sum divided by the group size once
    the work is waited for, when NCCL's result would be there."""
    dist.get_backend = lambda group=None: "nccl"

    def averaging(real):
        def collective(out, *args, op=dist.ReduceOp.SUM, group=None, async_op=False, **kwargs):
            work = real(out, *args, op=dist.ReduceOp.SUM, group=group, async_op=True, **kwargs)
            divisor = dist.get_world_size(group) if op == dist.ReduceOp.AVG else 1
            done = SimpleNamespace(wait=lambda: (work.wait(), out.div_(divisor)))
            if async_op:
                return done
            done.wait()
        return collective

    dist.reduce_scatter_tensor = averaging(dist.reduce_scatter_tensor)
    dist.all_reduce = averaging(dist.all_reduce)


def _nccl_branches_against_reference(instances):
    _nccl_on_gloo()
    _, _, buffer, _ = _build(True, True, 50, gather=True, avg=True, instances=instances)
    assert buffer.avg_op and buffer.gather_in_place
    _check_against_reference(True, True, 50, gather=True, avg=True, instances=instances)


@pytest.mark.parametrize("world, instances", [(2, 1), (4, 2)])
def test_nccl_average_in_collective_and_in_place_gathers_match_full_batch_adamw(world, instances):
    """The buffer's NCCL-only branches, which gloo never takes: ReduceOp.AVG in the reduce-scatter
    and in the all-reduce across instances, and the parameters gathered in place."""
    run_ranks(_nccl_branches_against_reference, world, instances)


class _Issued:
    """Notes each collective and each wait for one, in order: (kind, its group's ranks, its tensor's address)
    -- a bucket's reduce-scatter writes the shard its all-reduce across the instances then reads --
    and where finish_grad_sync begins and ends."""

    def __init__(self):
        self.events = []

    def noting(self, kind, real):
        def collective(tensor, *args, group=None, **kwargs):
            event = (kind, tuple(dist.get_process_group_ranks(group)), tensor.data_ptr())
            self.events.append(event)
            work = real(tensor, *args, group=group, **kwargs)
            return SimpleNamespace(wait=lambda: (self.events.append(("wait",) + event), work.wait()))
        return collective

    def backwards(self):
        """The events of each backward: from the end of one finish_grad_sync to the next's start."""
        out, current = [], []
        for event in self.events:
            if event == ("finish",):
                out.append(current)
            current = [] if event in (("finish",), ("done",)) else current + [event]
        return out


def _check_two_levels_overlap_the_backward():
    """(In a rank of its own: the stand-ins replace torch's functions for the whole process.)"""
    pgs = grid_groups(instances=2)
    inside_ranks, across_ranks = (tuple(dist.get_process_group_ranks(g)) for g in (pgs.dp_cp_intra, pgs.dp_cp_inter))
    issued = _Issued()
    for kind in ("reduce_scatter_tensor", "all_reduce"):
        setattr(dist, kind, issued.noting(kind, getattr(dist, kind)))
    finish = GradBuffer.finish_grad_sync
    GradBuffer.finish_grad_sync = lambda self: (issued.events.append(("finish",)), finish(self),
                                                issued.events.append(("done",)))
    _check_against_reference(True, True, 50, False, False, 2)  # the four steps equal full-batch AdamW
    buckets = len(_build(True, True, 50, instances=2)[2].buckets)
    assert buckets >= 3
    backwards = issued.backwards()
    assert len(backwards) == 4
    for events in backwards:
        inside = [e for e in events if e[:2] == ("reduce_scatter_tensor", inside_ranks)]
        across = [e for e in events if e[:2] == ("all_reduce", across_ranks)]
        # Tiny's unused parameter keeps its bucket from completing in the backward; every other
        # bucket's first level starts there, and all but the last of them go across there
        assert len(inside) == buckets - 1 and len(across) == buckets - 2, events
        for event in across:  # after its own first level has arrived...
            waited = events.index(("wait",) + inside[[e[2] for e in inside].index(event[2])])
            assert waited < events.index(event)
            # ...which was waited for only once another bucket's had been issued after it
            assert events[waited - 1][0] == "reduce_scatter_tensor" and events[waited - 1][2] != event[2]


def test_two_level_reduction_overlaps_the_backward():
    """--num-distributed-optimizer-instances 2 (4 ranks), overlapped buckets: each bucket's
    reduce-scatter starts in the backward's hook; its all-reduce across the instances, which must
    wait for it, starts in the next bucket's hook, right after that bucket's reduce-scatter -- not
    at once (a wait for a collective just issued would hold the compute stream, and under
    CUDA_DEVICE_MAX_CONNECTIONS=1 every kernel behind it) and not after the whole backward."""
    run_ranks(_check_two_levels_overlap_the_backward, 4)


def _check_checkpoint_round_trip(shard, dtype, fused=False):
    """The state every checkpoint holds: model space (laid out like this buffer, whole on every
    rank; checkpointing maps it per parameter to Megatron's layouts). `fused`: torch's fused AdamW,
    which a CUDA run takes, here on the host."""
    if fused:
        from megatron.training import optimizer

        optimizer.fused_adamw = lambda device: True
    pgs, model, buffer, opt = _build(shard, True, 50, dtype)
    assert all(g["fused"] is (True if fused else None) for g in opt.param_groups)
    ddp_training(model, buffer, opt, steps=2)
    gathered, real_gather = [], dist.all_gather_into_tensor
    dist.all_gather_into_tensor = lambda out, *a, **k: gathered.append(out.numel()) or real_gather(out, *a, **k)
    try:
        flats, steps = copy.deepcopy(opt.model_space_state()), opt.adam_steps()
    finally:
        dist.all_gather_into_tensor = real_gather
    # in host memory, through the device one bucket at a time
    assert all(flat.device.type == "cpu" for flat in flats.values())
    assert len(gathered) == (3 * len(buffer.buckets) if shard else 0)
    assert max(gathered, default=0) <= max(b.end - b.start for b in buffer.buckets) < buffer.param_data.numel()
    saved_model = copy.deepcopy(model.state_dict())
    ddp_training(model, buffer, opt, steps=2, start=2)
    # A fresh process-like start: new model/buffer/optimizer, then load.
    _, model2, buffer2, opt2 = _build(shard, True, 50, dtype)
    model2.load_state_dict(saved_model)
    opt2.reload_model_params()
    opt2.load_model_space_state(flats, steps)
    ddp_training(model2, buffer2, opt2, steps=2, start=2)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name  # bitwise: resume is exact
    steps_kept = [(s["step"].device, s["step"].dtype) for o in (opt, opt2) for s in o.optimizer.state.values()]
    assert len(set(steps_kept)) == 1  # the loaded step where torch's own AdamW keeps it
    if dtype == torch.bfloat16:  # fp32 main params restored, not re-rounded
        assert torch.equal(opt.model_space_state()["fp32_param"], opt2.model_space_state()["fp32_param"])


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_optimizer_state_round_trip_is_exact(shard, dtype):
    run_ranks(_check_checkpoint_round_trip, 2, shard, dtype)


def test_fused_adamw_state_round_trip_is_exact():
    run_ranks(_check_checkpoint_round_trip, 2, True, torch.bfloat16, True)


def _check_nan_grad_raises():
    _, model, buffer, opt = _build(False, False, 10**8)
    opt.zero_grad()
    model(torch.full((2, 8), float("nan"))).sum().backward()
    buffer.finish_grad_sync()
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        opt.step()


def test_nan_gradients_stop_training():
    run_ranks(_check_nan_grad_raises, 2)


def test_decoupled_lr_drives_the_embedding_and_output_layer_on_their_own_schedule(tmp_path):
    """--decoupled-lr / --decoupled-min-lr: the word embedding and output layer follow the same
    schedule shape between their own peak and floor; every other parameter keeps --lr/--min-lr."""
    from megatron.training.training import setup
    from tests.unit_tests.dist_utils import init_single_rank_world
    from tests.unit_tests.model_utils import tiny_args, tiny_gpt

    init_single_rank_world()
    args = tiny_args("--lr 1e-3 --min-lr 1e-4 --decoupled-lr 5e-3 --decoupled-min-lr 5e-4 --lr-decay-style linear "
                     "--untie-embeddings-and-output-weights")
    state = setup(args, grid_groups(), lambda a, p, d: tiny_gpt(a, p))
    own = {id(f.main) for f, (p, _, _) in zip(state.optimizer.fragments, state.optimizer.buffer.param_fragments())
           if getattr(p, "is_embedding_or_output_parameter", False)}
    assert len(own) == 2  # word embedding and output layer

    def lrs():
        return {any(id(m) in own for m in g["params"]): g["lr"] for g in state.optimizer.param_groups}

    state.scheduler.step(args.global_batch_size * 5)  # half way through a linear decay over 10 steps
    assert lrs() == pytest.approx({True: (5e-3 + 5e-4) / 2, False: (1e-3 + 1e-4) / 2})
    state.scheduler.step(args.global_batch_size * 5)
    assert lrs() == pytest.approx({True: 5e-4, False: 1e-4})


def _check_replica_hash():
    pgs, model, buffer, opt = _build(True, False, 50)
    ddp_training(model, buffer, opt, steps=1)
    buffer.check_replicas(1)  # the same weights everywhere
    if dist.get_rank() == 1:
        buffer.param_data[3] = torch.nextafter(buffer.param_data[3], torch.tensor(2.0))  # one ulp
    with pytest.raises(RuntimeError, match=r"iteration 2: the weights of data-parallel replicas \[1\] differ"):
        buffer.check_replicas(2)


def test_weight_hash_finds_a_replica_one_ulp_off():
    run_ranks(_check_replica_hash, 2)


def _check_step_count_on_an_all_padding_shard():
    pgs = grid_groups()
    model = torch.nn.Linear(1, 1, bias=False)  # one element: rank 1's shard is all padding
    buffer = GradBuffer(list(model.parameters()), pgs.dp_cp, shard=True, overlap=False, bucket_elements=10**8)
    opt = DistributedAdam(model.named_parameters(), buffer, pgs, OPT_ARGS)
    assert len(opt.fragments) == 1 - dist.get_rank()
    assert len(opt.param_groups) == 1  # the group exists on the rank that owns none of it
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 1)).sum().backward()
        buffer.finish_grad_sync()
        opt.step()
    assert opt.adam_steps() == 2  # on both ranks: checkpoints record it from whichever rank writes


def test_every_rank_knows_adams_step_count():
    """A rank whose shard is all padding builds its (empty) groups and counts Adam's steps."""
    run_ranks(_check_step_count_on_an_all_padding_shard, 2)


def _check_unscaling_makes_no_fragment_sized_temporaries():
    """fp16 unscaling runs as torch's multi-tensor unscale-and-check: the gradients divided by the
    scale, an overflow on one rank seen by both, and no temporary as large as a fragment (a
    finiteness mask per fragment before)."""
    from megatron.training.loss_scaler import LossScaler
    from tests.unit_tests.alloc_count import CreatedTensors

    pgs, model, buffer, _ = _build(shard=True, overlap=False, bucket=None)
    opt = DistributedAdam(model.named_parameters(), buffer, pgs, OPT_ARGS, LossScaler(256.0, hysteresis=1))
    ddp_training(model, buffer, opt, steps=1)  # gradients in place (its step's own unscale aside)
    grads = [f.main.grad.clone() for f in opt.fragments]
    largest = max(f.main.numel() for f in opt.fragments)
    with CreatedTensors() as created:
        found = opt._unscale_found_inf()
    assert not created.at_least(largest), created.created
    assert not found and all(torch.equal(f.main.grad, g / 256.0) for f, g in zip(opt.fragments, grads))
    if dist.get_rank() == 0:
        opt.fragments[0].main.grad.view(-1)[0] = float("inf")
    assert opt._unscale_found_inf()  # every rank learns of the one overflow


def test_unscaling_makes_no_fragment_sized_temporaries():
    run_ranks(_check_unscaling_makes_no_fragment_sized_temporaries, 2)


def _check_step_reductions_make_no_fragment_sized_temporaries():
    """Grad norm, zero count and clip take a fragment in pieces (REDUCE_CHUNK, lowered to 8
    elements here): no temporary as large as a fragment (the embedding's reach GiBs), the same
    norm and count as whole fragments (fp32 sums of 8-element pieces: ~1e-7 relative), and the
    clip multiplies every gradient by one coefficient in a multi-tensor kernel, bit for bit."""
    from megatron.training import optimizer
    from tests.unit_tests.alloc_count import CreatedTensors

    pgs, model, buffer, opt = _build(shard=True, overlap=False, bucket=None)
    ddp_training(model, buffer, opt, steps=1)
    whole_norm, whole_zeros = opt.grad_norm(), opt.count_zeros()
    largest = max(f.main.numel() for f in opt.fragments)
    optimizer.REDUCE_CHUNK = 8
    try:
        with CreatedTensors() as created:
            norm, zeros = opt.grad_norm(), opt.count_zeros()
    finally:
        optimizer.REDUCE_CHUNK = 1 << 24
    assert largest > 8 and not created.at_least(largest), created.created
    assert abs(norm - whole_norm) <= 1e-6 * whole_norm and zeros == whole_zeros
    grads = [f.main.grad.clone() for f in opt.fragments]
    opt.clip_grad, opt.optimizer.step = 1e-3 * norm, lambda: None  # the clip alone
    opt.step()
    coeff = opt.clip_grad / (norm + 1.0e-6)
    assert all(torch.equal(f.main.grad, g * coeff) for f, g in zip(opt.fragments, grads))


def test_step_reductions_make_no_fragment_sized_temporaries():
    run_ranks(_check_step_reductions_make_no_fragment_sized_temporaries, 2)


def _check_in_place_gather():
    """The parameter all-gather as it runs on NCCL (in place: this rank's slice is the input, no
    copy of it) gives the same weights, bit for bit, as the copying one gloo runs."""
    from tests.unit_tests.alloc_count import CreatedTensors

    results = []
    for in_place in (False, True):
        _, model, buffer, opt = _build(shard=True, overlap=False, bucket=50)
        buffer.gather_in_place = in_place
        with CreatedTensors() as created:
            ddp_training(model, buffer, opt, steps=2)
        results.append(buffer.param_data.clone())
        clones = [c for c in created.created if "clone" in c[0]]
        assert bool(clones) != in_place, clones
    assert torch.equal(*results)


def test_the_in_place_parameter_gather_gives_the_same_weights():
    run_ranks(_check_in_place_gather, 2)


class _GroupOfSize:
    """A data-parallel group as megatron-core's buffer asks it while laying itself out."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("shared", [None, 0, 3, 6], ids=["untied", "shared-first", "shared-middle", "shared-last"])
@pytest.mark.parametrize("shards", [1, 3, 256])
@pytest.mark.parametrize("bucket_size", [None, 400, 1])
def test_the_sharded_buffer_is_laid_out_as_megatron_cores(shards, bucket_size, shared):
    """With the distributed optimizer every parameter starts at a multiple of 64 elements and every
    bucket ends at a multiple of lcm(shards, 128): the parameter starts and bucket bounds of
    megatron-core's own buffer, for odd sizes and bucket closings, 1, 3 and 256 shards; a shared
    embedding (the tied word embedding / output layer of a pipeline's first / last stage) in a
    bucket of its own, as there, wherever it comes in the order."""
    from megatron.training.distributed import bucket_layout
    from tests.unit_tests.dist_utils import init_single_rank_world
    from tests.unit_tests.training.test_checkpointing import megatron_core_buffer

    init_single_rank_world()
    numels = (100, 7, 300, 65, 1, 500, 64)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    if shared is not None:
        params[shared].shared_embedding = True
    theirs = megatron_core_buffer(params, bucket_size, _GroupOfSize(shards))
    alone = set() if shared is None else {len(numels) - 1 - shared}  # bucket order: reversed
    spans, starts = bucket_layout(list(reversed(numels)), bucket_size or 10**8, shards, aligned=True, alone=alone)
    assert [(lo, hi) for lo, hi, _ in spans] == theirs.bucket_indices
    assert starts == [theirs.param_index_map[p][0] for p in reversed(params)]
    assert all(start % 64 == 0 for start in starts) and all(hi % math.lcm(shards, 128) == 0 for _, hi, _ in spans)


def test_the_unsharded_buffer_has_no_padding():
    from megatron.training.distributed import bucket_layout

    spans, starts = bucket_layout([100, 7, 300], 10**8, 1, aligned=False)
    assert spans == [(0, 407, [0, 1, 2])] and starts == [0, 100, 107]


def _check_sharded_main_params(shards):
    pgs = grid_groups()
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    # a bucket per parameter or two: with 4 shards a shard of one is 32 elements, not 64
    buffer = GradBuffer(list(model.parameters()), pgs.dp_cp, shard=True, overlap=False, bucket_elements=16)
    opt = DistributedAdam(model.named_parameters(), buffer, pgs, OPT_ARGS)
    assert all(offset % 64 == 0 for offset in buffer.offsets.values())
    assert all(f.main.data_ptr() % 16 == 0 and f.main.grad.data_ptr() % 16 == 0 for f in opt.fragments)
    assert opt.fragments or dist.get_rank() > 0  # with 4 shards rank 1 owns only padding
    owned = sum(hi - lo for lo, hi in buffer.owned_ranges())
    assert owned * shards == buffer.param_data.numel() and owned <= opt.main_data.numel() < owned + 64 * len(
        buffer.buckets)  # this rank's 1/dp of the fp32 copy (each shard from an aligned start)


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_main_params_are_this_ranks_share_and_start_aligned(shards):
    """The buffer and optimizer the trainer builds (bf16 model, parameters of 35, 5, 15 and 3
    elements): every rank holds only its own 1/dp of the fp32 main parameters, and every fp32 main
    fragment and its gradient start 16-byte aligned (what vectorized multi-tensor kernels need)."""
    run_ranks(_check_sharded_main_params, shards, shards)


def _llama_8b_numels():
    """Element counts of a Llama-3-8B-shaped model part in registration order (no tensors)."""
    h, ffn, kv, vocab = 4096, 14336, 1024, 128256
    layer = [h, (h + 2 * kv) * h, h * h, h, 2 * ffn * h, h * ffn]  # norm, qkv, proj, norm, fc1, fc2
    return [vocab * h] + layer * 32 + [h, vocab * h]


@pytest.mark.parametrize("replicas", [2, 8])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_torch_dist_save_gives_each_parameter_one_writer_and_the_replicas_about_equal_shares(replicas, sharded):
    """Every replica holds each bucket whole before a torch_dist save (sharded state is gathered
    first); each parameter's state is copied to the host and written by one of them. Megatron's
    default buckets (40M elements) on an 8B-shaped model: each replica writes within 10% of an
    equal share (a bucket's first element would give its leading large matrix to one replica)."""
    from megatron.training.distributed import DEFAULT_BUCKET_ELEMENTS, bucket_layout

    params = [torch.empty(n, device="meta") for n in _llama_8b_numels()]
    ordered = list(reversed(params))  # the buffer's order (GradBuffer)
    spans, starts = bucket_layout([p.numel() for p in ordered], DEFAULT_BUCKET_ELEMENTS,
                                  replicas if sharded else 1, aligned=sharded)
    offsets, total = dict(zip(ordered, starts)), spans[-1][1]
    shares = []
    for rank in range(replicas):
        buffer = SimpleNamespace(offsets=offsets, dp_size=replicas, replica_rank=lambda rank=rank: rank,
                                 param_data=SimpleNamespace(numel=lambda: total))
        shares.append([p for p in params if DistributedAdam.writes(SimpleNamespace(buffer=buffer), p)])
    assert sorted(id(p) for share in shares for p in share) == sorted(id(p) for p in params)
    size = sum(p.numel() for p in params)
    assert all(abs(sum(p.numel() for p in share) / size - 1 / replicas) <= 0.1 / replicas for share in shares), [
        sum(p.numel() for p in share) / size for share in shares]


def _check_gathers_launch_in_the_order_the_forward_waits():
    pgs = grid_groups()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    buffer = GradBuffer(list(model.parameters()), pgs.dp_cp, shard=True, overlap=True, bucket_elements=50)
    buffer.wait_params_before_forward([model])
    flags = {**vars(OPT_ARGS), "overlap_param_gather": True, "log_params_norm": True}
    opt = DistributedAdam(model.named_parameters(), buffer, pgs, SimpleNamespace(**flags))
    index = {id(b): i for i, b in enumerate(buffer.buckets)}
    launched, waited = [], []
    gather, wait, norm = buffer.gather_bucket, buffer.wait_params, opt.params_norm
    buffer.gather_bucket = lambda piece, bucket, async_op=False: (
        launched.append(index[id(bucket)]) or gather(piece, bucket, async_op))
    buffer.wait_params = lambda buckets=None: (
        waited.extend(index[id(b)] for b in buckets if b.gather is not None) or wait(buckets))
    opt.params_norm = lambda: launched.append("norm") or norm()
    model(torch.zeros(1, 8)).sum().backward()
    buffer.finish_grad_sync()
    opt.step()
    model(torch.zeros(1, 8))
    n = len(buffer.buckets)  # the first layer's parameters are in the last
    assert n > 1 and launched[1:] == waited == list(range(n - 1, -1, -1)), (launched, waited)
    # --log-params-norm: taken before the gathers (its all-reduce would queue behind them), of the
    # new weights; fp32 sums of squares added in another order differ by ~1e-7 relative
    whole = math.sqrt(sum(p.detach().square().sum().item() for p in model.parameters()))
    assert launched[0] == "norm" and abs(opt.last_params_norm - whole) <= 1e-6 * whole


def test_parameter_gathers_launch_in_the_order_the_next_forward_waits_for_them():
    """--overlap-param-gather: buckets follow backward order, so the first layer's parameters sit
    in the last bucket. Gathers on one communicator run in launch order, so they are launched in
    forward order: the first layer's forward waits for its own bucket, not for all of them. The
    params norm (--log-params-norm) is taken before them, and is the norm of the updated weights."""
    run_ranks(_check_gathers_launch_in_the_order_the_forward_waits, 2)


def _each_bucket_once():
    """Overlapped reduction launches each bucket once per synced backward, from the very first
    iteration (before any zero_grad: MEMO's set-up iterations run so), and the reduced shard is
    the full batch's gradient; a gradient given twice is refused, not added to a bucket in flight."""
    _, model, buffer, opt = _build(shard=True, overlap=True, bucket=50)
    launches, real = [], buffer._reduce_inside
    buffer._reduce_inside = lambda bucket: launches.append(id(bucket)) or real(bucket)
    ref = copy.deepcopy(model)
    for step in range(2):
        if step:
            opt.zero_grad()
        mine = batches(step)[2 * dist.get_rank() : 2 * dist.get_rank() + 2]
        for i, (x, y) in enumerate(mine):
            with buffer.no_sync() if i == 0 else torch.enable_grad():
                (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        buffer.finish_grad_sync()
        assert sorted(launches) == sorted(map(id, buffer.buckets)), launches
        launches.clear()
    # the last step's gradient against one process's over the whole batch
    ref.zero_grad()
    (sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in batches(1)) / 4).backward()
    want = torch.zeros_like(buffer.grad_data)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            want[buffer.offsets[p] : buffer.offsets[p] + p.numel()] = q.grad.view(-1)
    for lo, hi in buffer.owned_ranges():  # fp32, sums in another order: ~1e-7 relative
        torch.testing.assert_close(buffer.grad_data[lo:hi], want[lo:hi], atol=1e-6, rtol=1e-5)
    p = model.fc1.weight
    buffer._on_grad(p)  # its bucket waits for the others again
    with pytest.raises(RuntimeError, match="arrived twice"):
        buffer._on_grad(p)


def test_each_bucket_is_reduced_once_per_synced_backward():
    run_ranks(_each_bucket_once, 2)
