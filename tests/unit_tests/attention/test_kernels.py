"""Every local kernel against attention written out in float64 (forward, lse and gradients)."""
import math

import pytest
import torch

from megatron.longseq.attention.kernel_choice import KernelEnv, choose_kernel, select_kernel
from megatron.longseq.attention.kernels import (
    FLASH_ATTN_SUPPORTED, KernelContractError, PaddedHeadDim, ReferenceKernel, TorchCpuFlashKernel,
    TorchCudaEfficientKernel, TorchCudaFlashKernel, TorchCudnnKernel,
)
from megatron.longseq.attention.local import local_attention

CUDA = torch.cuda.is_available()


def naive(q, k, v, causal, scale):
    """float64 softmax attention with autograd; GQA by repeating KV heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def make(b=2, hq=4, hkv=4, s=48, d=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def check_kernel(kernel, dtype, device, atol, d=16):
    for hq, hkv in ((4, 4), (4, 2), (4, 1)):
        for causal in (True, False):
            q, k, v = make(hq=hq, hkv=hkv, d=d, dtype=dtype, device=device)
            scale = 1 / math.sqrt(q.shape[-1])
            q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
            ref_out, ref_lse = naive(q64, k64, v64, causal, scale)
            dout = torch.randn_like(ref_out)
            ref_out.backward(dout)
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out, lse = local_attention(qq, kk, vv, kernel, causal, scale)
            out.backward(dout.to(device=device, dtype=dtype))
            assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
            torch.testing.assert_close(out.double().cpu(), ref_out.detach(), atol=atol, rtol=0)
            torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), atol=atol, rtol=0)
            for got, want in ((qq.grad, q64.grad), (kk.grad, k64.grad), (vv.grad, v64.grad)):
                assert got.shape == want.shape
                torch.testing.assert_close(got.double().cpu(), want, atol=4 * atol, rtol=0)


# Tolerances: inputs are N(0,1), d = 16, s = 48, so outputs and gradients are O(1). fp32 kernels
# accumulate in fp32 over <= 48 terms: errors ~ 48 * 2^-24 ~ 3e-6; 2e-5 leaves margin. bf16 inputs
# and outputs carry 2^-8 ~ 4e-3 relative rounding each; 3e-2 covers a few of those on O(1) values.
@pytest.mark.parametrize("kernel", [ReferenceKernel(), TorchCpuFlashKernel()], ids=lambda k: k.name)
def test_cpu_kernels_fp32(kernel):
    check_kernel(kernel, torch.float32, "cpu", atol=2e-5)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), TorchCpuFlashKernel()], ids=lambda k: k.name)
def test_cpu_kernels_bf16(kernel):
    check_kernel(kernel, torch.bfloat16, "cpu", atol=3e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_flash_kernel_bf16():
    check_kernel(TorchCudaFlashKernel(), torch.bfloat16, "cuda", atol=3e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_cudnn_kernel_bf16():
    """What --attention-backend auto takes on Hopper (bf16, cuDNN >= 9)."""
    check_kernel(TorchCudnnKernel(), torch.bfloat16, "cuda", atol=3e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_efficient_kernel_fp32():
    # TF32 is off for these matmuls by default in torch; fp32 accumulation as on CPU.
    check_kernel(TorchCudaEfficientKernel(), torch.float32, "cuda", atol=1e-4)


@pytest.mark.parametrize("inner", [ReferenceKernel(), TorchCpuFlashKernel()], ids=lambda k: k.name)
def test_a_head_dim_padded_to_a_multiple_of_8_is_exact(inner):
    """fp16/bf16 CUDA kernels take head dims in multiples of 8 only: d = 20 runs on 24 channels,
    against float64 attention on the 20 (fp32: the tolerance of the kernels unpadded)."""
    check_kernel(PaddedHeadDim(inner), torch.float32, "cpu", atol=2e-5, d=20)


def test_a_half_precision_head_dim_off_the_multiple_of_8_runs_padded_on_gpu(monkeypatch):
    from megatron.longseq.attention import kernel_choice

    monkeypatch.setattr(kernel_choice.KernelEnv, "probe", classmethod(lambda cls, device, dtype, d: _env(head_dim=d)))
    padded = select_kernel("auto", torch.device("cuda"), torch.bfloat16, 100)
    assert isinstance(padded, PaddedHeadDim) and padded.inner.name == "torch-cudnn"
    assert padded.name == "torch-cudnn (head dim padded to a multiple of 8)"
    assert select_kernel("auto", torch.device("cuda"), torch.bfloat16, 96).name == "torch-cudnn"
    assert select_kernel("unfused", torch.device("cuda"), torch.bfloat16, 100).name == "reference"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_auto_kernel_bf16_head_dim_20():
    """What a head dim of 20 runs in bf16 on this GPU (padded to 24)."""
    kernel = select_kernel("auto", torch.device("cuda"), torch.bfloat16, 20)
    check_kernel(kernel, torch.bfloat16, "cuda", atol=3e-2, d=20)


def test_backward_with_merged_lse_is_the_gradient_of_the_merged_output():
    """The property ring attention relies on: splitting the keys in two blocks, running each
    block's kernel backward with the *merged* out and lse gives the full gradients."""
    kernel = TorchCpuFlashKernel()
    q, k, v = make(s=32)
    scale = 0.25
    halves = [(k[:, :, :16], v[:, :, :16]), (k[:, :, 16:], v[:, :, 16:])]
    parts = [kernel.forward(q, kb, vb, False, scale) for kb, vb in halves]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(l - lse).unsqueeze(-1) for o, l in parts)
    full_out, full_lse = kernel.forward(q, k, v, False, scale)
    torch.testing.assert_close(out, full_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=0)
    dout = torch.randn_like(out)
    grads = [kernel.backward(dout, q, kb, vb, out, lse, False, scale) for kb, vb in halves]
    dq_full, dk_full, dv_full = kernel.backward(dout, q, k, v, full_out, full_lse, False, scale)
    torch.testing.assert_close(grads[0][0] + grads[1][0], dq_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), dk_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), dv_full, atol=1e-5, rtol=0)


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_kernel("auto", cpu, torch.float32).name == "torch-cpu-flash"
    assert select_kernel("flash", cpu, torch.bfloat16).name == "torch-cpu-flash"
    assert select_kernel("unfused", cpu, torch.float32).name == "reference"
    assert select_kernel("local", cpu, torch.float32).name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_kernel("magic", cpu, torch.float32)


