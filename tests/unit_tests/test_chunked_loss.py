"""The output layer and the loss a chunk of tokens at a time, against the whole logits: per-token
loss and gradients, vocabulary-parallel over gloo ranks, inside GPTModel, and the logits never whole."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._python_dispatch

from megatron.longseq.chunked_loss import LinearCrossEntropy
from tests.unit_tests.alloc_count import CreatedTensors
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks
from tests.unit_tests.model_utils import tiny_args, tiny_batch, tiny_gpt

N, H, V = 37, 16, 50  # tokens (prime: no chunk size below divides it), hidden, vocabulary


def problem(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(N, H, generator=g, dtype=dtype), torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:3] = torch.tensor([0, V - 1, V // 2])  # the vocabulary's edges and the tp boundary
    grad_loss = torch.rand(N, generator=g, dtype=torch.float32)  # per-token weights, as loss masks give
    return hidden, weight, labels, grad_loss


def whole(hidden, weight, labels, grad_loss):
    """The reference: every logit at once, torch's cross entropy."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy(hidden @ weight.t(), labels, reduction="none")
    loss.backward(grad_loss.to(loss.dtype))
    return loss.detach(), hidden.grad, weight.grad


def chunked(hidden, weight, labels, grad_loss, chunk, group=None):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = LinearCrossEntropy.apply(hidden, weight, labels, group, chunk)
    loss.backward(grad_loss)
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 16, N, 4 * N])
def test_each_chunk_size_gives_the_whole_logits_loss_and_gradients(chunk):
    init_single_rank_world()
    hidden, weight, labels, grad_loss = problem()
    ref = whole(hidden, weight, labels, grad_loss)
    got = chunked(hidden, weight, labels, grad_loss, chunk)
    # float64 throughout except the loss (fp32, as megatron-core's): its ~1e-7 relative rounding
    # of values ~5 bounds the difference; the gradients see the same fp32 lse, hence 1e-6.
    torch.testing.assert_close(got[0], ref[0].float(), atol=5e-6, rtol=0)
    for name, a, b in zip(("hidden", "weight"), got[1:], ref[1:]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


def _vocab_parallel(tp, chunk):
    group = dist.new_group(list(range(tp)))
    rank = dist.get_rank()
    hidden, weight, labels, grad_loss = problem()
    ref = whole(hidden, weight, labels, grad_loss)
    rows = slice(rank * V // tp, (rank + 1) * V // tp)
    loss, grad_hidden, grad_weight = chunked(hidden, weight[rows].contiguous(), labels, grad_loss, chunk, group)
    dist.all_reduce(grad_hidden, group=group)  # what the output layer's input region does in backward
    torch.testing.assert_close(loss, ref[0].float(), atol=5e-6, rtol=0)  # as above
    torch.testing.assert_close(grad_hidden, ref[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_weight, ref[2][rows], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tp", [2, 5])
def test_vocabulary_parallel_ranks_give_the_whole_logits_loss_and_gradients(tp):
    run_ranks(_vocab_parallel, tp, tp, 8)


def _sequence_parallel(tp, chunk):
    """Each rank holds a block of the token rows (and a slice of the vocabulary): the loss of every
    token, the gradient of its own rows (reduce-scattered), and only that block saved for backward."""
    from tests.unit_tests.model_utils import sequence_parallel_on_host

    sequence_parallel_on_host()  # megatron-core's gather buffers at host memory
    group, rank, n = dist.new_group(list(range(tp))), dist.get_rank(), N - N % tp
    hidden, weight, labels, grad_loss = (t[:n] if t.shape[0] == N else t for t in problem())
    ref = whole(hidden, weight, labels, grad_loss)
    share = hidden[rank * n // tp:(rank + 1) * n // tp].clone().requires_grad_()
    part = weight[rank * V // tp:(rank + 1) * V // tp].clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = LinearCrossEntropy.apply(share, part, labels, group, chunk, True)
    loss.backward(grad_loss)
    torch.testing.assert_close(loss, ref[0].float(), atol=5e-6, rtol=0)  # as without sequence parallel
    torch.testing.assert_close(share.grad, ref[1][rank * n // tp:(rank + 1) * n // tp], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(part.grad, ref[2][rank * V // tp:(rank + 1) * V // tp], atol=1e-6, rtol=1e-6)
    matrices = {t.data_ptr() for t in saved if t.dim() == 2}
    assert matrices == {share.data_ptr(), part.data_ptr()}  # not the gathered [n, h]: tp times larger


@pytest.mark.parametrize("tp, chunk", [(2, 5), (5, 64)])  # tp divides V, as the padded vocabulary
def test_sequence_parallel_saves_only_this_ranks_rows(tp, chunk):
    run_ranks(_sequence_parallel, tp, tp, chunk)


def _overlapped_gather():
    """dp 2, the distributed optimizer's gathers in flight as after a step: the loss must wait for
    the output weight's bucket itself (its module's forward, which holds the wait, never runs)."""
    from megatron.longseq import chunked_loss
    from megatron.training.distributed import GradBuffer

    args = tiny_args("--untie-embeddings-and-output-weights --cross-entropy-chunk-tokens 16", world_size=2)
    pgs = grid_groups()
    model = tiny_gpt(args, pgs)
    weight = model.output_layer.weight
    buffer = GradBuffer(list(model.parameters()), pgs.dp_cp_intra, shard=True, overlap=True,
                        bucket_elements=weight.numel())
    buffer.wait_params_before_forward([model])
    bucket = buffer.bucket_of[weight]
    assert bucket.params == [weight]  # alone: no other module's forward waits for it
    waited, real = [], chunked_loss.LinearCrossEntropy.forward
    chunked_loss.LinearCrossEntropy.forward = staticmethod(
        lambda ctx, *inputs: waited.append(bucket.gather is None) or real(ctx, *inputs))
    buffer.all_gather_params(async_op=True)
    assert bucket.gather is not None
    tokens, labels, positions = tiny_batch(args)
    model(tokens, positions, None, labels=labels)
    assert waited == [True]


def test_the_loss_waits_for_the_output_weights_overlapped_gather():
    run_ranks(_overlapped_gather, 2)


def _model_step(extra, dtype_flag=""):
    args = tiny_args(f"{extra} {dtype_flag}")
    model = tiny_gpt(args, grid_groups())
    tokens, labels, positions = tiny_batch(args)
    loss = model(tokens, positions, None, labels=labels)
    loss.float().mean().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", ["", "--untie-embeddings-and-output-weights"])
def test_gpt_model_with_chunks_gives_its_whole_logits_loss_and_gradients(tie):
    init_single_rank_world()
    ref_loss, ref_grads = _model_step(tie)
    loss, grads = _model_step(f"{tie} --cross-entropy-chunk-tokens 7")  # 64 tokens: chunks of 7 and a last of 1
    assert loss.shape == ref_loss.shape == (2, 32)
    # fp32: the same GEMMs on the same rows; only the order of a chunk's weight-gradient sums
    # differs, a few ulps of values <= ~1e-1.
    torch.testing.assert_close(loss, ref_loss, atol=2e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_gpt_model_with_chunks_in_bf16_follows_the_whole_logits():
    init_single_rank_world()
    ref_loss, ref_grads = _model_step("", "--bf16")
    loss, grads = _model_step("--cross-entropy-chunk-tokens 7", "--bf16")
    # The logits are the same bf16 GEMM rows either way and the loss is fp32 of them; the hidden
    # gradients are the same rows of bf16 GEMMs too. Only the output weight's gradient is summed
    # differently: over chunks in fp32, rounded to bf16 once, against one bf16 GEMM, also rounded
    # once. Each is within half a bf16 ulp of the exact sum, so they differ by at most one ulp of
    # the tensor's largest entry (2^-7 of it; near-zero entries carry no relative bound).
    torch.testing.assert_close(loss, ref_loss, atol=2e-6, rtol=0)
    for name, grad in grads.items():
        ref = ref_grads[name].float()
        torch.testing.assert_close(grad.float(), ref, atol=2 ** -7 * ref.abs().max().item(), rtol=0, msg=name)


def test_chunks_never_make_the_whole_logits():
    """No tensor a chunked training step creates is larger than the output weight (here smaller
    than the logits: hidden 32 against 64 tokens); without chunks the step makes [tokens,
    vocabulary] ones, so the check can fail."""
    init_single_rank_world()
    big = {}
    for chunk in (0, 8):
        args = tiny_args(f"--hidden-size 32 --cross-entropy-chunk-tokens {chunk}")
        model = tiny_gpt(args, grid_groups())
        tokens, labels, positions = tiny_batch(args)
        with CreatedTensors() as created:
            model(tokens, positions, None, labels=labels).mean().backward()
        big[chunk] = created.at_least(args.padded_vocab_size * args.hidden_size + 1)
    tokens_vocab = args.micro_batch_size * args.seq_length * args.padded_vocab_size
    assert big[0] and all(numel >= tokens_vocab for _, numel, _ in big[0]), big[0]
    assert not big[8], big[8]


def test_the_backward_makes_one_weight_sized_product_per_chunk():
    """bf16: each chunk's weight gradient (a [V, h] bf16 product) is added into the fp32
    accumulator as it is, cast on the fly; an fp32 copy of it per chunk would double the
    backward's weight-sized memory traffic (a [32000, 4096] one is 0.5 GB a chunk)."""
    init_single_rank_world()
    hidden, weight, labels, grad_loss = (t.bfloat16() if t.is_floating_point() else t for t in problem())
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    loss = LinearCrossEntropy.apply(hidden, weight, labels, None, 8)
    with CreatedTensors() as created:
        loss.backward(grad_loss)
    weight_sized = [c for c in created.created if c[1] == V * H]
    chunks = -(-N // 8)
    # per chunk its product; once the fp32 accumulator and its cast to the weight's dtype
    assert len(weight_sized) == chunks + 2, weight_sized


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run, a boolean index named as such (its kernel counts the mask on the host)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if "index" in str(func) and len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        boolean = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        self.names.append(f"{func} (boolean index)" if boolean else str(func))
        return func(*args, **(kwargs or {}))


def test_no_op_reads_a_device_value_back_to_the_host():
    """On CUDA a boolean index (nonzero) or .item() waits for the device; once per chunk that would
    stall the step. The ops of a forward and backward, recorded on CPU, hold none."""
    init_single_rank_world()
    hidden, weight, labels, grad_loss = problem()
    with _Ops() as ops:
        chunked(hidden, weight, labels, grad_loss, 5)
    host_reads = ("nonzero", "_local_scalar_dense", "masked_select", "boolean index")
    syncing = [n for n in ops.names if any(k in n for k in host_reads)]
    assert ops.names and not syncing, syncing


def test_a_negative_chunk_is_refused():
    from megatron.training.bad_input import ArgsError

    with pytest.raises(ArgsError, match="--cross-entropy-chunk-tokens must be >= 0"):
        tiny_args("--cross-entropy-chunk-tokens -1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_bf16_chunks_follow_the_whole_logits_in_a_fraction_of_the_memory():
    init_single_rank_world()
    n, h, v, chunk = 8192, 512, 32000, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    grad_loss = torch.full((n,), 1.0 / n, device="cuda")

    def peak(step):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    def bf16_whole():  # the output layer's bf16 logits, the loss in fp32 of them
        hd, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = F.cross_entropy((hd @ w.t()).float(), labels, reduction="none")
        loss.backward(grad_loss)
        return loss.detach(), hd.grad, w.grad

    ref, ref_bytes = peak(bf16_whole)
    got, got_bytes = peak(lambda: chunked(hidden, weight, labels, grad_loss, chunk))
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)  # fp32 of the same bf16 logits
    for a, b in zip(got[1:], ref[1:]):  # bf16 gradients: within a bf16 ulp of the larger
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=2 ** -7)
    # whole: bf16 and fp32 logits and their gradient, n*v*(2+4+4+2) bytes; chunked: one chunk's
    assert ref_bytes > 8 * n * v and got_bytes < 4 * n * v, (ref_bytes, got_bytes)


def test_the_start_up_line_says_what_the_logits_take():
    """128K tokens and a 32000 vocabulary in bf16: 131072 x 32000 x (2 + 4) bytes = 23.44 GiB whole,
    the chunk's share with chunks; Seq1F1B's longest segment and cp divide the tokens."""
    from types import SimpleNamespace

    from megatron.training.model import logits_line

    args = SimpleNamespace(micro_batch_size=1, segment_lengths=[131072], padded_vocab_size=32000,
                           tensor_model_parallel_size=1, bf16=True, fp16=False, cross_entropy_chunk_tokens=0)
    assert logits_line(args, 1) == ("> logits: 131072 tokens x 32000 vocabulary: 23.44 GiB "
                                    "(--cross-entropy-chunk-tokens 8192 would hold 1.46 GiB)")
    args.cross_entropy_chunk_tokens = 8192
    assert logits_line(args, 1) == "> logits: 8192 of 131072 tokens at a time x 32000 vocabulary: 1.46 GiB"
    args.cross_entropy_chunk_tokens, args.segment_lengths, args.tensor_model_parallel_size = 0, [512, 256], 2
    assert logits_line(args, 2) == "> logits: 256 tokens x 16000 vocabulary: 0.02 GiB"
