"""What only a GPU would show, caught on CPU: the kernel contract itself (every context-parallel
and segment test attends through it: test_context_parallel.py); ring steps allocate no buffers or
fp32 temporaries of their own; the double ring's backward overlaps its outer transfers with
kernels; a Ulysses all-to-all copies its payload once; bf16 rings merge in fp32 and stay within
bf16 rounding of float64."""
import math

import torch

from megatron.longseq.attention import comm
from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.core import LongSeqCoreAttention
from megatron.longseq.attention.kernels import KernelContractError, TorchCpuFlashKernel, _bshd, check_contract
from megatron.longseq.attention.placement import DocumentLayout, ring_chunks
from megatron.longseq.attention.ring import ring_attention
from tests.unit_tests.alloc_count import CreatedTensors
from tests.unit_tests.attention.contract_kernel import ContractKernel
from tests.unit_tests.attention.test_core_attention import config
from tests.unit_tests.attention.test_kernels import naive
from tests.unit_tests.dist_utils import grid_groups, run_ranks


def test_a_causal_block_that_is_not_square_is_refused():
    """CUDA flash kernels align a causal mask bottom-right, the CPU and cuDNN kernels top-left: such
    a block would pass on CPU and attend other keys on GPU."""
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 4, 8)
    try:
        TorchCpuFlashKernel().forward(q, k, k, True, 0.5)
    except KernelContractError as err:
        assert "a causal block must be square, got 2 queries and 4 keys" in str(err)
    else:
        raise AssertionError("accepted a causal block of 2 queries and 4 keys")
    TorchCpuFlashKernel().forward(q, k, k, False, 0.5)  # a full block of any shape is fine


def test_contract_rejects_what_cuda_kernels_misread():
    q = torch.randn(1, 2, 8, 4)
    lse = torch.randn(1, 2, 16)[:, :, 8:]  # a slice of a longer row: strides (32, 16, 1)
    for bad in (dict(lse=lse), dict(lse=lse.contiguous().double()), dict(q=q.transpose(-1, -2))):
        args = dict(q=q, k=q, v=q, out=q, lse=lse.contiguous(), dout=q)
        args.update(bad)
        try:
            check_contract(**args)
        except KernelContractError as err:
            assert "\n" not in str(err)
        else:
            raise AssertionError(f"accepted {bad}")
    check_contract(q, q, q, q, lse.contiguous(), q)
    one = torch.randn(1, 2, 8, 4)
    check_contract(one, one, one, one, lse.contiguous()[:1], one.as_strided(one.shape, (7, 32, 4, 1)))  # b = 1
    try:
        TorchCpuFlashKernel().backward(q.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3), q, q, q, q,
                                       lse.contiguous(), True, 0.5)
    except KernelContractError as err:
        assert "dout strides" in str(err)
    else:
        raise AssertionError("dout in another layout than out was accepted")


# ---- ring steps --------------------------------------------------------------------------------

B, H, G, S, D = 2, 4, 2, 32, 8


def _ring_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, D, generator=g).to(dtype).requires_grad_() for n in (H, G, G)]


def _ring_allocations(inner):
    """Forward and backward of a 4-position ring: what the ring itself creates that is as large as
    a KV block (payload) or larger, outside the kernels."""
    cp = ContextParallel.from_process_groups(grid_groups(cp=4, inner_ring=inner, placement="context-first"))
    cp.ring.connect(torch.device("cpu"))  # once per run, not per call
    q, k, v = _ring_inputs()
    dout = torch.randn(B, H, S, D)
    fwd, bwd = CreatedTensors(), CreatedTensors()
    kernel = ContractKernel(fwd)
    with fwd:
        out, _ = ring_attention(q, k, v, cp.ring, kernel, 0.35, 1)
    kernel.counter = bwd
    with bwd:
        out.backward(dout)
    block = B * G * S * D  # one k (or v) block
    # Forward, per call: the [2, b, g, s, d] stack and at most two receive buffers; nothing per
    # step (before: a receive buffer per step and three fp32 [b, h, s, d] merge temporaries).
    assert len(fwd.at_least(block)) <= 3, fwd.at_least(block)
    # Backward, per call: dq (fp32), the KV stack, the zeroed dK/dV accumulator, two KV receive
    # buffers and the accumulators' pool (one buffer: what arrives lands in the one whose send has
    # completed), the fp32 -> input dtype casts of dq, dk, dv; nothing per step.
    assert len(bwd.at_least(block)) <= 9, bwd.at_least(block)
    # The merge's temporaries are lse-sized ([b, h, s]): two per merged block.
    small = [c for c in fwd.created if c[1] < block]
    assert len(small) <= 2 * 3, small


