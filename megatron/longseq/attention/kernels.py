"""Local attention kernels behind one interface: forward -> (out, lse), backward -> (dq, dk, dv).

Layout everywhere: q [b, hq, sq, d], k and v [b, hkv, sk, d] with hq % hkv == 0 (GQA: query head i
uses KV head i // (hq / hkv)); out [b, hq, sq, d] in q's dtype; lse [b, hq, sq] float32, natural
log. `causal` means sq == sk with query i seeing keys 0..i; a block whose causal edge is elsewhere
is composed by the caller from full blocks (ring and segment attention do this), so every kernel
only needs the two shapes every library has.

The backward takes the *final* out and lse: when partial results are merged (ring attention), the
gradient of each block is exactly the kernel backward evaluated with the merged out/lse
(FlashAttention-2, section 3.1.2: dS = P o (dP - rowsum(dO o O)) with P = exp(S - lse)).

The contract (what CUDA kernels assume, checked on every call, also on CPU): q, k, v, out and dout
have a unit last stride; lse is a *contiguous* float32 [b, hq, sq] tensor (flash-attn's mha_bwd
and torch's flash/cuDNN backward read it through a raw pointer, so a strided view silently gives
wrong gradients); dout has the strides of out (cuDNN before 9.5.1 requires it). A violation raises
KernelContractError, so CPU CI fails where a GPU would compute garbage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor


class KernelContractError(ValueError):
    """A call that a CUDA attention kernel would silently get wrong."""


def contract_violations(q, k, v, out=None, lse=None, dout=None, causal=False) -> List[str]:
    """What in this call breaks the kernel contract (empty when nothing does)."""
    problems = [f"{name} needs 4 dims and a unit last stride, got shape {tuple(t.shape)} strides {t.stride()}"
                for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout))
                if t is not None and (t.dim() != 4 or t.stride(-1) != 1)]
    if problems:
        return problems
    b, hq, sq, _ = q.shape
    if hq % k.shape[1] or k.shape != v.shape:
        problems.append(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match, with heads dividing q's {hq}")
    if causal and sq != k.shape[2]:  # CUDA flash kernels align such a mask bottom-right, the others top-left
        problems.append(f"a causal block must be square, got {sq} queries and {k.shape[2]} keys")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (b, hq, sq) or not lse.is_contiguous()):
        problems.append(f"lse must be a contiguous float32 [b, hq, sq] = {[b, hq, sq]} tensor, got "
                        f"{lse.dtype} {list(lse.shape)} strides {lse.stride()}")
    if dout is not None and out is not None and not same_layout(dout, out):
        problems.append(f"dout strides {dout.stride()} differ from out's {out.stride()}")
    return problems


@dataclass(frozen=True)
class Varlen:
    """Sequences packed back to back for one variable-length call (flash-attn's cu_seqlens):
    sequence i is query rows cu_q[i]:cu_q[i+1] against key rows cu_k[i]:cu_k[i+1], all causal
    (squares, sq == sk) or all full. cu_q, cu_k: int32 [n + 1] on the kernel's device; the
    sizes are host ints, so neither a call nor its checks read the device."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    total_q: int
    total_k: int
    causal: bool


VARLEN_MAX_SEQS = 65535  # flash-attention 2 puts a call's sequences on the grid's y dimension


def varlen_violations(q, k, v, seqs: Varlen, out=None, lse=None, dout=None) -> List[str]:
    """What in a variable-length call breaks flash-attn's mha_varlen contract: q [Tq, hq, d], k and v
    [Tk, hkv, d], out and dout like q, with a unit last stride; lse a contiguous float32 [hq, Tq]
    (read through a raw pointer); cu_seqlens contiguous int32 on q's device."""
    problems = [f"{name} needs [tokens, heads, d] with a unit last stride, got shape {tuple(t.shape)} "
                f"strides {t.stride()}" for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout))
                if t is not None and (t.dim() != 3 or t.stride(-1) != 1)]
    if problems:
        return problems
    if (q.shape[0], k.shape[0]) != (seqs.total_q, seqs.total_k) or k.shape != v.shape or q.shape[1] % k.shape[1]:
        problems.append(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not hold "
                        f"{seqs.total_q} query and {seqs.total_k} key rows with heads dividing q's")
    problems += [f"{name} must be a contiguous int32 vector on {q.device}, got {cu.dtype} {list(cu.shape)} on "
                 f"{cu.device}" for name, cu in (("cu_q", seqs.cu_q), ("cu_k", seqs.cu_k))
                 if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous() or cu.device != q.device]
    if seqs.cu_q.shape != seqs.cu_k.shape:
        problems.append(f"cu_q {list(seqs.cu_q.shape)} and cu_k {list(seqs.cu_k.shape)} count different sequences")
    if seqs.cu_q.numel() - 1 > VARLEN_MAX_SEQS:  # one grid row per sequence: the launch would fail
        problems.append(f"{seqs.cu_q.numel() - 1} sequences in one call, more than {VARLEN_MAX_SEQS}")
    want = [q.shape[1], q.shape[0]]
    if lse is not None and (lse.dtype != torch.float32 or list(lse.shape) != want or not lse.is_contiguous()):
        problems.append(f"lse must be a contiguous float32 [hq, Tq] = {want} tensor, got {lse.dtype} "
                        f"{list(lse.shape)} strides {lse.stride()}")
    return problems + [f"{name} {tuple(t.shape)} must match q {tuple(q.shape)}"
                       for name, t in (("out", out), ("dout", dout)) if t is not None and t.shape != q.shape]