# ---- which kernel runs where (the table --attention-backend documents) --------------------------

HOPPER = KernelEnv("cuda", torch.bfloat16, 128, capability=(9, 0), cudnn_version=91900)


def _env(**changes):
    fields = dict(HOPPER.__dict__)
    fields.update(changes)
    return KernelEnv(**fields)


@pytest.mark.parametrize("backend, env, kernel", [
    ("auto", _env(device_type="cpu"), "torch-cpu-flash"),
    ("flash", _env(device_type="cpu"), "torch-cpu-flash"),
    ("unfused", HOPPER, "reference"),
    ("auto", HOPPER, "torch-cudnn"),  # Hopper without flash-attn
    ("auto", _env(flash_attn_version="2.8.3"), "torch-cudnn"),  # cuDNN beats FlashAttention-2 there
    ("auto", _env(flash_attn_version="2.6.3"), "torch-cudnn"),  # an old flash-attn that would not run
    ("auto", _env(flash_attn_version="2.8.3", head_dim=256), "flash-attn"),  # beyond cuDNN's head dim
    ("auto", _env(head_dim=256), "torch-cuda-flash"),
    ("auto", _env(deterministic=True), "torch-cuda-flash"),  # cuDNN's backward is not deterministic
    ("auto", _env(capability=(8, 0)), "torch-cuda-flash"),  # Ampere: flash first, as torch orders it
    ("auto", _env(capability=(8, 0), flash_attn_version="2.7.4.post1"), "flash-attn"),
    ("auto", _env(dtype=torch.float32), "torch-cuda-efficient"),
    ("auto", _env(head_dim=100), "torch-cudnn"),  # on d padded to 104 (PaddedHeadDim)
    ("auto", _env(head_dim=100, capability=(8, 0)), "torch-cuda-flash"),
    ("auto", _env(head_dim=100, dtype=torch.float32), "torch-cuda-efficient"),  # fp32 takes any d
    ("auto", _env(head_dim=224, capability=(8, 9)), "torch-cuda-efficient"),  # FA2's backward: no room
    ("auto", _env(head_dim=224, capability=(8, 0)), "torch-cuda-flash"),
    ("auto", _env(head_dim=256, capability=(8, 9)), "torch-cuda-flash"),
    ("auto", _env(capability=(7, 5), dtype=torch.float16, flash_attn_version="2.8.3"), "torch-cuda-efficient"),
    ("auto", _env(head_dim=320, flash_attn_version="2.8.3"), "torch-cuda-efficient"),  # nor d > 256
    ("flash", HOPPER, "torch-cuda-flash"),
    ("flash", _env(flash_attn_version="2.8.3"), "flash-attn"),
    ("fused", HOPPER, "torch-cudnn"),
    ("fused", _env(dtype=torch.float32), "torch-cuda-efficient"),
])
def test_kernel_choice(backend, env, kernel):
    assert choose_kernel(backend, env) == kernel


