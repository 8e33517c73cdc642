"""The kernel every context-parallel and segment test attends through: torch's CPU flash kernel
behind the AttentionKernel contract checks (what CUDA kernels assume), with a log of its calls so a
test can assert that the checked path really ran.

With `varlen=True` it also has the variable-length entry, as torch's CUDA flash kernel calls it
(TorchCudaFlashKernel's own code), through stand-ins for the two aten ops that CPU builds lack:
each runs the CPU flash kernel per sequence and refuses what mha_varlen_fwd/bwd would refuse or
misread, so a CPU test exercises the exact calls a GPU run makes."""
from __future__ import annotations

import torch

from megatron.longseq.attention.kernels import AttentionKernel, TorchCpuFlashKernel, TorchCudaFlashKernel


class ContractKernel(AttentionKernel):
    name = "contract-checked-cpu-flash"

    def __init__(self, counter=None, varlen=False):
        # counter: a CreatedTensors mode to pause inside the kernel (its allocations are not the caller's)
        self.inner, self.calls, self.counter, self.listeners = TorchCpuFlashKernel(), [], counter, []
        self.varlen = varlen  # the stand-ins must be installed (install_flash_varlen_stand_ins)

    def _run(self, kind, fn, *args):
        self.calls.append(kind)
        for listen in self.listeners:
            listen(kind)
        if self.counter is None:
            return fn(*args)
        with self.counter.pause():
            return fn(*args)

    def _forward(self, *args):
        return self._run("F", self.inner._forward, *args)

    def _backward(self, *args):
        return self._run("B", self.inner._backward, *args)

    def _forward_varlen(self, *args):
        return self._run("FV", TorchCudaFlashKernel._forward_varlen, self, *args)

    def _backward_varlen(self, *args):
        return self._run("BV", TorchCudaFlashKernel._backward_varlen, self, *args)


# ---- stand-ins for torch's flash varlen ops ------------------------------------------------------

def _sequences(cu_q, cu_k, max_q, max_k, causal):
    """(query rows, key rows) of every sequence, checked as mha_varlen reads them."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), f"{name}: {cu.dtype} {cu.stride()}"
    assert cu_q.numel() == cu_k.numel() >= 2
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:]):
        assert 0 < b - a <= max_q and 0 < d - c <= max_k, (a, b, c, d, max_q, max_k)
        # flash-attn aligns a causal mask bottom-right, our pieces' top-left: only squares agree
        assert not causal or b - a == d - c, "a causal sequence that is not a square"
        yield slice(a, b), slice(c, d)


def _as_4d(x):
    return x.transpose(0, 1).unsqueeze(0)  # [T, h, d] -> [1, h, T, d]


def flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug_mask, *, scale=None):
    assert q.dim() == k.dim() == v.dim() == 3 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert dropout_p == 0.0 and not debug_mask
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)  # [h, Tq], as mha_varlen_fwd
    for rows, keys in _sequences(cu_q, cu_k, max_q, max_k, causal):
        o, l = TorchCpuFlashKernel()._forward(_as_4d(q[rows]), _as_4d(k[keys]), _as_4d(v[keys]), causal, scale)
        out[rows], lse[:, rows] = o[0].transpose(0, 1), l[0]
    return out, lse, torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), torch.empty(0)


def flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, seed, offset, *,
                    scale=None):
    assert all(x.dim() == 3 and x.stride(-1) == 1 for x in (dout, q, k, v, out)) and dropout_p == 0.0
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, keys in _sequences(cu_q, cu_k, max_q, max_k, causal):
        grads = TorchCpuFlashKernel()._backward(
            _as_4d(dout[rows]), _as_4d(q[rows]), _as_4d(k[keys]), _as_4d(v[keys]), _as_4d(out[rows]),
            lse[:, rows].unsqueeze(0).contiguous(), causal, scale)
        dq[rows], dk[keys], dv[keys] = (g[0].transpose(0, 1) for g in grads)
    return dq, dk, dv


def install_flash_varlen_stand_ins(set_attr) -> None:
    """Put the stand-ins in place of torch.ops.aten's flash varlen ops with `set_attr`
    (pytest's monkeypatch.setattr in a test's own process, setattr in a gloo rank's)."""
    set_attr(torch.ops.aten, "_flash_attention_forward", flash_varlen_forward)
    set_attr(torch.ops.aten, "_flash_attention_backward", flash_varlen_backward)
