"""The pipeline's point-to-point order against a model of NCCL on GPUs, where gloo cannot hang.

Each stage's real executor (seq1f1b._Runner, p2p.Inbox and Outbox) runs alone in this process with
recording stand-ins for dist.isend / dist.irecv and for its model chunks: what it issues, in order,
is its host program -- post a receive, send, wait for a message, compute. The programs of all
stages then run on a model of the GPUs:
- a message is done once its send and its receive have both started (an activation is far larger
  than NCCL's buffers: neither side finishes alone);
- each link is its own two-rank communicator with one stream: a link's message n starts only after
  its message n - 1 is done on that end;
- an NCCL op starts only after the compute issued before it (torch makes the link's stream wait
  for the caller's); a wait holds the compute stream until its message is done;
- the queues: one per stream, or one per GPU for every stream (CUDA_DEVICE_MAX_CONNECTIONS=1,
  which the GPU launchers set): there an op that cannot start holds back all issued after it.
A program that cannot finish is a hang. The hosts never block (on NCCL, wait() only orders
streams), except in a device-wide synchronize, which waits for everything issued so far: modelled
as one stage's program cut after any item, which must then finish with the others running on.
"""
from types import SimpleNamespace

import pytest
import torch

from megatron.longseq.pipeline import p2p
from megatron.longseq.pipeline.plan import ScheduleError, check
from megatron.longseq.pipeline.seq1f1b import Pipeline, forward_backward_seq1f1b

HIDDEN, MBS = 2, 1


class _Work:
    def __init__(self, program, item):
        self.program, self.item = program, item

    def is_completed(self):
        return False  # the host cannot tell on NCCL without a query; nothing is issued on it

    def wait(self):
        self.program.append(("WAIT", *self.item[1:]))


class _Recorder:
    """dist.isend / dist.irecv of one stage: each call becomes ("SEND"|"POST", link, n), n counting
    the link's messages (NCCL matches a pair's sends and receives in order)."""

    def __init__(self):
        self.program, self.count = [], {}

    def _issue(self, kind, group):
        n = self.count.get((kind, group), 0)
        self.count[(kind, group)] = n + 1
        item = (kind, group, n)
        self.program.append(item)
        return _Work(self.program, item)

    def isend(self, tensor, dst, group):
        return self._issue("SEND", group)

    def irecv(self, tensor, src, group):
        return self._issue("POST", group)


class _Compute(torch.autograd.Function):
    """Identity that notes its forward and backward as compute in the stage's program."""

    @staticmethod
    def forward(ctx, x, program):
        ctx.program = program
        program.append(("COMPUTE",))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.program.append(("COMPUTE",))
        return grad, None


class _Chunk(torch.nn.Module):
    def __init__(self, program):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.program, self.input = program, None
        self.config = SimpleNamespace(calculate_per_token_loss=False, no_sync_func=None,
                                      finalize_model_grads_func=None)

    def set_input_tensor(self, tensor):
        self.input = tensor

    def forward(self, tokens):
        # [b, n] -> [n, b, h]: the activation layout between stages
        x = self.input
        if x is None:
            x = torch.ones(tokens.shape[1], MBS, HIDDEN, device=self.weight.device)
        return _Compute.apply(x * self.weight, self.program)


def _step(data_iterator, chunk):
    output = chunk(next(data_iterator)["tokens"])
    return output, lambda out: (out.sum(), {"lm loss": out.sum().detach()})


def stage_program(p, m, k, v, group, rank, monkeypatch):
    """The items stage `rank` issues in one training iteration, from the real executor."""
    recorder = _Recorder()
    monkeypatch.setattr(p2p.dist, "isend", recorder.isend)
    monkeypatch.setattr(p2p.dist, "irecv", recorder.irecv)
    links = {(purpose, src, dst): f"{purpose}:{src}->{dst}" for purpose in ("act", "grad")
             for src in range(p) for dst in range(p)}
    pipe = Pipeline(p, rank, v, [4] * k, HIDDEN, links, list(range(p)), group=group)
    data = iter([{"tokens": torch.zeros(MBS, 4 * k)}] * m)
    forward_backward_seq1f1b(forward_step_func=_step, data_iterator=data,
                             model=[_Chunk(recorder.program) for _ in range(v)], num_microbatches=m,
                             micro_batch_size=MBS, p2p_communicator=pipe)
    return recorder.program


