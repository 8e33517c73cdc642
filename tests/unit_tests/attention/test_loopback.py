"""Every rank of a context-parallel group in processes on one device, joined by loopback groups
(attention/loopback.py): ring, double ring, Ulysses and 2D attention against float64 attention
over the whole sequence. On CPU it checks the harness itself; on a GPU the kernels see the
slices, strides and dtypes of a multi-GPU run: fp32 against float64, bf16 against the fp32 run."""
import multiprocessing

import pytest
import torch

from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.core import AttentionInputs, LongSeqCoreAttention
from megatron.longseq.attention.documents import lognormal_starts
from megatron.longseq.attention.kernel_choice import select_kernel
from megatron.longseq.attention.loopback import LoopbackGroup, Mailbox, RankThreads, run_group
from megatron.longseq.attention.placement import local_token_indices
from megatron.longseq.parallel_state import RankGrid
from tests.unit_tests.attention.contract_kernel import ContractKernel, install_flash_varlen_stand_ins
from tests.unit_tests.attention.test_context_parallel import full_problem
from tests.unit_tests.attention.test_core_attention import config
from tests.unit_tests.attention.test_documents import document_problem, per_sample
from tests.unit_tests.dist_utils import PRELOAD
from tools.benchmark_attention import counted

CUDA = torch.cuda.is_available()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (hp, ring, inner ring, placement, heads, kv groups): a ring, a double ring, Ulysses with KV
# replication (1 group over 2 head-parallel ranks), 2D head-first, 2D context-first on a double ring
MODES = {
    "ring2": (1, 2, None, "head-first", 4, 2),
    "double-ring4": (1, 4, 2, "context-first", 4, 2),
    "ulysses2-kv-replicated": (2, 1, None, "head-first", 4, 1),
    "2d-2x2": (2, 2, None, "head-first", 4, 2),
    "2d-2x4-double-ring": (2, 4, 2, "context-first", 4, 2),  # 8 processes: on a GPU only
}


def grid_of(mode: str) -> RankGrid:
    hp, ring, inner, placement, _, _ = MODES[mode]
    return RankGrid(world_size=hp * ring, cp=hp * ring, hp=hp, inner_ring=inner, placement=placement)


def attend(pgs, mode, device, dtype, shape):
    """This rank's share of the whole problem through LongSeqCoreAttention: (indices, out, dq, dk,
    dv); the reference is the parent's, made once. On CPU through the contract-checked kernel (a
    call a CUDA kernel would misread raises); on a GPU through the kernel `auto` picks there."""
    *_, heads, groups = MODES[mode]
    s, b, d = shape
    (q, k, v, dout, positions), _ = full_problem(heads, groups, s=s, b=b, d=d,
                                                 with_reference=False)
    cp = ContextParallel.from_process_groups(pgs)
    idx = local_token_indices(s, cp.hp_size, cp.ring.size, cp.hp_index, cp.ring.ring_index)
    attn = LongSeqCoreAttention(config(heads, groups, d=d), layer_number=1, attn_mask_type=None, cp=cp).to(device)
    if device == "cpu":
        attn._kernel = ContractKernel()
    leaves = [x[idx].to(device, DTYPES[dtype]).requires_grad_() for x in (q, k, v)]
    out = attn(*leaves, None, packed_seq_params=AttentionInputs(position_ids=positions[:, idx].to(device)))
    out.backward(dout[idx].to(device, DTYPES[dtype]))
    return idx, out.detach(), *(x.grad for x in leaves), attn.kernel_ran


def start_method(device: str) -> str:
    """Ranks that use CUDA are spawned: a forked rank of a process that asked the CUDA runtime
    anything cannot use CUDA, and whether the fork server's imports did depends on NVML being
    found (conftest.py). On CPU the preloaded fork server saves each rank seconds of imports."""
    return "spawn" if device != "cpu" else "forkserver"


