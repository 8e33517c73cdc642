"""GPU-only paths of the trainer, caught on CPU: collectives of host values on the backend's device,
the planned allocator installed before CUDA starts, megatron-core's fusions on GPU (and the
gradient buffer's half of the fused weight-gradient protocol), pipeline receives posted ahead, and
the activation meter off unless the log reports it."""
import dataclasses
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.longseq import collectives
from megatron.longseq.pipeline import p2p
from megatron.training import initialize, memo_setup
from megatron.training.distributed import GradBuffer
from megatron.training.model import transformer_config
from megatron.training.timers import Timers
from megatron.training.reporting import pipeline_memory_line
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks
from tests.unit_tests.model_utils import tiny_args


# ---- host values -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, device", [("nccl", "cuda:3"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu")])
def test_host_values_go_where_the_backend_reads(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.backend_device(object()) == torch.device(device)


def _collectives_of_host_values():
    """The trainer's collectives of host values (MEMO's agreement, per-stage activation peaks,
    timer min/max) all go through the helper; each is checked to give the right numbers."""
    pgs = grid_groups(pp=2)
    callers = []
    for name in ("all_reduce", "all_gather"):
        real = getattr(dist, name)

        def spy(*a, _real=real, **k):
            callers.append(sys._getframe(1).f_globals["__name__"])
            return _real(*a, **k)
        setattr(dist, name, spy)
    rank = dist.get_rank()
    assert memo_setup._agree(float(rank), dist.ReduceOp.MAX, None) == 1.0
    line = pipeline_memory_line(SimpleNamespace(stats={"peak_activation_bytes": (rank + 1) * 2**20}), pgs)
    assert line.endswith("(MB): 1.0 2.0")
    stats = {"peak_activation_bytes": 2**20, "peak_segment_state_bytes": rank * 2**21}  # Seq1F1B's own state
    assert pipeline_memory_line(SimpleNamespace(stats=stats), pgs).endswith(
        "(MB): 1.0 1.0; Seq1F1B cross-segment state (MB): 0.0 2.0")
    timers = Timers(1, cuda=False)
    timers("x", 0).elapsed_s = 0.001 * (rank + 1)
    assert timers.min_max(["x"], reset=False)["x"] == pytest.approx((1.0, 2.0))
    timers("y", 0).elapsed_s = 0.01 * (rank + 1)
    each = timers.per_rank(["x", "y"])  # in rank order
    assert (each["x"], each["y"]) == (pytest.approx([1.0, 2.0]), pytest.approx([10.0, 20.0]))
    assert callers and set(callers) == {"megatron.longseq.collectives"}, callers


def test_collectives_of_host_values_go_through_the_helper():
    run_ranks(_collectives_of_host_values, 2)


def test_a_stage_without_losses_makes_its_token_count_on_the_device(monkeypatch):
    """--calculate-per-token-loss on a pipeline: the first of two stages computes no loss, and the
    count it hands to the gradients' finalisation (broadcast from the last stage) is made on the
    model's device -- a host value copied there blocks until the backward is done. The stage runs
    on the meta device, as a GPU stands in for here."""
    from megatron.longseq.pipeline.seq1f1b import Pipeline, forward_backward_seq1f1b
    from tests.unit_tests.pipeline.test_nccl_queues import HIDDEN, MBS, _Chunk, _Recorder, _step

    recorder = _Recorder()
    monkeypatch.setattr(p2p.dist, "isend", recorder.isend)
    monkeypatch.setattr(p2p.dist, "irecv", recorder.irecv)
    chunk, handed = _Chunk(recorder.program).to("meta"), []
    chunk.config.calculate_per_token_loss = True
    chunk.config.finalize_model_grads_func = lambda chunks, tokens: handed.append(tokens)
    links = {(purpose, src, dst): purpose for purpose in ("act", "grad") for src in (0, 1) for dst in (0, 1)}
    forward_backward_seq1f1b(forward_step_func=_step, data_iterator=iter([{"tokens": torch.zeros(MBS, 4)}] * 2),
                             model=[chunk], num_microbatches=2, micro_batch_size=MBS,
                             p2p_communicator=Pipeline(2, 0, 1, [4], HIDDEN, links, [0, 1]))
    (tokens,) = handed
    assert tokens.device.type == "meta" and tokens.dtype == torch.int64 and tokens.dim() == 0


def test_pipeline_receives_take_the_configs_pipeline_dtype(monkeypatch):
    """Receive buffers are allocated in config.pipeline_dtype, as megatron-core's p2p allocates
    them, not in the dtype of whichever parameter comes first: a chunk whose first parameter
    differs from what the previous stage sends (kept in fp32 here) must still receive bf16. Stage 1
    of 2, both receives (activations, gradients) recorded, on the meta device."""
    from megatron.longseq.pipeline.seq1f1b import Pipeline, forward_backward_seq1f1b
    from tests.unit_tests.pipeline.test_nccl_queues import HIDDEN, MBS, _Chunk, _Recorder, _step

    recorder, dtypes = _Recorder(), []

    def irecv(buf, src, group):
        dtypes.append(buf.dtype)
        return recorder.irecv(buf, src, group)
    monkeypatch.setattr(p2p.dist, "isend", recorder.isend)
    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    chunk = _Chunk(recorder.program).to("meta")
    chunk.config.pipeline_dtype = torch.bfloat16
    links = {(purpose, src, dst): purpose for purpose in ("act", "grad") for src in (0, 1) for dst in (0, 1)}
    forward_backward_seq1f1b(forward_step_func=_step, data_iterator=iter([{"tokens": torch.zeros(MBS, 4)}] * 2),
                             model=[chunk], num_microbatches=2, micro_batch_size=MBS,
                             p2p_communicator=Pipeline(2, 1, 1, [4], HIDDEN, links, [0, 1]))
    assert dtypes and set(dtypes) == {torch.bfloat16}, dtypes


# ---- process start-up ------------------------------------------------------------------------------

def _two_ranks(monkeypatch):
    """Rank 0 of 2 as torchrun starts it (the rendezvous variables set)."""
    monkeypatch.setattr(initialize, "launch_env", lambda: initialize.LaunchEnv(0, 2, 0))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")

def test_planned_allocator_is_installed_before_cuda_starts(monkeypatch):
    """torch refuses to swap an initialised allocator, and set_device initialises CUDA."""
    from megatron.longseq.memo import allocator

    calls = []
    monkeypatch.setattr(allocator, "install", lambda: calls.append("install"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append("set_device"))

    class Reached(Exception):
        pass

    def init_process_group(**kwargs):
        raise Reached
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    args = SimpleNamespace(device_type="cuda", memo=True, memo_allocator="planned", deterministic_mode=False,
                           distributed_backend="nccl", distributed_timeout_minutes=10)
    _two_ranks(monkeypatch)
    with pytest.raises(Reached):
        initialize.initialize_distributed(args)
    assert calls == ["install", "set_device"]


def test_the_worlds_first_collective_is_ours_on_the_backends_device(monkeypatch):
    """Right after the world is made, before any group or megatron-core's dataset barrier (whose
    device NCCL would otherwise guess: global rank mod the visible GPUs), one all-reduce through
    the helper that puts it on the backend's device."""
    calls = []

    class Reached(Exception):
        pass

    def world_collective(values, op=None, group=None):
        calls.append(("all_reduce_values", group))
        raise Reached
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append("init_process_group"))
    monkeypatch.setattr(initialize, "all_reduce_values", world_collective)
    monkeypatch.setattr(initialize, "build_process_groups", lambda *a: calls.append("groups"))
    args = SimpleNamespace(device_type="cpu", deterministic_mode=False, distributed_backend="gloo",
                           distributed_timeout_minutes=10)
    _two_ranks(monkeypatch)
    with pytest.raises(Reached):
        initialize.initialize_distributed(args)
    assert calls == ["init_process_group", ("all_reduce_values", None)]


def _lone_communicators_made_once_each():
    pgs = grid_groups(tp=2)  # 2 ranks: tp is the only axis with two
    reduced, real = [], dist.all_reduce
    dist.all_reduce = lambda t, group=None, **kw: (reduced.append(group), real(t, group=group, **kw))[1]
    initialize.create_lone_communicators(pgs, torch.device("cpu"))
    dist.all_reduce = real
    lone = {id(g) for g in pgs.groups.values() if g is not None and dist.get_world_size(g) == 1}
    assert sorted(map(id, reduced)) == sorted(lone) and len(lone) >= 1
    assert all(dist.get_world_size(g) == 1 for g in reduced) and pgs.tp not in reduced


def test_groups_of_one_rank_get_their_communicator_before_the_model(monkeypatch):
    """NCCL makes a communicator at a group's first collective: for a group of one rank that is
    megatron-core's loss all-reduce over tp = 1, at the first forward's memory peak. Every distinct
    group of one rank gets one collective at set-up (CUDA only), groups of several none (no
    cross-rank order to keep)."""
    run_ranks(_lone_communicators_made_once_each, 2)
    calls, pgs = [], SimpleNamespace(index=lambda axis: 0)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(initialize, "all_reduce_values", lambda *a, **k: None)
    monkeypatch.setattr(initialize, "build_process_groups", lambda *a: calls.append("groups") or pgs)
    monkeypatch.setattr(initialize, "create_lone_communicators", lambda p, device: calls.append((p, device.type)))
    monkeypatch.setattr(initialize, "_claim_gpu", lambda args, env: None)
    monkeypatch.setattr(initialize, "seed_everything", lambda *a: calls.append("seeds"))
    monkeypatch.setattr(initialize, "device_of", lambda args: torch.device(args.device_type))
    _two_ranks(monkeypatch)
    monkeypatch.setattr(initialize, "RankGrid", lambda **kw: None)
    monkeypatch.setattr(initialize, "rank_order", lambda args: None)
    for device_type in ("cuda", "cpu"):
        args = SimpleNamespace(device_type=device_type, deterministic_mode=False, distributed_backend="gloo",
                               distributed_timeout_minutes=10, tensor_model_parallel_size=1,
                               pipeline_model_parallel_size=1, context_parallel_size=1, head_parallel_size=1,
                               cp_inner_ring_size=None, cp_placement="head-first",
                               num_distributed_optimizer_instances=1, virtual_pipeline_chunks=1, seed=1)
        calls.clear()
        initialize.initialize_distributed(args)
        made = [(pgs, "cuda")] if device_type == "cuda" else []
        assert calls == ["groups", *made, "seeds"], calls  # after the groups, before anything else


@pytest.mark.parametrize("launcher, local_rank, visible, index, per_task", [
    ("torchrun", 3, 8, 3, None), ("srun", 3, 1, 0, None), ("srun", 3, 8, 3, None), ("torchrun", 0, 1, 0, None),
    ("torchrun", 1, 1, None, None), ("torchrun", 4, 4, None, None), ("srun", 8, 4, None, None),
    ("srun", 2, 2, 0, "2"), ("srun", 3, 2, 1, "2"), ("torchrun", 2, 2, None, "2"),
])
def test_each_rank_gets_a_gpu_of_its_own_or_a_one_line_error(monkeypatch, launcher, local_rank, visible, index,
                                                             per_task):
    """One GPU per rank: the local rank's, or one of those a Slurm task sees of its own (one, or
    srun --gpus-per-task). More local ranks than GPUs (CUDA_VISIBLE_DEVICES narrower than
    --nproc-per-node, say) used to wrap around onto a GPU another rank holds: NCCL's "Duplicate
    GPU detected" at the first collective."""
    from megatron.training.arguments import ArgsError

    monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    if per_task:
        monkeypatch.setenv("SLURM_GPUS_PER_TASK", per_task)
    env = initialize.LaunchEnv(local_rank, 16, local_rank, launcher)
    if index is None:
        with pytest.raises(ArgsError, match=f"local rank {local_rank} but {visible} GPU"):
            initialize.gpu_index(env, visible)
    else:
        assert initialize.gpu_index(env, visible) == index


@pytest.mark.parametrize("environ, first", [
    ({"RANK": "0", "SLURM_PROCID": "1"}, True), ({"RANK": "8", "SLURM_PROCID": "0"}, False),
    ({"SLURM_PROCID": "0"}, True), ({"SLURM_PROCID": "3"}, False), ({}, True),
    # no process can be rank 0: each reports (it used to be silence and exit 2 after 30 s)
    ({"RANK": "x", "WORLD_SIZE": "1"}, True), ({"RANK": "3", "WORLD_SIZE": "2"}, True),
    ({"RANK": "1", "WORLD_SIZE": "2"}, False), ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, True),
])
def test_the_launchers_rank_0_reports_a_bad_command_line(monkeypatch, environ, first):
    """Under srun + torchrun, torchrun numbers the nodes by hostname, so its rank 0 may run on
    Slurm's task 1: requiring both made no process print the one-line error."""
    from megatron.training import bad_input

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert bad_input._is_first_process() == first