class _Gpus:
    """The stages' programs on the GPU model (module docstring)."""

    def __init__(self, programs, one_queue: bool):
        self.started, self.done, self.computed = set(), set(), [0] * len(programs)
        self.queues = {}
        for rank, program in enumerate(programs):
            computes = 0  # compute items issued before this one
            for item in program:
                stream = "compute" if item[0] in ("COMPUTE", "WAIT") else item[:2]
                self.queues.setdefault((rank, "gpu" if one_queue else stream), []).append((item, computes))
                computes += item[0] in ("COMPUTE", "WAIT")
        self.heads = dict.fromkeys(self.queues, 0)

    def _can_start(self, rank, item, computes) -> bool:
        kind = item[0]
        if kind == "WAIT":
            return item[1:] in self.done
        if kind in ("SEND", "POST"):
            link, n = item[1:]
            behind = n == 0 or (link, n - 1) in self.done
            return behind and self.computed[rank] >= computes
        return True

    def _start(self, rank, item) -> None:
        if item[0] in ("COMPUTE", "WAIT"):
            self.computed[rank] += 1
        else:
            self.started.add(item)
            other = "POST" if item[0] == "SEND" else "SEND"
            if (other, *item[1:]) in self.started:
                self.done.add(item[1:])

    def run(self) -> list:
        """Per stage, whether its program finishes (every item started, every message done)."""
        moved = True
        while moved:
            moved = False
            for queue, items in self.queues.items():
                while self.heads[queue] < len(items) and self._can_start(queue[0], *items[self.heads[queue]]):
                    self._start(queue[0], items[self.heads[queue]][0])
                    self.heads[queue] += 1
                    moved = True
        return [self._finished(rank) for rank in range(len(self.computed))]

    def _finished(self, rank: int) -> bool:
        mine = [(queue, items) for queue, items in self.queues.items() if queue[0] == rank]
        return all(self.heads[queue] == len(items) for queue, items in mine) and all(
            item[1:] in self.done for _, items in mine for item, _ in items if item[0] in ("SEND", "POST"))


def hangs(programs):
    """The first way the programs cannot finish, or None."""
    for one_queue in (True, False):
        if not all(_Gpus(programs, one_queue).run()):
            return "one hardware queue" if one_queue else "a queue per stream"
    for rank, program in enumerate(programs):
        for cut in range(1, len(program)):
            stopped = programs[:rank] + [program[:cut]] + programs[rank + 1:]
            if not _Gpus(stopped, False).run()[rank]:
                return f"a device synchronize on stage {rank} after item {cut}"
    return None


def programs(p, m, k, v, group, monkeypatch):
    return [stage_program(p, m, k, v, group, rank, monkeypatch) for rank in range(p)]


def _valid(p, m, k, v) -> bool:
    try:
        check(p, m, k, v)
    except ScheduleError:  # m x k units not a multiple of the interleaved group: refused by validate
        return False
    return True


ACCEPTED = [(p, m, k, v) for p in (2, 3, 4) for m in (p, 2 * p) for k in (1, 2, 4) for v in (1, 2)
            if _valid(p, m, k, v)]


@pytest.mark.parametrize("p,m,k,v", ACCEPTED)
def test_schedules_accepted_on_nccl_cannot_hang(p, m, k, v, monkeypatch):
    """Interleaved groups of the pipeline's size (what validate allows on CUDA) and plain 1F1B,
    with and without Seq1F1B segments."""
    progs = programs(p, m, k, v, None, monkeypatch)
    assert all(any(item[0] == "SEND" for item in prog) for prog in progs)
    assert hangs(progs) is None


def test_groups_larger_than_the_pipeline_can_hang_on_nccl(monkeypatch):
    """Why validate refuses them on CUDA: 2 stages, 2 chunks, 4 segments in groups of 4 units.
    Stage 0's gradient send of segment 1 is queued on its link behind segment 2's, which stage 1
    receives only after segment 3's; stage 1's activation send is queued behind one that stage 0
    receives after the stuck send."""
    progs = programs(2, 2, 4, 2, 4, monkeypatch)
    assert hangs(progs) == "one hardware queue"
    assert hangs(programs(2, 2, 4, 2, None, monkeypatch)) is None  # groups of 2 units: no hang