@pytest.mark.parametrize("backend, env, message", [
    ("auto", _env(flash_attn_version="2.6.3", capability=(8, 0)), "flash-attn 2.6.3 is installed"),
    ("flash", _env(flash_attn_version="2.9.0"), "flash-attn 2.9.0 is installed"),
    ("flash", _env(dtype=torch.float32), "needs fp16/bf16"),
    ("flash", _env(head_dim=260), "a head dim <= 256 .got 264"),  # 260 padded
    ("flash", _env(head_dim=200, capability=(12, 0)), "head dims 193-224 does not fit sm120's shared memory"),
    ("auto", _env(capability=(7, 5)), "bf16 attention kernels need an sm80 or newer GPU .found sm75"),
    ("fused", _env(capability=(7, 0), dtype=torch.float16), "it needs an sm80 to sm121 GPU .found sm70"),
    ("flash", _env(capability=(7, 0), dtype=torch.float16), "sm80 or newer GPU .found sm70"),
    ("fused", _env(deterministic=True), "not deterministic"),
    ("fused", _env(cudnn_version=8907), "cuDNN >= 9"),
])
def test_kernel_choice_refusals_are_one_line(backend, env, message):
    with pytest.raises(ValueError, match=message) as err:
        choose_kernel(backend, env)
    assert "\n" not in str(err.value)


def test_setup_pins_the_flash_attn_interface_the_kernel_calls():
    import pathlib
    import re

    setup = (pathlib.Path(__file__).parents[3] / "setup.py").read_text()
    pinned = re.search(r'"flash-attn([^"]*)"', setup).group(1)
    assert pinned == ",".join(FLASH_ATTN_SUPPORTED)


# ---- the CUDA kernels' calls, on meta tensors (torch's shape functions of the same ops) ----------

@pytest.mark.parametrize("kernel", [TorchCudaFlashKernel(), TorchCudnnKernel(), TorchCudaEfficientKernel()],
                         ids=lambda k: k.name)