# ---- memory lines ----------------------------------------------------------------------------------

@pytest.mark.parametrize("planned", [False, True])
def test_memory_peaks_start_with_training(monkeypatch, planned):
    """The memory line's maxima are the training iterations': set-up (MEMO's profile and trace
    iterations among it) would otherwise set torch's peaks, and fragmentation read from them."""
    from megatron.longseq.memo import allocator
    from megatron.training import metrics

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("peaks"))
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda: calls.append("retries"))
    arena = SimpleNamespace(reset_peak=lambda: calls.append("arena peaks"))
    monkeypatch.setattr(allocator, "INSTALLED", arena if planned else None)
    metrics.reset_memory_peaks()
    assert calls == (["arena peaks"] if planned else ["peaks", "retries"])


# ---- fusions --------------------------------------------------------------------------------------

FUSED = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "cross_entropy_loss_fusion")


def _on_gpu(extra=""):
    args = tiny_args(extra)
    args.device_type = "cuda"  # what validation says on a GPU machine
    return args


def test_megatron_core_fusions_on_gpu_and_off_on_cpu(monkeypatch):
    cpu = transformer_config(tiny_args("--bf16 --swiglu"))
    assert not any(getattr(cpu, f) for f in FUSED + ("gradient_accumulation_fusion",))
    gpu = transformer_config(_on_gpu("--bf16 --swiglu"))
    assert all(getattr(gpu, f) for f in FUSED)
    # apex's fused_weight_gradient_mlp_cuda is not installed here: without it, or without TE, off
    assert not gpu.gradient_accumulation_fusion
    # nor with Transformer Engine alone: GPTModel's output layer is megatron-core's linear, which
    # refuses the fusion without apex
    te = _on_gpu("--bf16")
    te.transformer_impl = "transformer_engine"  # validation refuses it on a machine without CUDA
    assert not transformer_config(te).gradient_accumulation_fusion
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", ModuleType("fused_weight_gradient_mlp_cuda"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert transformer_config(_on_gpu("--bf16")).gradient_accumulation_fusion
    assert not transformer_config(_on_gpu("--bf16 --no-gradient-accumulation-fusion")).gradient_accumulation_fusion