def check_varlen(q, k, v, seqs: Varlen, out=None, lse=None, dout=None) -> None:
    problems = varlen_violations(q, k, v, seqs, out, lse, dout)
    if problems:
        raise KernelContractError("variable-length attention contract: " + "; ".join(problems))


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Same shape and the same strides, except over dims of size 1 (where a stride means nothing:
    a micro-batch of 1 is laid out alike whatever stride its batch dim carries)."""
    return a.shape == b.shape and all(x == y or n == 1 for x, y, n in zip(a.stride(), b.stride(), a.shape))


def check_contract(q, k, v, out=None, lse=None, dout=None, causal=False) -> None:
    problems = contract_violations(q, k, v, out, lse, dout, causal)
    if problems:
        raise KernelContractError("attention kernel contract: " + "; ".join(problems))


def grad_like(dout: Tensor, out: Tensor) -> Tensor:
    """dout with the strides of out (a copy only where autograd handed over another layout)."""
    return dout if same_layout(dout, out) else torch.empty_like(out).copy_(dout)


class AttentionKernel:
    """Interface of a local kernel. `name` appears in logs and benchmark tables. Subclasses
    implement _forward/_backward; the public methods check the contract on the way in and out."""

    name = "abstract"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
        check_contract(q, k, v, causal=causal)
        out, lse = self._forward(q, k, v, causal, scale)
        check_contract(q, k, v, out, lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        check_contract(q, k, v, out, lse, dout, causal)
        return self._checked_grads(self._backward(dout, q, k, v, out, lse, causal, scale), q, k, v)

    # A variable-length entry (varlen = True): many sequences in one call (varlen.py), layout
    # [tokens, heads, d]; lse [hq, Tq] float32.
    varlen = False

    def forward_varlen(self, q: Tensor, k: Tensor, v: Tensor, seqs: Varlen, scale: float) -> Tuple[Tensor, Tensor]:
        check_varlen(q, k, v, seqs)
        out, lse = self._forward_varlen(q, k, v, seqs, scale)
        check_varlen(q, k, v, seqs, out, lse)
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, seqs: Varlen, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        check_varlen(q, k, v, seqs, out, lse, dout)
        return self._checked_grads(self._backward_varlen(dout, q, k, v, out, lse, seqs, scale), q, k, v)

    def _checked_grads(self, grads, q, k, v):
        dq, dk, dv = grads
        if (dq.shape, dk.shape, dv.shape) != (q.shape, k.shape, v.shape):
            raise KernelContractError(f"{self.name} backward returned {tuple(dq.shape)}, {tuple(dk.shape)}, "
                                      f"{tuple(dv.shape)} for q {tuple(q.shape)}, k/v {tuple(k.shape)}")
        return dq, dk, dv

    def _forward(self, q, k, v, causal, scale):
        raise NotImplementedError

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        raise NotImplementedError

    def _forward_varlen(self, q, k, v, seqs, scale):
        raise NotImplementedError

    def _backward_varlen(self, dout, q, k, v, out, lse, seqs, scale):
        raise NotImplementedError


def _expand_kv(x: Tensor, hq: int) -> Tensor:
    # [b, hkv, s, d] -> [b, hq, s, d]: each KV head repeated for its hq/hkv query heads.
    return x if x.shape[1] == hq else x.repeat_interleave(hq // x.shape[1], dim=1)


def _bshd(x: Tensor) -> Tensor:
    """x [b, h, s, d] laid out [b, s, h, d]-contiguous in memory (a copy only where it is not)."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def _reduce_kv_grad(dx: Tensor, hkv: int) -> Tensor:
    # [b, hq, s, d] -> [b, hkv, hq/hkv, s, d] -> sum over the query heads that shared a KV head.
    if dx.shape[1] == hkv:
        return dx
    b, hq, s, d = dx.shape
    return dx.view(b, hkv, hq // hkv, s, d).sum(dim=2)


class ReferenceKernel(AttentionKernel):
    """Plain math in fp32 (materialises the [sq, sk] scores). The numerical reference of every test,
    and the `unfused` / `local` backend."""

    name = "reference"

    @staticmethod
    def _scores(q, k, causal, scale):
        # [b, hq, sq, d] x [b, hq, d, sk] -> scores [b, hq, sq, sk] in fp32
        scores = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores

    def _forward(self, q, k, v, causal, scale):
        scores = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        out = torch.matmul(probs, _expand_kv(v, q.shape[1]).float())
        return out.to(q.dtype), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        hq, hkv = q.shape[1], k.shape[1]
        probs = torch.exp(self._scores(q, k, causal, scale) - lse.unsqueeze(-1))  # with the final lse
        dout32, vf = dout.float(), _expand_kv(v, hq).float()
        dv = torch.matmul(probs.transpose(-1, -2), dout32)
        dprobs = torch.matmul(dout32, vf.transpose(-1, -2))
        delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dO o O)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, _expand_kv(k, hq).float())
        dk = torch.matmul(dscores.transpose(-1, -2), q.float())
        return (dq.to(q.dtype), _reduce_kv_grad(dk, hkv).to(k.dtype), _reduce_kv_grad(dv, hkv).to(v.dtype))


