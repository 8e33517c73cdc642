"""Pipeline layouts against one stage: the loss and every parameter's gradient of a GPT iteration
(2 micro-batches) are the same for pp 2 and 4, Seq1F1B splits 1/2/4 (average and uniform_comp),
interleaved or not (chunk groups of the pipeline size or larger), combined with tensor parallel 2,
context parallel 2 and 4 (a double ring among them), data parallel 2 (overlapped buckets, the tied
embedding's summed over the stages after the data-parallel reduction; with cp, two optimizer
instances), the per-token loss, Megatron's tp-pp-dp rank order, and MEMO's token-wise
swap/recompute at several alphas. Each row's grid is the one the trainer builds from its flags.
Every row also checks that each stage-to-stage message is received into a buffer of its shape and
dtype (p2p_contract)."""
import contextlib
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron.longseq.pipeline.seq1f1b import forward_backward_seq1f1b
from megatron.longseq.random import seed_everything
from megatron.training.data import random_batches
from megatron.training.init import global_name
from megatron.training.memo_setup import wrap_model
from megatron.training.model import build_model_chunks, unwrap
from megatron.training.training import setup
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_groups, run_ranks
from tests.unit_tests.model_utils import sequence_parallel_on_host, tiny_args

MODEL = ("--num-layers 8 --group-query-attention --num-query-groups 2 --position-embedding-type rope "
         "--swiglu --normalization RMSNorm --disable-bias-linear --global-batch-size 4")


def one_iteration(args, pgs):
    """Loss sum/count (last stage, else None), gradients by global name, the pipeline's stats."""
    import pretrain_gpt

    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    state.pipeline.measure_activations = True
    memo = None

    def run():
        data = random_batches(args, pgs, seed=0)
        for _ in range(pgs.index("dp") * args.num_microbatches):  # the micro-batches of the dp ranks before
            next(data)
        return forward_backward_seq1f1b(
            forward_step_func=pretrain_gpt.forward_step, data_iterator=data,
            model=state.model, num_microbatches=args.num_microbatches, micro_batch_size=args.micro_batch_size,
            p2p_communicator=state.pipeline)

    if args.memo:  # the runtime alone, at the forced alpha (the trainer's profile/plan aside)
        memo, managed = wrap_model(state, float(args.memo_swap_fraction), torch.device("cpu"))
        memo.calibrate(run)  # a measured iteration sizes the rounding buffers and the host pool
        state.optimizer.zero_grad()
        memo.reset_stats()
    reports = run()
    if memo is not None and managed:  # MEMO did take part: every managed forward went through it
        units = args.num_microbatches * args.pipe_sp_splits
        assert memo.stats["layers"] == len(managed) * units
        assert (memo.stats["recomputed_tokens"] > 0) == (memo.alpha < 1)
        assert memo.host_bytes == 0  # every host copy released by its backward
    loss = sum(r["lm loss"] for r in reports) if reports else None
    if loss is not None and pgs.size("dp_cp") > 1:  # each dp and cp rank reports its own tokens
        dist.all_reduce(loss, group=pgs.dp_cp)
    buffer = state.optimizer.buffer
    buffer.gather_flat(buffer.grad_data)  # sharded: each rank's reduced gradient shard to all
    grads = {}
    for model in unwrap(state.model):
        for name, p in model.named_parameters():
            grads[global_name(model, name)] = gather_tp(p.main_grad.clone(), p, pgs)
    return loss, grads, state.pipeline.stats


def gather_tp(grad, param, pgs):
    """The full gradient of a tensor-parallel parameter (inverse of megatron's strided split)."""
    tp = pgs.size("tp")
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return grad
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    shards = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(shards, grad.contiguous(), group=pgs.tp)
    pieces = [None] * (tp * stride)
    for r, shard in enumerate(shards):
        for j, piece in enumerate(torch.chunk(shard, stride, dim=dim)):
            pieces[r + j * tp] = piece
    return torch.cat(pieces, dim=dim)


class _LinkSpy:
    """torch.distributed as the pipeline's links see it, with each isend/irecv written down (the
    module itself is left alone: P2POp, which the ring uses, accepts only the real functions)."""

    def __init__(self):
        self.sent, self.received = [], []

    def __getattr__(self, name):
        return getattr(dist, name)

    def isend(self, tensor, dst=None, group=None):
        self.sent.append((dst, tuple(tensor.shape), tensor.dtype))
        return dist.isend(tensor, dst=dst, group=group)

    def irecv(self, tensor, src=None, group=None):
        self.received.append((src, tuple(tensor.shape), tensor.dtype))
        return dist.irecv(tensor, src=src, group=group)