def test_fusion_flags_and_the_cases_megatron_core_refuses():
    off = transformer_config(_on_gpu("--bf16 --swiglu --no-bias-swiglu-fusion --no-bias-dropout-fusion "
                                     "--no-masked-softmax-fusion --no-cross-entropy-loss-fusion"))
    assert not any(getattr(off, f) for f in FUSED)
    assert not transformer_config(_on_gpu("--bf16 --disable-bias-linear")).bias_activation_fusion  # ungated GELU
    assert not transformer_config(_on_gpu("")).cross_entropy_loss_fusion  # fp32: bf16 logit gradients
    memo = transformer_config(_on_gpu("--bf16 --swiglu --memo --num-layers 4"))
    assert not memo.bias_activation_fusion and not memo.bias_dropout_fusion and memo.cross_entropy_loss_fusion
    planned = _on_gpu("--bf16 --swiglu --memo --num-layers 4")
    planned.memo_allocator = "planned"  # validation refuses it on a machine without CUDA
    assert not transformer_config(planned).cross_entropy_loss_fusion  # compiled: may ask the allocator for stats


def test_fused_weight_gradients_accumulate_once_and_release_their_bucket(monkeypatch):
    """megatron-core's own linear with gradient_accumulation_fusion=True (its CUDA extension
    replaced by the same GEMM in torch): the fused path writes main_grad and hands a dummy .grad;
    the buffer must not add that, and its overlap hook must still release the bucket."""
    from megatron.core.tensor_parallel import layers

    init_single_rank_world()
    ext = ModuleType("fused_weight_gradient_mlp_cuda")
    ext.wgrad_gemm_accum_fp32 = lambda x, g, main: main.add_(g.t().float() @ x.float())
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", ext, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where the dummy .grad goes
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5))
    want = torch.zeros(6, 5)
    buffer = GradBuffer([weight], dist.group.WORLD, shard=False, overlap=True)
    buffer.zero_grad()
    for i in range(2):  # two micro-batches accumulate; the last one's backward releases the bucket
        x = torch.randn(3, 4, 5)
        out = layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, None, True, False, False)
        with buffer.no_sync() if i == 0 else torch.enable_grad():
            out.square().sum().backward()
        want += (2 * out.detach()).reshape(-1, 6).t() @ x.reshape(-1, 5)
        assert weight.grad is None and weight.grad_added_to_main_grad
    torch.testing.assert_close(weight.main_grad, want, atol=1e-4, rtol=1e-5)
    assert not buffer.buckets[0].pending  # the hook ran: the bucket was released for reduction
    buffer.zero_grad()
    assert not weight.grad_added_to_main_grad



