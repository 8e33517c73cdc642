"""The executor's contract on one stage (megatron-core's forward_backward_* semantics): gradients
equal the full-batch gradient in both loss conventions, with and without Seq1F1B segments."""
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron.longseq.pipeline import seq1f1b
from megatron.longseq.pipeline.seq1f1b import Pipeline, forward_backward_seq1f1b
from tests.unit_tests.dist_utils import init_single_rank_world

S = 6


class Model(torch.nn.Module):
    def __init__(self, per_token):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 1)
        self.syncs, self.finalized = [], []
        self.config = SimpleNamespace(calculate_per_token_loss=per_token, no_sync_func=self._no_sync,
                                      finalize_model_grads_func=self._finalize)

    def set_input_tensor(self, tensor):
        assert tensor is None  # one stage: the first

    def _no_sync(self):
        self.syncs.append("off")
        return torch.enable_grad()

    def _finalize(self, models, num_tokens):
        self.finalized.append(None if num_tokens is None else int(num_tokens))
        if num_tokens is not None:
            for p in self.parameters():
                p.grad /= num_tokens

    def forward(self, x):
        return self.proj(x).squeeze(-1) ** 2  # per-token losses [b, s]


def data(num_mb=3):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, S, 4, generator=g) for _ in range(num_mb)]
    masks = [(torch.rand(2, S, generator=g) > 0.3).float() for _ in range(num_mb)]
    masks[0][0] = 0  # micro-batches with different token counts
    return xs, masks


def loss_func(mask, out):
    total = (out * mask).sum()
    return total, mask.sum().to(torch.int64), {"lm loss": torch.stack([total.detach(), mask.sum()])}


def step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["x"]), partial(loss_func, batch["mask"])


def run(per_token, segments=(S,), forward_only=False):
    init_single_rank_world()
    xs, masks = data()
    model = Model(per_token)
    pipe = Pipeline(1, 0, 1, list(segments), 4, {}, [0])
    reports = forward_backward_seq1f1b(forward_step_func=step, data_iterator=iter({"x": x, "mask": m} for x, m in zip(xs, masks)),
                                       model=[model], num_microbatches=3, micro_batch_size=2,
                                       forward_only=forward_only, p2p_communicator=pipe)
    return model, reports, xs, masks


@pytest.mark.parametrize("segments", [(S,), (4, 2), (2, 2, 2)], ids=["k1", "k2", "k3"])
@pytest.mark.parametrize("per_token", [False, True])
def test_gradients_equal_the_full_batch_loss(per_token, segments):
    model, reports, xs, masks = run(per_token, segments)
    ref = Model(per_token)
    if per_token:  # one mean over every token of the batch
        loss = sum((ref(x) * m).sum() for x, m in zip(xs, masks)) / sum(m.sum() for m in masks)
    else:  # Megatron's default: the mean over micro-batches of each micro-batch's token mean
        loss = sum((ref(x) * m).sum() / m.sum() for x, m in zip(xs, masks)) / 3
    loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6)
    k = len(segments)
    assert model.syncs == ["off"] * (3 * k - 1)  # sync disabled for all but the last backward
    assert len(reports) == 3  # one report per micro-batch, summed over its segments
    assert [int(r["lm loss"][1]) for r in reports] == [int(m.sum()) for m in masks]
    total_tokens = int(sum(m.sum() for m in masks))
    assert model.finalized == [total_tokens if per_token else None]


def test_a_loss_returned_as_a_mean_weights_unequal_segments_by_their_tokens():
    """A (loss, report) loss function (the segment's mean over its tokens) under segments of 4 and
    2 tokens: the gradient is the whole sequence's mean, not the mean of the two segment means."""
    init_single_rank_world()
    xs, _ = data()

    def mean_step(data_iterator, model):
        out = model(next(data_iterator)["x"])
        return out, lambda o: (o.mean(), {"lm loss": torch.stack([o.mean().detach(), torch.tensor(1.0)])})
    model, ref = Model(False), Model(False)
    forward_backward_seq1f1b(forward_step_func=mean_step, data_iterator=iter({"x": x} for x in xs), model=[model],
                             num_microbatches=3, micro_batch_size=2,
                             p2p_communicator=Pipeline(1, 0, 1, [4, 2], 4, {}, [0]))
    (sum(ref(x).mean() for x in xs) / 3).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6)


def test_a_report_of_one_value_is_the_sequence_mean_over_unequal_segments():
    """Segments of 4 and 2 tokens, each reporting its mean: the micro-batch's report is the
    sequence's mean (each segment weighted by its tokens), as one unsegmented call would report."""
    init_single_rank_world()
    xs, _ = data()

    def mean_step(data_iterator, model):
        out = model(next(data_iterator)["x"])
        return out, lambda o: (o.mean(), {"lm loss": o.mean().detach()})
    model = Model(False)
    reports = forward_backward_seq1f1b(forward_step_func=mean_step, data_iterator=iter({"x": x} for x in xs),
                                       model=[model], num_microbatches=3, micro_batch_size=2,
                                       p2p_communicator=Pipeline(1, 0, 1, [4, 2], 4, {}, [0]))
    with torch.no_grad():
        whole = [model(x).mean() for x in xs]
    torch.testing.assert_close(torch.stack([r["lm loss"] for r in reports]), torch.stack(whole))


