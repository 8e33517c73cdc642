"""The kernel every context-parallel and segment test attends through: torch's CPU flash kernel
behind the AttentionKernel contract checks (what CUDA kernels assume), with a log of its calls so a
test can assert that the checked path really ran."""
from __future__ import annotations

from megatron.longseq.attention.kernels import AttentionKernel, TorchCpuFlashKernel


class ContractKernel(AttentionKernel):
    name = "contract-checked-cpu-flash"

    def __init__(self, counter=None):
        # counter: a CreatedTensors mode to pause inside the kernel (its allocations are not the caller's)
        self.inner, self.calls, self.counter, self.listeners = TorchCpuFlashKernel(), [], counter, []

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