def _fused_wgrad_on_cpu(monkeypatch):
    """megatron-core's gradient-accumulation fusion with its CUDA extension replaced by the same GEMM."""
    from megatron.core.tensor_parallel import layers

    ext = ModuleType("fused_weight_gradient_mlp_cuda")
    ext.wgrad_gemm_accum_fp32 = lambda x, g, main: main.add_(g.t().float() @ x.float())
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", ext, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where the dummy .grad goes


def _main_grads(args, fused: bool, monkeypatch) -> dict:
    from megatron.training import model as model_module
    from tests.unit_tests.model_utils import lm_loss, tiny_gpt

    real = model_module.transformer_config
    monkeypatch.setattr(model_module, "transformer_config",
                        lambda a: dataclasses.replace(real(a), gradient_accumulation_fusion=fused))
    gpt = tiny_gpt(args, grid_groups())
    buffer = GradBuffer(list(gpt.parameters()), dist.group.WORLD, shard=False, overlap=False)
    buffer.zero_grad()
    lm_loss(gpt, args).backward()
    buffer.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in gpt.named_parameters()}


def test_fused_weight_gradients_keep_the_tied_embeddings_lookup_share(monkeypatch):
    """One stage, tied embeddings: the output layer's fused GEMM writes its share into main_grad and
    hands back a zero dummy .grad (megatron-core's zero_out_wgrad), to which autograd adds the
    embedding lookup's share. That sum must reach main_grad: every gradient equals the unfused one."""
    init_single_rank_world()
    args = tiny_args()
    _fused_wgrad_on_cpu(monkeypatch)
    fused = _main_grads(args, True, monkeypatch)
    plain = _main_grads(args, False, monkeypatch)
    assert "embedding.word_embeddings.weight" in fused and "output_layer.weight" not in fused  # tied
    for name, grad in plain.items():
        # fp32 GEMMs of the same products, summed in another order: a few ulps of the largest entry
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-6, msg=name)

