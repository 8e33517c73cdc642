"""MEMO in the trainer (memo_setup): the host memory it takes, profiling included, stays within
--memo-host-memory-gb; a budget too small is refused before any is taken."""
import pytest
import torch

from megatron.longseq.memo.alpha import HostMemoryError, LayerProfile, block_bytes
from megatron.longseq.memo.streams import HOST, reset_host_peak
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world
from tests.unit_tests.model_utils import tiny_args

MODEL = ("--num-layers 5 --group-query-attention --num-query-groups 2 --position-embedding-type rope "
         "--swiglu --normalization RMSNorm --memo --memo-planner greedy")


def _setup(budget_bytes):
    import pretrain_gpt
    from megatron.training.memo_setup import setup_memo
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup

    init_single_rank_world()
    args = tiny_args(f"{MODEL} --memo-host-memory-gb {budget_bytes / 2**30!r}")
    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    return setup_memo(args, pgs, state, pretrain_gpt.forward_step, torch.device("cpu"))


def _needs():
    """Host bytes the tiny model needs at alpha 0 and 1, from the runtime's own measure."""
    from megatron.longseq.memo.runtime import Memo
    from tests.unit_tests.model_utils import lm_loss, tiny_gpt

    init_single_rank_world()
    args = tiny_args(MODEL)
    model = tiny_gpt(args, grid_groups())
    memo = Memo(0.0, torch.device("cpu"))
    memo.wrap(model.decoder.layers)
    sizes = memo.measure(lambda: lm_loss(model, args).backward())
    p = LayerProfile.largest(sizes, forward_seconds=1.0)  # time plays no part in host bytes
    return memo.peak_live * block_bytes(p, 0.0), memo.peak_live * block_bytes(p, 1.0)


def test_a_budget_between_alpha_0_and_1_is_never_exceeded_profiling_included():
    low, high = _needs()
    budget = (low + high) // 2
    reset_host_peak()
    before = HOST["now"]
    memo = _setup(budget)
    assert 0.0 < memo.alpha < 1.0  # the host budget, not bandwidth, bounds alpha here
    assert memo.pool.memory.numel() <= budget
    assert HOST["peak"] - before <= budget  # the bandwidth probe and the pool, never together over


