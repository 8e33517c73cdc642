"""MEMO's token-wise swap/recompute: the same loss and gradients as keeping every activation."""
import gc

import pytest
import torch

from megatron.longseq.memo.runtime import Memo
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world
from tests.unit_tests.model_utils import lm_loss, tiny_args, tiny_gpt

CASES = {
    "mha-learned": "--num-layers 4",
    "gqa-rope-swiglu-rms": ("--num-layers 5 --group-query-attention --num-query-groups 2 --position-embedding-type rope "
                            "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights"),
}


def iteration(args, alpha):
    model = tiny_gpt(args, grid_groups())
    memo = None
    if alpha is not None:
        memo = Memo(alpha, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()})
        memo.wrap(model.decoder.layers)
    loss = lm_loss(model, args)
    loss.backward()
    del loss
    gc.collect()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, memo


@pytest.mark.parametrize("case", CASES)
def test_every_alpha_gives_the_same_gradients(case):
    init_single_rank_world()
    args = tiny_args(CASES[case])
    reference, _ = iteration(args, None)
    offloaded, recomputed = [], []
    for alpha in (0.0, 0.25, 0.5, 1.0):
        grads, memo = iteration(args, alpha)
        for name, grad in grads.items():
            # The recompute runs the same per-token ops on fewer rows; on CPU the results are
            # bitwise those of the full rows. 1e-6 relative allows a BLAS that blocks rows
            # differently (a GPU, say) without hiding a wrong splice.
            torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-9, msg=f"alpha {alpha}: {name}")
        assert memo.stats["layers"] == args.num_layers - 2  # the last two layers keep theirs
        assert memo.host_bytes == 0  # every host copy released with its layer's saved tensors
        offloaded.append(memo.stats["offloaded_bytes"])
        recomputed.append(memo.stats["recomputed_tokens"])
    tokens = args.seq_length * (args.num_layers - 2)
    assert recomputed == [tokens, tokens * 3 // 4, tokens // 2, 0]
    assert offloaded == sorted(offloaded) and offloaded[0] > 0  # alpha 0 still offloads input + attention


def test_eval_forward_is_untouched():
    init_single_rank_world()
    args = tiny_args(CASES["mha-learned"])
    model = tiny_gpt(args, grid_groups())
    memo = Memo(0.5, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()})
    memo.wrap(model.decoder.layers)
    with torch.no_grad():
        lm_loss(model, args)
    assert memo.stats["layers"] == 0 and memo.host_bytes == 0


def test_layer_states_are_freed_after_backward():
    import weakref

    from megatron.longseq.memo import runtime

    init_single_rank_world()
    args = tiny_args(CASES["mha-learned"])
    states = []
    original = runtime.LayerState.forward

    def tracking(self):
        states.append(weakref.ref(self))
        return original(self)

    runtime.LayerState.forward = tracking
    try:
        iteration(args, 0.5)
    finally:
        runtime.LayerState.forward = original
    gc.collect()
    alive = [s for s in states if s() is not None and s() is not s().memo.last]
    assert len(states) == 2 and not alive  # only the runtime's pointer to the last layer may remain