# ---- pipeline --------------------------------------------------------------------------------------

def _receives_posted_ahead():
    """Stage 1's inbox posts the receive of the first expected message when it is made, of the
    next one as soon as it hands one out -- but never before the operation its receive point
    names; messages arrive in the sender's order."""
    group, me = dist.group.WORLD, dist.get_rank()
    keys = [(0, m, 0) for m in range(3)]
    if me == 0:
        box = p2p.Outbox(group, 1, "act")
        for m in range(3):
            box.send(torch.full((2,), float(m)))
        box.flush()
        return
    posted = []
    irecv = dist.irecv
    dist.irecv = lambda *a, **k: (posted.append(a[0].shape), irecv(*a, **k))[1]
    points = zip(keys, [0, 0, 2])  # the third may be received from this rank's operation 2 on
    inbox = p2p.Inbox(group, 0, iter(points), lambda key: (2,), torch.float32, torch.device("cpu"))
    assert len(posted) == 1  # before anything was asked for
    assert inbox.get(keys[1])[0].item() == 1.0  # an early arrival (m = 0) is kept
    assert len(posted) == 2 and inbox.posted is None  # the third waits for its operation
    inbox.advance(1)
    assert inbox.posted is None
    inbox.advance(2)
    assert len(posted) == 3 and inbox.posted[0] == keys[2]
    assert inbox.get(keys[0])[0].item() == 0.0 and inbox.get(keys[2])[0].item() == 2.0
    assert inbox.posted is None


def test_pipeline_receives_are_posted_ahead():
    run_ranks(_receives_posted_ahead, 2)