def test_a_budget_too_small_is_refused_before_any_host_memory_is_taken():
    low, _ = _needs()
    reset_host_peak()
    before = HOST["now"]
    with pytest.raises(HostMemoryError, match="even at alpha = 0"):
        _setup(low // 2)
    assert HOST["peak"] == before  # nothing was pinned: not the probe, not the pool


def _stage_setup(flags):
    import pretrain_gpt
    from megatron.training.memo_setup import setup_memo
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup

    args = tiny_args(f"{MODEL} --num-layers 6 --pipeline-model-parallel-size 2 {flags}", world_size=2)
    pgs = grid_groups(pp=2)
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    return setup_memo(args, pgs, state, pretrain_gpt.forward_step, torch.device("cpu"))


def _check_plans_per_stage(tmp):
    import json
    import os

    import torch.distributed as dist

    _stage_setup(f"--memo-save-plan {tmp}/plan.json")
    dist.barrier()
    files = {stage: f"{tmp}/plan.stage{stage}.json" for stage in (0, 1)}
    assert sorted(os.listdir(tmp)) == ["plan.stage0.json", "plan.stage1.json"]
    marks = {stage: {label.split()[-1] for label, _ in json.load(open(path))["replay"]["marks"]}
             for stage, path in files.items()}
    assert marks == {0: {"L1", "L2", "L3"}, 1: {"L4"}}  # stage 1 keeps its last two layers
    alpha = json.load(open(files[0]))["planned_for"]["memo_swap_fraction"]
    assert json.load(open(files[1]))["planned_for"]["memo_swap_fraction"] == alpha  # the stages agreed
    # each stage reuses its own, at its alpha: the LP's answer may differ run to run (it is timed)
    assert _stage_setup(f"--memo-plan {tmp}/plan.json").alpha == alpha
    dist.barrier()
    if dist.get_rank() == 0:  # the two stages' files swapped
        os.rename(files[0], f"{tmp}/swap")
        os.rename(files[1], files[0])
        os.rename(f"{tmp}/swap", files[1])
    dist.barrier()
    with pytest.raises(ValueError) as refused:
        _stage_setup(f"--memo-plan {tmp}/plan.json")
    mine = f"--memo-plan: {files[dist.get_rank()]} was planned for other layers"
    assert str(refused.value).startswith(mine) and "another model or pipeline stage; plan again" in str(refused.value)


def test_a_pipelined_run_saves_and_reuses_one_plan_per_stage(tmp_path):
    """--memo-save-plan on two pipeline stages writes each stage's plan (its own layers' windows),
    --memo-plan gives each stage its own back, and a stage handed another's plan stops, on every
    rank, in one line before training."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_check_plans_per_stage, 2, str(tmp_path))


def test_the_planned_allocators_trace_runs_with_the_collector_off(monkeypatch):
    """As the profiler's trace: a cycle's frees landing wherever the collector happens to run
    would make lifetimes the replays do not repeat (each a divergence served by the cache)."""
    import gc
    from types import SimpleNamespace

    from megatron.training import memo_setup

    seen = []
    planned = SimpleNamespace(record=lambda on: seen.append(("record", on)), recorded_trace=lambda: "trace")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert gc.isenabled()
    got = memo_setup._trace(lambda: seen.append(("collecting", gc.isenabled())), [], torch.device("cuda"), planned)
    assert got == "trace" and seen == [("record", True), ("collecting", False), ("record", False)]
    assert gc.isenabled()


def test_no_plan_is_made_for_the_caching_allocator(monkeypatch, capsys):
    """With torch's caching allocator and no --memo-save-plan nothing would use the plan: no trace
    iteration, no solver."""
    from megatron.training import memo_setup

    def unused(*args, **kwargs):
        raise AssertionError("a plan was made that nothing uses")
    monkeypatch.setattr(memo_setup, "_trace", unused)
    monkeypatch.setattr(memo_setup, "bilevel_plan", unused)
    _, high = _needs()
    _setup(2 * high)
    assert "MEMO memory plan: none made" in capsys.readouterr().out


def test_a_plan_is_reused_only_by_the_run_it_was_made_for(tmp_path):
    """A plan records the settings its request sizes depend on: another --seq-length, vocabulary or
    output layer, or a fixed --memo-swap-fraction other than the plan's, is one line at validation;
    'auto' takes the plan's."""
    from megatron.longseq.memo.planner import bilevel_plan
    from megatron.longseq.memo.trace import Trace
    from megatron.training.arguments import ArgsError
    from megatron.training.validate_memo import planned_for

    path = tmp_path / "plan.json"
    bilevel_plan(Trace([("malloc", "a", 512)]), "greedy").save(str(path), planned_for(tiny_args(MODEL), 0.25))
    for flags in ("", "--memo-swap-fraction 0.25"):
        assert tiny_args(f"{MODEL} --memo-plan {path} {flags}").memo_plan == str(path)
    refusals = {"--seq-length 64 --max-position-embeddings 64": "--seq-length 32 (this run: 64)",
                "--memo-swap-fraction 0.5": "--memo-swap-fraction 0.25 (this run: 0.5)",
                # the logits' rows and the output layer are in the plan too
                "--vocab-size 8000": "the padded vocabulary 256 (this run: 8064)",
                "--untie-embeddings-and-output-weights": "--untie-embeddings-and-output-weights False (this run: True)"}
    for flags, said in refusals.items():
        with pytest.raises(ArgsError) as refused:
            tiny_args(f"{MODEL} --memo-plan {path} {flags}")
        assert str(refused.value) == f"--memo-plan: {path} was planned for {said}: plan again for this run"
    bilevel_plan(Trace([("malloc", "a", 512)]), "greedy").save(str(path), None)
    with pytest.raises(ArgsError, match="was planned for no run of --memo it records"):
        tiny_args(f"{MODEL} --memo-plan {path}")


def test_memo_setup_puts_every_rng_stream_back():
    """The profile iterations draw attention dropout (the tracker's stream) and the profiler's
    inputs (torch's default stream): left advanced, the run with --memo drifted from the same run
    without it from its first iteration (loss by 1.5e-4 relative with --attention-dropout 0.1)."""
    import pretrain_gpt
    from megatron.longseq.random import rng_state_dict, seed_everything
    from megatron.training.memo_setup import setup_memo
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup

    init_single_rank_world()
    args = tiny_args(f"{MODEL} --attention-dropout 0.1 --memo-swap-fraction 0.5")
    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    seed_everything(1234, 0, torch.device("cpu"))  # as initialize_distributed
    before = rng_state_dict()
    setup_memo(args, pgs, state, pretrain_gpt.forward_step, torch.device("cpu"))
    after = rng_state_dict()
    assert torch.equal(after["torch_rng_state"], before["torch_rng_state"])
    assert after["random_rng_state"] == before["random_rng_state"]
    assert all(torch.equal(after["rng_tracker_states"][k], v) for k, v in before["rng_tracker_states"].items())


def test_memo_counts_the_layers_of_the_chunks_it_manages():
    """Two layers over 2 stages x 2 chunks with the embedding and the loss counted as layers: the
    last chunk holds none, so MEMO manages both (a check of layers per chunk refused it)."""
    args = tiny_args("--memo --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
                     "--pipe-sp-splits 2 --global-batch-size 4", world_size=2)
    assert args.memo and args.virtual_pipeline_chunks == 2
    assert tiny_args("--memo --num-layers 3").memo  # the first layer is managed


@pytest.mark.parametrize("layout, world", [
    ("", 1), ("--pipeline-model-parallel-size 2 --num-layers 6", 2),
    ("--pipeline-model-parallel-size 2 --num-layers 6 --decoder-first-pipeline-num-layers 4", 2),
    ("--pipeline-model-parallel-size 2 --num-layers 6 --decoder-last-pipeline-num-layers 1", 2),
    ("--pipeline-model-parallel-size 3 --num-layers 7 --decoder-first-pipeline-num-layers 1", 3),
    ("--pipeline-model-parallel-size 2 --num-layers 6 --num-virtual-stages-per-pipeline-rank 2 "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --global-batch-size 4", 2),
    ("--num-layers 4 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 1),
    ("--pipeline-model-parallel-size 2 --num-layers 7 --account-for-loss-in-pipeline-split", 2),
])
def test_memos_count_of_the_last_chunk_is_megatron_cores(layout, world):
    """validate_memo counts the last chunk's layers before any model exists: the count megatron-core
    builds (model.chunk_layers) for every way of splitting."""
    from megatron.training.model import chunk_layers, transformer_config
    from megatron.training.validate_memo import _last_chunk_layers

    args = tiny_args(layout, world)
    last_stage, last_chunk = args.pipeline_model_parallel_size - 1, args.virtual_pipeline_chunks - 1
    last = chunk_layers(transformer_config(args), last_stage, last_chunk)
    assert _last_chunk_layers(args) == last