@pytest.mark.parametrize("hkv", [4, 1])
def test_cuda_kernel_calls_type_check_and_keep_the_contract(kernel, hkv):
    """Every argument list against torch's registered schema and meta function: forward and
    backward run, outputs honour the contract (lse [b, h, s] contiguous fp32), GQA without
    repeated KV where the kernel takes it, and from views laid out as [s, b, h, d] (ours)."""
    dtype = torch.float32 if isinstance(kernel, TorchCudaEfficientKernel) else torch.bfloat16
    b, h, s, d = 2, 4, 256, 64
    q = torch.empty(s, b, h, d, device="meta", dtype=dtype).permute(1, 2, 0, 3)
    k, v = (torch.empty(s, b, hkv, d, device="meta", dtype=dtype).permute(1, 2, 0, 3) for _ in range(2))
    for causal, sk in ((True, s), (False, s // 2), (False, 192)):  # 192 % 128 == 64: cuDNN's unsafe case
        kk, vv = k[:, :, :sk], v[:, :, :sk]
        out, lse = kernel.forward(q, kk, vv, causal, 0.125)
        assert lse.shape == (b, h, s) and lse.is_contiguous() and out.shape == q.shape
        dq, dk, dv = kernel.backward(torch.empty_like(out), q, kk, vv, out, lse, causal, 0.125)
        assert dk.shape == kk.shape and dv.shape == vv.shape and dq.shape == q.shape


def test_cudnn_kernel_gives_its_backward_the_lse_rank_its_forward_returned():
    kernel = TorchCudnnKernel()
    q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.bfloat16)
    out, lse = kernel.forward(q, q, q, True, 0.125)
    seen = []
    real = torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    class Spy:
        def __call__(self, *args, **kwargs):
            seen.append(args[5].shape)
            return real(*args, **kwargs)
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward = Spy()
    try:
        kernel.backward(torch.empty_like(out), q, q, q, out, lse, True, 0.125)
    finally:
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward = real
    assert kernel._lse_rank == 4  # this torch's cuDNN op returns [b, h, s, 1] (older ones [b, h, s])
    assert seen == [torch.Size([1, 2, 64, 1])] and lse.shape == (1, 2, 64)


def test_cudnn_kernel_hands_out_a_dense_lse_in_any_layout_cudnn_gives(monkeypatch):
    """Under TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 torch allocates cuDNN's lse [b, s, h, 1] and returns
    it transposed: the kernel still hands out a contiguous [b, h, s] (the contract would stop it)."""
    real = torch.ops.aten._scaled_dot_product_cudnn_attention

    def transposed_lse(*args, **kwargs):
        res = real(*args, **kwargs)
        b, h, s = res[1].shape[:3]
        return (res[0], torch.empty(b, s, h, 1, device="meta").transpose(1, 2), *res[2:])
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", transposed_lse)
    q = torch.empty(2, 2, 64, 64, device="meta", dtype=torch.bfloat16)
    _, lse = TorchCudnnKernel().forward(q, q, q, True, 0.125)
    assert lse.shape == (2, 2, 64) and lse.is_contiguous()


def test_a_strided_lse_never_reaches_a_kernel():
    q = torch.randn(1, 2, 8, 4)
    out, lse = TorchCpuFlashKernel().forward(q, q, q, True, 0.5)
    wide = torch.cat([lse, lse], dim=2)[:, :, 8:]  # what the ring once handed the backward
    with pytest.raises(KernelContractError, match="lse must be a contiguous"):
        TorchCpuFlashKernel().backward(torch.ones_like(out), q, q, q, out, wide, True, 0.5)


@pytest.mark.parametrize("dtype, copied", [(torch.bfloat16, True), (torch.float32, False)])
def test_efficient_kernel_hands_its_half_backward_out_laid_out_by_sequence(monkeypatch, dtype, copied):
    """In fp16/bf16 torch's memory-efficient backward computes rowsum(dO o O) inside the kernel and
    reads out with a [b, s, h, d]-contiguous row stride whatever strides it carries: out and dout
    must arrive laid out so, with their values (fp32 computes that sum with strided torch ops)."""
    seen = {}

    def fake_backward(dout, q, k, v, bias, out, lse, *rest, **kw):
        seen.update(out=out, dout=dout)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", fake_backward)
    b, h, s, d = 2, 4, 16, 8
    q, k, v, out, dout = (torch.randn(b, h, s, d, dtype=dtype) for _ in range(5))  # [b, h, s, d]-contiguous
    lse = torch.randn(b, h, s)
    TorchCudaEfficientKernel()._backward(dout, q, k, v, out, lse, True, 0.3)
    for name, given in (("out", out), ("dout", dout)):
        got = seen[name]
        assert torch.equal(got, given)
        assert got.transpose(1, 2).is_contiguous() == copied and (got is given) != copied, name


def _record_attention_ops(monkeypatch, ran):
    """torch's cuDNN and flash ops (CUDA only) replaced by stand-ins of the right shapes that note
    (op, key length) in `ran`."""
    def op(name, result):
        def call(*a, **kw):
            ran.append((name, a[1].shape[2]))
            return result(*a)
        monkeypatch.setattr(torch.ops.aten, name, call)

    op("_scaled_dot_product_cudnn_attention", lambda q, *_: (torch.zeros_like(q), torch.zeros(q.shape[:3])))
    op("_scaled_dot_product_flash_attention", lambda q, *_: (torch.zeros_like(q), torch.zeros(q.shape[:3])))
    op("_scaled_dot_product_cudnn_attention_backward", lambda dout, q, k, v, *_: (q, k, v))
    op("_scaled_dot_product_flash_attention_backward", lambda dout, q, k, v, *_: (q, k, v))


def test_cudnn_runs_the_backward_of_its_forward_with_seq1f1b_segments_and_no_ring(monkeypatch):
    """cuDNN's graphs are keyed on strides too: without a ring the backward hands the kernel k and
    v as the forward did (not a stacked copy), so each segment's blocks stay on cuDNN both ways."""
    from megatron.longseq.attention.ring import LOCAL, ring_attention
    from megatron.longseq.attention.segments import SegmentSlot, SegmentState

    ran = []
    _record_attention_ops(monkeypatch, ran)
    kernel, state, outs = TorchCudnnKernel(), SegmentState(), []
    s, b, h, d = 16, 1, 4, 8
    for segment in range(2):
        x = [torch.randn(s, b, h, d, requires_grad=True) for _ in range(3)]  # [s, b, h, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in x)  # -> [b, h, s, d] views, as core attention hands them
        outs.append(ring_attention(q, k, v, LOCAL, kernel, 0.25, layer=1, segment=SegmentSlot(state, segment))[0])
    ran.clear()
    for out in reversed(outs):
        out.sum().backward()
    assert len(ran) == 3 and {name for name, _ in ran} == {"_scaled_dot_product_cudnn_attention_backward"}


def test_a_block_of_one_key_or_one_query_never_goes_to_cudnn(monkeypatch):
    ran = []
    _record_attention_ops(monkeypatch, ran)
    four, one = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 1, 8)
    TorchCudnnKernel()._forward(four, one, one, False, 1.0)
    TorchCudnnKernel()._forward(one, four, four, False, 1.0)
    assert ran == [("_scaled_dot_product_flash_attention", 1), ("_scaled_dot_product_flash_attention", 4)]


def test_cudnn_builds_graphs_for_a_bounded_number_of_shapes(monkeypatch):
    """Packed documents give every piece its own shape, and torch builds (and keeps) a cuDNN graph
    per shape: past MAX_SHAPES the new shapes go to the flash kernel, and each shape's backward runs
    where its forward ran."""
    ran = []
    _record_attention_ops(monkeypatch, ran)
    monkeypatch.setattr(TorchCudnnKernel, "MAX_SHAPES", 3)
    kernel = TorchCudnnKernel()
    lengths = [8, 16, 8, 24, 32, 40, 16, 32]  # 5 distinct shapes, some again
    for s in lengths:
        q = torch.zeros(1, 2, s, 8)
        out, lse = kernel._forward(q, q, q, True, 1.0)
        kernel._backward(out, q, q, q, out, lse, True, 1.0)
    cudnn = {8, 16, 24}  # the first three shapes seen
    assert ran == [x for s in lengths for x in (
        [("_scaled_dot_product_cudnn_attention", s), ("_scaled_dot_product_cudnn_attention_backward", s)] if s in cudnn
        else [("_scaled_dot_product_flash_attention", s), ("_scaled_dot_product_flash_attention_backward", s)])]