def test_activation_meter_hooks_only_when_the_log_reports_them(monkeypatch):
    from megatron.longseq.pipeline.seq1f1b import Pipeline, forward_backward_seq1f1b

    init_single_rank_world()
    model = torch.nn.Linear(4, 4)
    model.set_input_tensor = lambda t: None
    model.config = SimpleNamespace(no_sync_func=None, finalize_model_grads_func=None, calculate_per_token_loss=False)
    installed = []
    hooks = torch.autograd.graph.saved_tensors_hooks
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", lambda *a: (installed.append(a), hooks(*a))[1])

    def step(data, chunk):
        out = chunk(next(data)["x"])
        return out, lambda o: (o.square().mean(), {"loss": o.detach().sum()})

    for measure in (False, True, True):
        pipe = Pipeline(1, 0, 1, [4], 4, {}, [0], measure_activations=measure)
        data = iter([{"x": torch.randn(1, 4, 4)} for _ in range(2)])
        forward_backward_seq1f1b(forward_step_func=step, data_iterator=data, model=[model], num_microbatches=2,
                                 micro_batch_size=1, p2p_communicator=pipe)
        assert (pipe.stats["peak_activation_bytes"] > 0) == measure
    # none without measuring; then one per forward, the very same hook objects every iteration
    # (torch.compile guards on their identity)
    assert len(installed) == 4 and len(set(installed)) == 1


# ---- sequence-parallel norm gradients ----------------------------------------------------------

def _sequence_parallel_grads_in_one_all_reduce():
    from megatron.training.training import sum_sequence_parallel_grads

    pgs = grid_groups(tp=2)
    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 4, 2)]
    for i, p in enumerate(params):
        p.sequence_parallel = i != 2  # one weight the tp ranks share whole (its gradient is the same)
        p.main_grad = torch.arange(p.numel(), dtype=torch.float32) + 10 * i + 100 * rank
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **kw: calls.append(a[0].numel()) or real(*a, **kw)
    try:
        sum_sequence_parallel_grads(params, pgs.tp)
    finally:
        dist.all_reduce = real
    assert calls == [3 + 5 + 2]  # one collective for every tagged gradient
    for i, p in enumerate(params):
        own = torch.arange(p.numel(), dtype=torch.float32) + 10 * i
        want = own + 100 * rank if i == 2 else 2 * own + 100  # ranks 0 and 1 summed
        assert torch.equal(p.main_grad, want), (i, p.main_grad)


def test_sequence_parallel_norm_gradients_are_summed_in_one_all_reduce():
    run_ranks(_sequence_parallel_grads_in_one_all_reduce, 2)


# What the tests' fork server does at start (tests/unit_tests/dist_utils.py: PRELOAD), with a CUDA
# build's availability check faked in for the imports: which CUDA runtime calls it makes.
_FORK_SERVER = """
import importlib, torch
import torch._dynamo  # its import reads _is_compiled (below faked) and would want CUDA's symbols
calls, real, compiled = [], torch.cuda.is_available, torch.cuda._is_compiled
torch._C._cuda_getDeviceCount = lambda: (calls.append("cudaGetDeviceCount"), 1)[1]  # poisons fork
torch.cuda._device_count_nvml = lambda: 1  # NVML finds one device

def as_if_built_with_cuda():
    torch.cuda._is_compiled = lambda: True
    try:
        return real()
    finally:
        torch.cuda._is_compiled = compiled

torch.cuda.is_available = as_if_built_with_cuda
from tests.unit_tests.dist_utils import PRELOAD
for name in PRELOAD:
    importlib.import_module(name)
print("CUDA runtime calls:", calls)
"""


def test_the_rank_fork_server_leaves_cuda_usable_in_its_ranks():
    """megatron-core's import asks torch.cuda.is_available(). On a CUDA build that calls
    cudaGetDeviceCount -- after which torch refuses CUDA in every forked process, the ranks of
    every multi-rank test -- unless PYTORCH_NVML_BASED_CUDA_CHECK=1 (conftest.py) sends it to NVML."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    without = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    for env, want in ((without, "['cudaGetDeviceCount']"), (dict(os.environ), "[]")):
        out = subprocess.run([sys.executable, "-c", _FORK_SERVER], env=env, cwd=root, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0 and out.stdout.strip().endswith(f"CUDA runtime calls: {want}"), out.stderr[-2000:]