class TorchCpuFlashKernel(AttentionKernel):
    """torch's CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu):
    tiled, fp32 accumulation, native GQA, returns the logsumexp."""

    name = "torch-cpu-flash"

    def _forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        # Its lse is laid out [b, s, h] in memory (strides (h*s, 1, h)): made contiguous, as the
        # CUDA kernels' is, so the CPU path passes through the same contract.
        return out, lse.contiguous()

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
        )


class TorchCudaFlashKernel(AttentionKernel):
    """torch's fused flash kernel on CUDA (FlashAttention-2, fp16/bf16). GQA is native: its mha_fwd
    and mha_bwd take fewer KV heads and return dK/dV with hkv heads."""

    name = "torch-cuda-flash"

    def _forward(self, q, k, v, causal, scale):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        empty = torch.empty(0, dtype=torch.int64, device=q.device)  # philox state: unused, p = 0
        # cum_seq_q/k undefined (None): the dense, not the varlen, path
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty, scale=scale,
        )

    # Its varlen entry (torch's nested-tensor path, mha_varlen_fwd/bwd): q [Tq, hq, d] with any
    # row and head strides, lse [hq, Tq]; causal is bottom-right aligned, the same as top-left for
    # the squares it is given.
    varlen = True

    def _forward_varlen(self, q, k, v, seqs, scale):
        res = torch.ops.aten._flash_attention_forward(
            q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, 0.0, seqs.causal, False, scale=scale)
        return res[0], res[1]  # (output, logsumexp, rng_state, unused, debug_attn_mask)

    def _backward_varlen(self, dout, q, k, v, out, lse, seqs, scale):
        empty = torch.empty(0, dtype=torch.int64, device=q.device)  # philox state: unused, p = 0
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, 0.0, seqs.causal, empty, empty,
            scale=scale)