@contextlib.contextmanager
def p2p_contract():
    """Every pipeline message's receive buffer has its send's shape and dtype, message by message
    on each link. gloo receives into a larger buffer or one of another dtype of equal bytes, where
    NCCL would hang or hand over wrong values; so the CPU tests check it."""
    from megatron.longseq.pipeline import p2p

    spy = _LinkSpy()
    p2p.dist = spy
    try:
        yield
    finally:
        p2p.dist = dist
    me, everyone = dist.get_rank(), [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (me, spy.sent))
    for rank, theirs in everyone:
        to_me = [(shape, dtype) for dst, shape, dtype in theirs if dst == me]
        assert to_me == [(shape, dtype) for src, shape, dtype in spy.received if src == rank], (rank, me)


def _check(extra, ref_path):
    world = dist.get_world_size()
    if "--sequence-parallel" in extra:
        sequence_parallel_on_host()
    args = tiny_args(f"{MODEL} {extra}", world_size=world)
    pgs = run_groups(args)
    # the trainer's seeding: under sequence parallelism the embedding's dropout (p = 0 here) draws
    # from the tensor-parallel stream, which must exist
    seed_everything(args.seed, pgs.index("tp"), torch.device("cpu"))
    with p2p_contract():
        loss, grads, _ = one_iteration(args, pgs)
    ref = torch.load(ref_path)
    if loss is not None:
        # fp32: segments and stages sum the same terms in another order; 7.0 +- a few ulps
        torch.testing.assert_close(loss, ref["loss"], atol=1e-4, rtol=1e-6)
    for name, grad in grads.items():
        # the tp test's bounds (test_gpt_model.py): reordered fp32 sums, ~1e-6 relative
        torch.testing.assert_close(grad, ref["grads"][name], atol=1e-6, rtol=1e-4, msg=f"{extra}: {name}")


def _reference(path):
    init_single_rank_world()
    args = tiny_args(MODEL)
    loss, grads, _ = one_iteration(args, grid_groups())
    torch.save({"loss": loss, "grads": grads}, path)


def _run_all(cases, ref_path):
    for extra in cases:
        _check(extra, ref_path)


