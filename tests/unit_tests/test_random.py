"""The RNG streams: megatron-core's modules draw from the same tracker as ours, a fork inside a fork
of the same stream goes on drawing from it, and recompute replays both."""
import torch

from megatron.longseq.random import MODEL_PARALLEL_RNG, checkpoint, get_rng_tracker, seed_everything

CPU = torch.device("cpu")


def test_megatron_cores_tracker_is_ours_and_seeded():
    """Under --sequence-parallel megatron-core forks its tracker around the transformer block and
    the embedding's dropout; unseeded, that raised at the first forward."""
    from megatron.core import tensor_parallel

    seed_everything(11, tp_rank=1, device=CPU)
    theirs = tensor_parallel.get_cuda_rng_tracker()
    assert theirs is get_rng_tracker() and theirs.is_initialized()
    with theirs.fork():
        drawn = torch.rand(4)
    seed_everything(11, tp_rank=1, device=CPU)
    with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
        assert torch.equal(torch.rand(4), drawn)


def test_a_fork_inside_a_fork_of_the_same_stream_goes_on_drawing():
    """megatron-core's block-level fork (sequence parallel) around our attention's dropout fork:
    the inner one must not restart the stream (the same mask twice), and leaving it must not lose
    the outer one's draws."""
    seed_everything(3, tp_rank=0, device=CPU)
    tracker = get_rng_tracker()
    with tracker.fork():
        a = torch.rand(4)
        with tracker.fork():
            b = torch.rand(4)
        c = torch.rand(4)
    seed_everything(3, tp_rank=0, device=CPU)
    with get_rng_tracker().fork():
        assert torch.equal(torch.cat([a, b, c]), torch.rand(12))  # one stream, drawn in order
    assert get_rng_tracker().active is None


def _dropped(x):
    with get_rng_tracker().fork():
        return torch.nn.functional.dropout(x, 0.5) * 3


def test_recompute_inside_an_open_fork_replays_the_forward_masks():
    """A recomputed layer whose forward ran inside a block-level fork: its backward (outside any
    fork) replays the masks the forward drew, so the gradient equals the one kept without recompute."""
    grads = []
    for recompute in (False, True):
        seed_everything(5, tp_rank=0, device=CPU)
        x = torch.ones(64, requires_grad=True)
        with get_rng_tracker().fork():
            torch.rand(3)  # the block's earlier layers drew from the stream
            y = checkpoint(_dropped, x) if recompute else _dropped(x)
        y.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]) and 0 < int((grads[0] == 0).sum()) < 64