class TorchCudnnKernel(AttentionKernel):
    """torch's cuDNN attention (fp16/bf16, cuDNN >= 9): native GQA, and on Hopper the fastest kernel
    a wheel can give (FlashAttention-3 paper, H100 fp16 causal 16K forward: cuDNN 539 TFLOP/s,
    FlashAttention-2 335). Its lse comes back [b, h, s, 1] in recent torch ([b, h, s] before):
    we hand out [b, h, s] and give the backward the rank its forward returned (before any cuDNN
    forward has run, the backward is torch's flash kernel's).

    cuDNN before 9.26 returns non-finite dQ for non-causal blocks with sk % 128 == 64 on sm90
    (pytorch#196678; torch's dispatcher routes such calls elsewhere, but we call the op directly):
    those blocks go to torch's flash kernel, which is exact for them, as do blocks of one key, which
    torch's dispatcher never gives cuDNN (check_cudnn_tensor_shapes: "does not support key/value
    sequence length 1"), and blocks of one query (a packed document's piece of a single token),
    which torch's decode check refuses for cuDNN 9.19-9.25 on sm100.

    torch builds a cuDNN graph for every new shape (tens to hundreds of ms each) and keeps it.
    Per-micro-batch segments and packed blocks of a single piece make shapes without end (blocks
    of several pieces go to the varlen entry below): past MAX_SHAPES distinct shapes, a new one
    goes to torch's flash kernel, which takes any shape at no set-up cost. A shape keeps its
    kernel from its first call on, so a backward runs the kernel of its forward."""

    name = "torch-cudnn"
    MAX_SHAPES = 64

    def __init__(self):
        self._lse_rank: Optional[int] = None  # learnt from the first forward
        self._fallback = TorchCudaFlashKernel()
        self._shapes = set()  # the shapes cuDNN has been given (a graph each)

    def _cudnn_takes(self, q, k, causal, admit: bool) -> bool:
        """Whether this call goes to cuDNN; a forward (admit) may take a new shape while there is room."""
        if k.shape[2] == 1 or q.shape[2] == 1 or (not causal and k.shape[2] % 128 == 64):
            return False
        shape = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), causal)  # what a graph is built for
        if admit and len(self._shapes) < self.MAX_SHAPES:
            self._shapes.add(shape)
        return shape in self._shapes

    def _forward(self, q, k, v, causal, scale):
        if not self._cudnn_takes(q, k, causal, admit=True):
            return self._fallback._forward(q, k, v, causal, scale)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        self._lse_rank = lse.dim()
        # [b, h, s(, 1)] -> [b, h, s], dense: under TORCH_CUDNN_SDPA_AVOID_RECOMPILE torch lays it out
        # [b, s, h, 1] transposed, and the contract (and the ring's merges) want it contiguous
        return out, lse.reshape(q.shape[:3]).contiguous()

    # Packed documents go to torch's flash varlen entry: one call for many pieces, and no graph to
    # build per shape (cuDNN's own ragged entry is for nested tensors, and builds graphs too).
    varlen = True

    def _forward_varlen(self, q, k, v, seqs, scale):
        return self._fallback._forward_varlen(q, k, v, seqs, scale)

    def _backward_varlen(self, dout, q, k, v, out, lse, seqs, scale):
        return self._fallback._backward_varlen(dout, q, k, v, out, lse, seqs, scale)

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        if not self._cudnn_takes(q, k, causal, admit=False) or self._lse_rank is None:
            return self._fallback._backward(dout, q, k, v, out, lse, causal, scale)
        # philox seed and offset: one-element zeros, as the forward makes them; unused at p = 0
        seed = torch.zeros(1, dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1) if self._lse_rank == 4 else lse, seed, seed,
            None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )


class TorchCudaEfficientKernel(AttentionKernel):
    """torch's memory-efficient kernel on CUDA: any float dtype (the fp32 path on GPU, and fp16/bf16
    where no flash kernel runs). It wants equal head counts, so GQA KV heads are expanded here and
    their gradients summed back."""

    name = "torch-cuda-efficient"

    def _forward(self, q, k, v, causal, scale):
        hq = q.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, hq), _expand_kv(v, hq), None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].contiguous()  # the kernel pads lse to a multiple of 32

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        hq, hkv = q.shape[1], k.shape[1]
        if q.dtype != torch.float32:
            # in fp16/bf16 the kernel computes rowsum(dO o O) itself, reading out (and dout) with the
            # row stride of a [b, s, h, d]-contiguous tensor whatever strides they carry
            out, dout = _bshd(out), _bshd(dout)
        pad = (-lse.shape[-1]) % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _expand_kv(k, hq), _expand_kv(v, hq), None, out, lse_p,
            seed, seed, 0.0, [True, True, True, False], causal, scale=scale,
        )
        return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)