CASES = {
    1: ["--pipe-sp-splits 4", "--pipe-sp-splits 4 --pipe-sp-strategy uniform_comp",
        "--pipe-sp-splits 4 --memo --memo-swap-fraction 0.5",
        # the segments' key/value cache filled with grad off: copies, not views of the fused qkv
        "--pipe-sp-splits 4 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2"],
    2: ["--pipeline-model-parallel-size 2",
        "--pipeline-model-parallel-size 2 --pipe-sp-splits 2 --pipe-sp-strategy uniform_comp",
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --pipe-sp-splits 2",
        "--pipeline-model-parallel-size 2 --pipe-sp-splits 4",
        # Megatron's spellings: 2 chunks per rank, chunk groups of 4 micro-batches (> pp 2; 4 of 1 sample)
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--microbatch-group-size-per-virtual-pipeline-stage 4 --pipe-sp-splits 2 --micro-batch-size 1",
        # the embedding and the loss counted in the split: 8 + 2 over 10 chunks, the first and
        # the last without a transformer layer
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 5 "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
        "--pipeline-model-parallel-size 2 --pipe-sp-splits 2 --memo --memo-swap-fraction 0.25",
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --pipe-sp-splits 2 "
        "--memo --memo-swap-fraction 0",
        "--context-parallel-size 2 --cp-comm-type a2a --memo --memo-swap-fraction 0.5",
        # the loss divided by the global token count, counted on the last stage and handed back
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --pipe-sp-splits 2 "
        "--calculate-per-token-loss",
        # uneven stages: 3 layers on the first, 5 on the last
        "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 --pipe-sp-splits 2",
        # Seq1F1B segments through Ulysses, attention recomputed (selective)
        "--context-parallel-size 2 --cp-comm-type a2a --pipe-sp-splits 2 --recompute-granularity selective"],
    4: ["--pipeline-model-parallel-size 4 --pipe-sp-splits 4",
        "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 --pipe-sp-splits 4 "
        "--pipe-sp-strategy uniform_comp",
        "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --pipe-sp-splits 2",
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --pipe-sp-splits 2",
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --pipe-sp-splits 2 --memo --memo-swap-fraction 1",
        "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 "
        "--memo --memo-swap-fraction 0.25",
        # data parallel 2 with overlapped buckets: the tied embedding's bucket (its own) reduced as
        # early as the others, then summed over the two stages on each rank's shard
        "--pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 40000 "
        "--micro-batch-size 1",
        "--pipeline-model-parallel-size 2 --overlap-grad-reduce --ddp-bucket-size 40000 --pipe-sp-splits 2",
        # context and data parallel together, the optimizer sharded in two instances of (dp, cp) pairs
        "--context-parallel-size 2 --use-distributed-optimizer --num-distributed-optimizer-instances 2 "
        "--overlap-grad-reduce --ddp-bucket-size 40000 --micro-batch-size 1",
        # Megatron's tp-pp-dp rank order with context parallelism and a pipeline
        "--use-tp-pp-dp-mapping --pipeline-model-parallel-size 2 --context-parallel-size 2 --pipe-sp-splits 2",
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --pipe-sp-splits 2 --calculate-per-token-loss",
        # Seq1F1B over a double ring laid context-first, and over 2D attention with Selective Checkpoint++
        "--context-parallel-size 4 --cp-inner-ring-size 2 --cp-placement context-first --pipe-sp-splits 2",
        "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --pipe-sp-splits 2 "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --selective-checkpoint-pp"],
}


# Sequence parallelism (tp 2): each rank's activations between the tensor-parallel regions hold
# s/2 tokens -- also Seq1F1B's segments sent between stages, and the context-parallel shares (ring
# and Ulysses).
SEQUENCE_PARALLEL = [
    "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce "
    "--ddp-bucket-size 40000 --micro-batch-size 1",
    "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --pipe-sp-splits 2 "
    "--pipe-sp-strategy uniform_comp --cross-entropy-chunk-tokens 20",
    "--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --cp-comm-type a2a",
    "--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --pipe-sp-splits 2",
    "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full --recompute-method block "
    "--recompute-num-layers 4 --micro-batch-size 1",
    "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
    "--num-layers-per-virtual-pipeline-stage 2 --pipe-sp-splits 2 --recompute-granularity selective",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "ref.pt"
    _reference(path)
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pipeline_layouts_equal_one_stage(world, reference):
    run_ranks(_run_all, world, CASES[world], reference)


def test_sequence_parallel_layouts_equal_one_stage(reference):
    run_ranks(_run_all, 4, SEQUENCE_PARALLEL, reference)


def _memory_follows_the_schedule(p):
    """Stage i holds w_i + 1 units at its peak: P - i micro-batches under 1F1B, (P - i - 1 + k)/k
    micro-batches' worth of segments under Seq1F1B (the last stage: one either way). Measured as
    the bytes autograd saves between each forward and its backward. Apart from them, the segment
    state's peak: once a micro-batch's last segment has gone backward, the fp32 dK/dV of its
    earlier segments for each of the stage's layers."""
    stage, peaks, held = dist.get_rank(), {}, {}
    for k in (1, 2, 4):
        args = tiny_args(f"{MODEL} --seq-length 128 --max-position-embeddings 128 "
                         f"--pipeline-model-parallel-size {p} --pipe-sp-splits {k} --global-batch-size 8", world_size=p)
        _, _, stats = one_iteration(args, grid_groups(pp=p))
        peaks[k], held[k] = stats["peak_activation_bytes"], stats["peak_segment_state_bytes"]
        earlier = args.seq_length * (k - 1) // k  # the tokens of segments 0..k-2 (equal segments)
        per_layer = 2 * args.micro_batch_size * args.num_query_groups * earlier * args.kv_channels * 4  # [2,b,g,s,d]
        assert held[k] == args.num_layers // p * per_layer, (k, held)
    for k in (2, 4):
        expected = (p - stage - 1 + k) / (k * (p - stage))
        # per-unit overheads not proportional to the segment's tokens stay well under 3%
        assert abs(peaks[k] / peaks[1] - expected) < 0.03, (stage, peaks)


@pytest.mark.parametrize("p", [2, 4])
def test_measured_peak_activation_falls_with_splits_as_the_schedule_says(p):
    run_ranks(_memory_follows_the_schedule, p, p)


def _outputs_let_go():
    """A stage keeps no sent output to its backward: every earlier forward's output object is gone
    when the next forward starts (the send's own buffer aside, which the link frees when the send is
    done), and the gradients that flow back through the kept edges are checked by the layout test."""
    import pretrain_gpt

    args = tiny_args(f"{MODEL} --pipeline-model-parallel-size 2 --pipe-sp-splits 2 --global-batch-size 8", world_size=2)
    pgs = grid_groups(pp=2)
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    outputs = []

    def step(data_iterator, model):
        assert all(ref() is None for ref in outputs), "a sent output outlived its forward"
        output, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        outputs.append(weakref.ref(output))
        return output, loss_func

    forward_backward_seq1f1b(forward_step_func=step, data_iterator=random_batches(args, pgs, seed=0),
                             model=state.model, num_microbatches=args.num_microbatches,
                             micro_batch_size=args.micro_batch_size, p2p_communicator=state.pipeline)
    assert len(outputs) == args.num_microbatches * 2


def test_a_stage_keeps_no_sent_output_to_its_backward():
    run_ranks(_outputs_let_go, 2)