def _outer_transfers_overlap_kernels():
    """Double ring R = 4, W = 2: between the start of each outer transfer and its wait, at least one
    kernel runs -- also in backward, where the dK/dV accumulators move between inner rings. (Not
    the last hop, which brings this rank's accumulator home after the last kernel.)"""
    cp = ContextParallel.from_process_groups(grid_groups(cp=4, inner_ring=2, placement="context-first"))
    events, alive, kernel = [], [], ContractKernel()
    exchange, wait = comm.RingComm.exchange, comm._Pending.wait

    def logged_send(self, sends, recvs, layer, phase):
        pending = exchange(self, sends, recvs, layer, phase)
        if sends:
            events.append(("send", self.axis, phase, id(pending)))
        alive.append(pending)  # ids stay unique
        return pending

    def logged_wait(self):
        events.append(("wait", id(self)))
        return wait(self)

    kernel.listeners.append(lambda kind: events.append(("kernel", kind)))
    comm.RingComm.exchange, comm._Pending.wait = logged_send, logged_wait
    try:
        q, k, v = _ring_inputs()
        out, _ = ring_attention(q, k, v, cp.ring, kernel, 0.35, 1)
        out.backward(torch.randn_like(out))
    finally:
        comm.RingComm.exchange, comm._Pending.wait = exchange, wait
    outer = [(i, e[3], e[2]) for i, e in enumerate(events) if e[0] == "send" and e[1] == "outer"]
    assert [phase for *_, phase in outer] == ["fwd", "bwd", "bwd", "bwd"]  # O = 2: KV once, dK/dV twice
    for start, pending, phase in outer[:-1]:
        end = events.index(("wait", pending), start)
        assert any(e[0] == "kernel" for e in events[start:end]), f"{phase} outer transfer waited at once"


def _bf16_ring_within_rounding():
    """bf16 q, k, v on a double ring against float64 attention of the same (rounded) inputs. Merges
    are fp32; what remains is bf16 rounding of each block's output and of the result (2^-8
    relative on O(1) values, a few of them): 3e-2, the bound of the single-kernel bf16 test. dq,
    dk, dv add up to four bf16 block gradients (one per ring position, each rounded at 2^-8 before
    the fp32 sum) and are rounded once more: twice that bound."""
    cp = ContextParallel.from_process_groups(grid_groups(cp=4, inner_ring=2, placement="context-first"))
    idx = ring_chunks(4 * S, 4, cp.ring.ring_index)  # this position's tokens of a 4S sequence
    g = torch.Generator().manual_seed(2)
    whole = [torch.randn(B, n, 4 * S, D, generator=g).bfloat16() for n in (H, G, G)]
    leaves = [x[:, :, idx].clone().requires_grad_() for x in whole]
    out, _ = ring_attention(*leaves, cp.ring, TorchCpuFlashKernel(), 1 / math.sqrt(D), 1)
    ref64 = [x.double().requires_grad_() for x in whole]
    ref, _ = naive(*ref64, True, 1 / math.sqrt(D))
    dout = torch.randn(B, H, 4 * S, D, generator=g).bfloat16()
    out.backward(dout[:, :, idx])
    ref.backward(dout.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref[:, :, idx].detach(), atol=3e-2, rtol=0)
    for leaf, r in zip(leaves, ref64):
        torch.testing.assert_close(leaf.grad.double(), r.grad[:, :, idx], atol=6e-2, rtol=0)


# ---- Ulysses -------------------------------------------------------------------------------------