FLASH_ATTN_SUPPORTED = (">=2.7.0", "<2.9")  # the private signatures below; setup.py pins the same


class FlashAttnKernel(AttentionKernel):
    """The flash-attn package (2.7 and 2.8), native GQA. It takes [b, s, h, d]; we transpose views
    (flash-attn needs only a unit last stride)."""

    name = "flash-attn"

    def __init__(self):
        from flash_attn import flash_attn_interface as fai  # noqa: F401  (optional dependency)

        self._fai = fai

    def _forward(self, q, k, v, causal, scale):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d] -> [b, s, h, d]
        res = self._fai._flash_attn_forward(
            qt, kt, vt, 0.0, scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False,
        )
        out, lse = res[0], res[1]  # (out, softmax_lse, S_dmask, rng_state)
        return out.transpose(1, 2), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._fai._flash_attn_backward(  # fills dq, dk, dv
            dot, qt, kt, vt, ot, lse, dq, dk, dv, 0.0, scale, causal,
            -1, -1, 0.0, None, torch.are_deterministic_algorithms_enabled(),
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    # Its varlen entry takes [tokens, heads, d] as it is; lse [hq, Tq] (2.7 and 2.8 alike).
    varlen = True

    def _forward_varlen(self, q, k, v, seqs, scale):
        res = self._fai._flash_attn_varlen_forward(
            q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, 0.0, scale, causal=seqs.causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        )
        return res[0], res[1]  # (out, softmax_lse, S_dmask, rng_state)

    def _backward_varlen(self, dout, q, k, v, out, lse, seqs, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fai._flash_attn_varlen_backward(  # fills dq, dk, dv
            dout, q, k, v, out, lse, dq, dk, dv, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, 0.0, scale,
            seqs.causal, -1, -1, 0.0, None, torch.are_deterministic_algorithms_enabled(),
        )
        return dq, dk, dv


class PaddedHeadDim(AttentionKernel):
    """A kernel run on a head dim zero-padded to a multiple of `multiple`: the fp16/bf16 CUDA
    kernels take only such head dims (torch's memory-efficient kernel has no unaligned half
    kernels from sm80 on; flash-attn pads the same way in its own wrapper). Exact: zero channels
    add nothing to q.k, so scores and lse are unchanged, and zero v channels give zero out
    channels, which are cut off (the scale is the caller's, from the true head dim)."""

    def __init__(self, inner: AttentionKernel, multiple: int = 8):
        self.inner, self.multiple = inner, multiple
        self.name = f"{inner.name} (head dim padded to a multiple of {multiple})"
        self.varlen = inner.varlen

    def _pad(self, x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, (-x.shape[-1]) % self.multiple))  # [..., d] -> [..., d']

    def _forward(self, q, k, v, causal, scale):
        out, lse = self.inner.forward(*map(self._pad, (q, k, v)), causal, scale)
        return _cut(out, q), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        grads = self.inner.backward(*map(self._pad, (dout, q, k, v, out)), lse, causal, scale)
        return tuple(_cut(g, x) for g, x in zip(grads, (q, k, v)))

    def _forward_varlen(self, q, k, v, seqs, scale):
        out, lse = self.inner.forward_varlen(*map(self._pad, (q, k, v)), seqs, scale)
        return _cut(out, q), lse

    def _backward_varlen(self, dout, q, k, v, out, lse, seqs, scale):
        grads = self.inner.backward_varlen(*map(self._pad, (dout, q, k, v, out)), lse, seqs, scale)
        return tuple(_cut(g, x) for g, x in zip(grads, (q, k, v)))


def _cut(padded: Tensor, like: Tensor) -> Tensor:
    """`padded` [..., d'] cut to like's d, dense: a view would carry the padded row strides, which
    autograd's gradients (laid out dense) would not match."""
    return padded[..., :like.shape[-1]].contiguous()


def default_scale(head_dim: int, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