def test_a_micro_batch_with_every_token_masked_adds_nothing():
    """All EOD under --eod-mask-loss: the sequence's token count is 0, and the loss it backprops is
    0 with zero gradients (as megatron-core's clamp), not 0/0 = NaN in every gradient."""
    w = torch.ones(3, requires_grad=True)
    per_token = w.sum() * torch.ones(2, 8)
    mask = torch.zeros(2, 8)
    segments = {s: ((per_token[s] * mask[s]).sum(), mask[s].sum().long(), {}) for s in range(2)}
    runner = SimpleNamespace(losses={0: segments}, config=SimpleNamespace(calculate_per_token_loss=False), m=2)
    loss = sum(seq1f1b._Runner._loss_to_backprop(runner, 0, s) for s in range(2))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(w.grad, torch.zeros(3))


def test_forward_only_makes_no_gradients():
    model, reports, _, _ = run(False, forward_only=True)
    assert all(p.grad is None for p in model.parameters())
    assert model.finalized == [] and len(reports) == 3


@pytest.mark.parametrize("recording", [True, False])
def test_timeline_ready_waits_for_the_input_on_gpu(monkeypatch, recording):
    """On GPU a receive's wait returns before the data is there (it orders streams): a recorded
    timeline's `ready` is read after the compute stream is drained, and only while recording. Never
    a device synchronize: it would also wait for the receives posted ahead, whose senders may be
    waiting for this rank (a hang under NCCL)."""
    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: order.append("device synchronize"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(
        synchronize=lambda: order.append("compute stream")))
    monkeypatch.setattr(seq1f1b.time, "time", lambda: order.append("clock") or 1.0)
    runner = SimpleNamespace(pipe=SimpleNamespace(record_timeline=recording))
    seq1f1b._Runner._mark_ready(runner)
    assert order == (["compute stream", "clock"] if recording else ["clock"]) and runner.ready == 1.0


@pytest.mark.parametrize("pinned", [True, False])
def test_segments_of_a_pinned_batch_stay_pinned(monkeypatch, pinned):
    """Micro-batch 2 cut into 2 segments: every per-token slice is a copy (columns of [b, s]), and
    a copy of a pinned batch is pinned, or its copy to the GPU could stall the host."""
    pinning = []
    # the loader's whole-sequence tensors are pinned (or not); the slices are what the executor makes
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: pinned and t.dim() > 1 and t.shape[1] == S)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinning.append(t.shape) or t)
    run(False, segments=(4, 2))
    # 3 micro-batches x 2 segments x (x [2, n, 4], mask [2, n])
    assert len(pinning) == (12 if pinned else 0)


def _iteration_gradient(args, pgs, step) -> torch.Tensor:
    from megatron.longseq.random import seed_everything
    from megatron.training.data import random_batches
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup

    seed_everything(args.seed, pgs.index("tp"), torch.device("cpu"))
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    forward_backward_seq1f1b(forward_step_func=step, data_iterator=random_batches(args, pgs, seed=0),
                             model=state.model, num_microbatches=args.num_microbatches,
                             micro_batch_size=args.micro_batch_size, p2p_communicator=state.pipeline)
    buffer = state.optimizer.buffer
    buffer.gather_flat(buffer.grad_data)  # the gradient reduced over dp x cp, whole on every rank
    return buffer.grad_data.clone()


def _two_part_loss_under_context_parallelism():
    import pretrain_gpt
    from tests.unit_tests.dist_utils import run_groups
    from tests.unit_tests.model_utils import tiny_args

    def as_a_mean(data_iterator, model):  # pretrain_gpt's loss in the (loss, report) form
        output, loss_func = pretrain_gpt.forward_step(data_iterator, model)

        def mean(out):  # this rank's sum over the sequence's tokens (the whole cp group's)
            scaled_sum, tokens, report = loss_func(out)
            return scaled_sum / args.context_parallel_size / tokens, report
        return output, mean

    args = tiny_args("--position-embedding-type rope --global-batch-size 2 --context-parallel-size 2 "
                     "--pipe-sp-splits 2", world_size=2)
    pgs = run_groups(args)
    three = _iteration_gradient(args, pgs, pretrain_gpt.forward_step)
    two = _iteration_gradient(args, pgs, as_a_mean)
    torch.testing.assert_close(two, three, rtol=1e-5, atol=1e-7)  # fp32: two orders of one sum


def test_a_loss_returned_as_a_mean_is_scaled_by_context_parallelism_as_megatron_core_does():
    """megatron-core multiplies a (loss, report) loss by the cp size before the dp x cp average of
    the gradients: without it, cp 2 would train on half the gradient (the clip and the weight decay
    balance silently off)."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_two_part_loss_under_context_parallelism, 2)