def gathered(mode, device, dtype, shape):
    """The whole sequence's (out, dq, dk, dv) put together from every rank's share, and the
    kernel the ranks ran."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ranks = run_group(attend, grid_of(mode), mode, device, dtype, shape, start_method=start_method(device))
    whole = []
    for i in range(4):
        parts = [r[1 + i] for r in ranks]
        t = torch.empty(shape[0], *parts[0].shape[1:], dtype=parts[0].dtype)
        for r, part in zip(ranks, parts):
            t[r[0]] = part
        whole.append(t)
    return whole, {r[-1] for r in ranks}


def reference(mode, shape):
    *_, heads, groups = MODES[mode]
    s, b, d = shape
    _, (out, dq, dk, dv) = full_problem(heads, groups, s=s, b=b, d=d)
    return out, dq, dk, dv


# fp32 kernels and fp32 merges on O(1) values; RoPE angles up to s rad (~4e-6 rounding at 32,
# ~6e-5 at 512): the bounds of test_context_parallel.py, at the GPU's length with the angle's share
ATOL = {32: (1e-4, 2e-4), 512: (2e-4, 5e-4)}


def check_fp32(mode, device, shape):
    got, kernels = gathered(mode, device, "fp32", shape)
    atol_out, atol_grad = ATOL[shape[0]]
    for i, (g, want) in enumerate(zip(got, reference(mode, shape))):
        torch.testing.assert_close(g.double(), want, atol=atol_out if i == 0 else atol_grad, rtol=0,
                                   msg=lambda m: f"{mode} {['out', 'dq', 'dk', 'dv'][i]} ({kernels}): {m}")
    return got


CPU_MODES = ["ring2", "double-ring4", "ulysses2-kv-replicated", "2d-2x2"]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_loopback_ranks_match_whole_sequence_attention_on_cpu(mode):
    check_fp32(mode, "cpu", (32, 2, 8))


GPU_SHAPE = (512, 2, 64)  # 64 or 128 tokens a chunk: the GPU kernels' tile edges inside a block


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", list(MODES))
def test_loopback_ranks_on_the_gpu_fp32_and_bf16(mode):
    """fp32 against float64, then bf16 against that fp32 run: bf16 inputs carry 2^-9 relative
    rounding and the kernel's outputs another 2^-9; on O(1) outputs and gradients summed over up
    to 512 keys, 3e-2 absolute is a few bf16 ulps of the largest values."""
    fp32 = check_fp32(mode, "cuda", GPU_SHAPE)
    bf16, kernels = gathered(mode, "cuda", "bf16", GPU_SHAPE)
    for i, (g, want) in enumerate(zip(bf16, fp32)):
        torch.testing.assert_close(g.float(), want, atol=3e-2, rtol=2e-2,
                                   msg=lambda m: f"{mode} bf16 {['out', 'dq', 'dk', 'dv'][i]} ({kernels}): {m}")


# ---- packed documents (--reset-attention-mask): on a GPU the varlen kernel path ------------------

def packed_starts(s: int, b: int, mean: float) -> torch.Tensor:
    """[b, s] document starts: log-normal lengths of `mean` tokens (sigma 1), as packed data."""
    g = torch.Generator().manual_seed(1)
    return torch.stack([lognormal_starts(s, mean, 1.0, g) for _ in range(b)])


def attend_documents(pgs, mode, device, dtype, starts, d):
    """This rank's share of packed samples: (per-sample indices, out, dq, dk, dv, varlen calls)."""
    *_, heads, groups = MODES[mode]
    (q, k, v, dout, positions), _ = document_problem(heads, groups, starts, d=d, with_reference=False)
    cp = ContextParallel.from_process_groups(pgs)
    idx = [local_token_indices(starts.shape[1], cp.hp_size, cp.ring.size, cp.hp_index, cp.ring.ring_index,
                               starts[b]) for b in range(starts.shape[0])]
    attn = LongSeqCoreAttention(config(heads, groups, d=d), layer_number=1, attn_mask_type=None, cp=cp).to(device)
    if device == "cpu":  # the varlen entry as torch's CUDA flash kernel is called (this rank's process only)
        install_flash_varlen_stand_ins(setattr)
    attn._kernel = kernel = ContractKernel(varlen=True) if device == "cpu" else select_kernel(
        "auto", torch.device(device), DTYPES[dtype], d)
    calls = counted(kernel)
    leaves = [per_sample(x, idx, 0).to(device, DTYPES[dtype]).requires_grad_() for x in (q, k, v)]
    params = AttentionInputs(position_ids=per_sample(positions.t(), idx, 0).t().to(device), document_starts=starts)
    out = attn(*leaves, None, packed_seq_params=params)
    out.backward(per_sample(dout, idx, 0).to(device, DTYPES[dtype]))
    return idx, out.detach(), *(x.grad for x in leaves), calls["varlen"]


