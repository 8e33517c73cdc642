"""Receives posted ahead against a device-wide synchronize.

On NCCL a receive waits on its link's stream for its send, and a device synchronize on a rank (the
caching allocator frees its cache with cudaFree when an allocation fails) waits for every receive
that rank has posted. The model: one rank stops inside its i-th operation -- the sends of its
operations before i are out, nothing after -- while every other rank runs on as far as the
dependencies let it. Every receive the stopped rank has posted must then still be sent, or the
pipeline hangs; and a receive is posted as early as that allows, so messages still land ahead.
"""
import pytest
import torch

from megatron.longseq.pipeline import p2p, seq1f1b
from megatron.longseq.pipeline.simulate import dependencies


def _runs_while_stopped(ops, v, k, rank, i):
    """Every operation that completes while `rank` stays inside its i-th one, as (kind, vs, unit)."""
    p, done = len(ops), set()
    ends = [i if r == rank else len(row) for r, row in enumerate(ops)]
    at = [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < ends[r] and all(d in done for d in dependencies(ops[r][at[r]], r, p, v, k)):
                op = ops[r][at[r]]
                done.add((op.kind, op.chunk * p + r, op.unit))
                at[r], moved = at[r] + 1, True
    return done


class _Recorder:
    """Stands in for dist.irecv: notes at which operation each receive is posted."""

    def __init__(self):
        self.posted, self.now = [], 0

    def irecv(self, buf, src, group):
        self.posted.append(self.now)
        return type("Done", (), {"wait": lambda self: None})()


def _posting(schedule, rank, sender, purpose, monkeypatch):
    """Run `rank`'s list against the real Inbox (schedule = (p, m, k, v, forward_only)): the
    operation at which each message's receive was posted, and per operation, while it computes,
    the message whose receive is outstanding and the next one not yet posted."""
    p, m, k, v, forward_only = schedule
    ops = seq1f1b._stage_ops(p, m, k, v, None, forward_only)
    recorder = _Recorder()
    monkeypatch.setattr(p2p.dist, "irecv", recorder.irecv)
    needs = seq1f1b._needs_of(p, m, k, v, None, forward_only, rank)
    points = p2p.receive_points(ops[sender], needs[sender], p, sender, v, purpose)
    box = p2p.Inbox(None, sender, iter(points), lambda key: (1,), torch.float32, torch.device("cpu"))
    states = []
    for i, op in enumerate(ops[rank]):
        recorder.now = i
        box.advance(i)
        vs, last = op.chunk * p + rank, p * v - 1
        if (purpose, op.kind) in (("act", "F"), ("grad", "B")) and vs != (0 if purpose == "act" else last):
            box.get((op.chunk, *op.unit))
        states.append((box.posted and box.posted[0], box.upcoming and box.upcoming[0]))
    return dict(zip([key for key, _ in points], recorder.posted)), states


def _sender_op(ops, p, v, sender, purpose, key):
    (j,) = [j for sent, j in p2p.sent_messages(ops[sender], p, sender, v, purpose) if sent == key]
    op = ops[sender][j]
    return (op.kind, op.chunk * p + sender, op.unit)


CASES = [(2, 4, 1, 1), (4, 4, 1, 1), (4, 8, 2, 1), (3, 4, 4, 1), (2, 4, 2, 2), (4, 8, 1, 2), (4, 4, 4, 2)]


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("p,m,k,v", CASES)
def test_a_device_synchronize_on_any_stage_finds_every_posted_receive_sent(p, m, k, v, forward_only, monkeypatch):
    ops = seq1f1b._stage_ops(p, m, k, v, None, forward_only)
    for rank in range(p):
        for purpose, sender in (("act", (rank - 1) % p), ("grad", (rank + 1) % p)):
            _, states = _posting((p, m, k, v, forward_only), rank, sender, purpose, monkeypatch)
            for i, (outstanding, upcoming) in enumerate(states):
                sent = _runs_while_stopped(ops, v, k, rank, i)
                if outstanding:  # safe: its send goes out while this rank stands still
                    assert _sender_op(ops, p, v, sender, purpose, outstanding) in sent, (rank, i, purpose)
                elif upcoming:  # and not later than that: the next one could not have been posted
                    assert _sender_op(ops, p, v, sender, purpose, upcoming) not in sent, (rank, i, purpose)


def test_the_first_gradient_of_a_1f1b_is_received_only_after_the_warm_up(monkeypatch):
    """Stage 0 of four: the gradient of micro-batch 0 comes back only after the activations of
    micro-batches 0-2 have gone out -- a receive posted at the start would hang a device
    synchronize during any warm-up forward, where the activation memory peaks."""
    posted_at, _ = _posting((4, 4, 1, 1, False), 0, 1, "grad", monkeypatch)
    ops = seq1f1b._stage_ops(4, 4, 1, 1, None, False)
    assert [str(op) for op in ops[0][:4]] == ["F0:0.0", "F0:1.0", "F0:2.0", "F0:3.0"]
    assert posted_at[(0, 0, 0)] == 3


class _Send:
    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done

    def wait(self):
        self.done = True


def test_a_finished_send_is_let_go_at_the_next_send(monkeypatch):
    """A stage's output is sent and then lives on in the Outbox only until its send is done: held
    to the end of the iteration it would outlive its backward (one activation per micro-batch)."""
    sends = []
    monkeypatch.setattr(p2p.dist, "isend", lambda t, dst, group: sends.append(_Send()) or sends[-1])
    box = p2p.Outbox(None, 1, "activations")
    first, second, third = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)
    box.send(first)
    box.send(second)  # the first still in flight: kept
    assert [t.data_ptr() for t, _ in box.pending] == [first.data_ptr(), second.data_ptr()]
    sends[0].done = True
    box.send(third)
    assert [t.data_ptr() for t, _ in box.pending] == [second.data_ptr(), third.data_ptr()]
    box.flush()
    assert box.pending == [] and all(s.done for s in sends)