def _all_to_all_copies_once():
    """Each direction of SeqAlltoAll creates two payload-sized tensors: the packed send buffer (or the
    unpacked result) and the receive buffer -- one copy of the payload, forward and backward."""
    pgs = grid_groups(cp=4, hp=4)
    cp = ContextParallel.from_process_groups(pgs)
    x = torch.randn(8, 2, 8, 4, requires_grad=True)  # [s, b, H, d], 2 heads per rank
    counts = [2, 2, 2, 2]
    for direction in (True, False):
        inp = x if direction else torch.randn(32, 2, 2, 4, requires_grad=True)
        with CreatedTensors() as fwd:
            y = comm.seq_all_to_all(inp, cp.hp_group, counts, cp.hp_index, direction, 1)
        with CreatedTensors() as bwd:
            y.backward(torch.ones_like(y))  # a contiguous gradient, as a linear layer's is
        payload = inp.numel()
        for counter in (fwd, bwd):
            big = [c for c in counter.created if c[1] >= payload and "ones_like" not in c[0]]
            assert len(big) == 2 and not [c for c in counter.created if c[1] < payload], counter.created


class _TokenMajorKernel(ContractKernel):
    """The CPU kernel with its output laid out by token ([b, s, h, d] in memory), as GPU kernels may
    hand it back."""

    def _forward(self, *args):
        out, lse = super()._forward(*args)
        with self.counter.pause():
            return _bshd(out), lse


def _ulysses_copies_nothing_more_at_micro_batch_one():
    """At micro-batch 1 (the long-sequence case) a Ulysses layer creates the all-to-alls' own
    buffers only -- q, k, v and out each a send and a receive buffer, the same in backward --
    whether the kernel's output is laid out like q or by token: no layout copy on either side."""
    cp = ContextParallel.from_process_groups(grid_groups(cp=2, hp=2))
    for kernel_type in (ContractKernel, _TokenMajorKernel):
        attn = LongSeqCoreAttention(config(4, 2, d=8, rope=False), layer_number=1, attn_mask_type=None, cp=cp)
        fwd, bwd = CreatedTensors(), CreatedTensors()
        attn._kernel = kernel = kernel_type(fwd)
        q, k, v = (torch.randn(16, 1, n, 8, requires_grad=True) for n in (4, 2, 2))  # [s, b, h, d]
        with fwd:
            out = attn(q, k, v, None)
        kernel.counter, dout = bwd, torch.randn_like(out)
        with bwd:
            out.backward(dout)
        for counter in (fwd, bwd):
            assert len(counter.at_least(k.numel())) == 8, (kernel_type.__name__, counter.created)


def _ring_of_one_document_as_plain_causal():
    """A micro-batch of one sample that is one document (common in long-context training with
    --reset-attention-mask) takes the plain ring's path: each block's one piece covers the kernel's
    rows, so no out-sized accumulator or lse copy is made beside the kernels' own outputs."""
    cp = ContextParallel.from_process_groups(grid_groups(cp=2))
    cp.ring.connect(torch.device("cpu"))
    one_document = torch.zeros(1, 2 * S, dtype=torch.bool)
    one_document[0, 0] = True
    made, outs = [], []
    for documents in (None, DocumentLayout(one_document, 2)):
        q, k, v = (x[:1].detach().requires_grad_() for x in _ring_inputs())
        counter = CreatedTensors()
        kernel = ContractKernel(counter)
        with counter:
            out, _ = ring_attention(q, k, v, cp.ring, kernel, 0.35, 1, documents=documents)
            out.backward(torch.ones_like(out))
        made.append(len(counter.at_least(k.numel())))
        outs.append((out, q.grad, k.grad, v.grad))
    assert made[0] == made[1], made
    for plain, packed in zip(*outs):
        torch.testing.assert_close(packed, plain, atol=0, rtol=0)  # the same kernel calls


def _two_rank_cases():
    _ulysses_copies_nothing_more_at_micro_batch_one()
    _ring_of_one_document_as_plain_causal()


def test_ulysses_and_one_document_rings_copy_nothing_more():
    """Ulysses layers whatever the kernels' output layout; a ring over a sample that is one document."""
    run_ranks(_two_rank_cases, 2)


def _four_rank_cases():
    for inner in (None, 2):
        _ring_allocations(inner)
    _outer_transfers_overlap_kernels()
    _bf16_ring_within_rounding()
    _all_to_all_copies_once()


def test_ring_and_all_to_all_allocate_overlap_and_merge_as_a_gpu_needs():
    """One spawn of 4 ranks: ring steps allocate nothing of their own, outer transfers overlap
    kernels, bf16 rings merge in fp32, SeqAlltoAll copies its payload once."""
    run_ranks(_four_rank_cases, 4)