def check_documents(mode, device, dtype, starts, d, atol_out, atol_grad, rtol=0.0):
    """Every rank's share against the float64 reference under the document mask; the varlen calls."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ranks = run_group(attend_documents, grid_of(mode), mode, device, dtype, starts, d,
                      start_method=start_method(device))
    *_, heads, groups = MODES[mode]
    _, want = document_problem(heads, groups, starts, d=d)
    for idx, *got, _ in ranks:
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g.double(), per_sample(w, idx, 0), atol=atol_out if i == 0 else atol_grad,
                                       rtol=rtol, msg=lambda m: f"{mode} documents {['out', 'dq', 'dk', 'dv'][i]}: {m}")
    return sum(r[-1] for r in ranks)


@pytest.mark.parametrize("mode", ["ring2", "2d-2x2"])
def test_loopback_ranks_attend_packed_documents_on_cpu(mode):
    """Through the varlen entry, as on the GPU (stand-ins of torch's flash varlen ops)."""
    assert check_documents(mode, "cpu", "fp32", packed_starts(32, 2, 6.0), 8, *ATOL[32]) > 0, "no varlen call"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", list(MODES))
def test_loopback_ranks_attend_packed_documents_on_the_gpu_through_varlen(mode):
    """bf16 (the varlen entry takes half precision) against float64 under the document mask: bf16
    rounding of inputs and outputs (2^-9 relative each), 3e-2 absolute on O(1) values and 2e-2
    relative on gradients summed over long documents; every rank attends through the varlen kernel."""
    calls = check_documents(mode, "cuda", "bf16", packed_starts(2048, 2, 256.0), 64, 3e-2, 3e-2, rtol=2e-2)
    assert calls > 0, "no varlen kernel call"


def _to_self():
    """A group of one rank sending to itself, over the threads' transport."""
    import queue

    return LoopbackGroup("ring", [0], Mailbox(0, [queue.Queue()], threads=True))


def test_the_transport_holds_calls_to_what_nccl_needs():
    """A copy would deliver all of these; NCCL would hang or hand over other values."""
    group, t = _to_self(), torch.arange(6.0)
    for r in group.batch([(t, 0)], [(torch.empty(6), 0)]):
        r.wait()  # as it should be
    send, recv = group.batch([(t, 0)], [(torch.empty(6), 0)])
    t.add_(1)  # NCCL may still be reading it
    with pytest.raises(RuntimeError, match="written before its request was waited for"):
        send.wait()
    recv.wait()
    for wrong in (torch.empty(6, dtype=torch.float64), torch.empty(7), torch.empty(12)[::2]):
        group.batch([(t, 0)], [])[0].wait()
        (recv,) = group.batch([], [(wrong, 0)])
        with pytest.raises(RuntimeError, match="receives"):
            recv.wait()
    with pytest.raises(RuntimeError, match="non-contiguous"):
        group.batch([(torch.empty(12)[::2], 0)], [])
    with pytest.raises(RuntimeError, match="split sizes"):
        group.all_to_all_single(torch.empty(6), t, [5], [6])


def test_ranks_keep_their_threads_from_call_to_call():
    """What libraries keep per thread (cuDNN's attention graphs) stays with a rank between the
    timed calls of the ring benchmark; each rank has a thread of its own."""
    import threading

    threads = RankThreads(RankGrid(world_size=4, cp=4))
    try:
        first, again = (threads.run(lambda pgs: threading.get_ident()) for _ in range(2))
    finally:
        threads.close()
    assert first == again and len(set(first)) == 4 and threading.get_ident() not in first
