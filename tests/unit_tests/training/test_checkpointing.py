"""Atomic saves (a crash never damages the last good checkpoint) and complete loads."""
import os

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.checkpointing import TRACKER, load_checkpoint, read_tracker, save_checkpoint
from megatron.training.model import unwrap
from megatron.training.training import setup
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world
from tests.unit_tests.model_utils import lm_loss, tiny_args, tiny_gpt


def make_state(tmp_path, extra="", precision="--bf16"):
    init_single_rank_world()
    args = tiny_args(f"--save {tmp_path} --load {tmp_path} {precision} {extra}")
    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    return args, pgs, state


def train_one_step(state, args):
    state.optimizer.zero_grad()
    lm_loss(state.model[0], args).backward()
    state.optimizer.buffer.finish_grad_sync()
    state.optimizer.step()
    state.scheduler.step(args.global_batch_size)
    state.iteration += 1
    state.consumed_train_samples += args.global_batch_size


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    args, pgs, state = make_state(tmp_path)
    train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    good = {k: v.clone() for k, v in state.model[0].state_dict().items() if torch.is_tensor(v)}
    train_one_step(state, args)

    real_save = checkpointing.atomic_torch_save

    def crash(obj, path):
        with open(path + ".part", "wb") as f:
            f.write(b"half a checkpoint")  # the process dies in the middle of a write
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpointing, "atomic_torch_save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(args, state, pgs)
    assert read_tracker(str(tmp_path)) == 1
    assert not os.path.exists(tmp_path / "iter_0000002")  # only iter_0000002.tmp was touched

    # A fresh run resumes from iteration 1 with the weights saved then.
    _, _, fresh = make_state(tmp_path)
    assert load_checkpoint(args, fresh, pgs)
    assert fresh.iteration == 1 and fresh.consumed_train_samples == args.global_batch_size
    for key, value in fresh.model[0].state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, good[key]), key

    monkeypatch.setattr(checkpointing, "atomic_torch_save", real_save)
    save_checkpoint(args, state, pgs)  # the next save clears the leftovers and lands
    assert read_tracker(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000002", TRACKER]


def test_a_crash_while_saving_an_iteration_again_keeps_the_first_copy(tmp_path, monkeypatch):
    """A requeued run that finished saves its last iteration again (the tracker already names it):
    the old copy is moved aside, not deleted, until the new one is in place, and a load finds it
    if the save died in between."""
    args, pgs, state = make_state(tmp_path)
    train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    good = {k: v.clone() for k, v in state.model[0].state_dict().items() if torch.is_tensor(v)}
    real_rename = os.rename

    def crash_on_publish(src, dst):
        if src.endswith(".tmp"):
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(checkpointing.os, "rename", crash_on_publish)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(args, state, pgs)
    monkeypatch.setattr(checkpointing.os, "rename", real_rename)
    assert read_tracker(str(tmp_path)) == 1 and not os.path.exists(tmp_path / "iter_0000001")
    _, _, fresh = make_state(tmp_path)
    assert load_checkpoint(args, fresh, pgs) and fresh.iteration == 1
    assert all(torch.equal(v, good[k]) for k, v in fresh.model[0].state_dict().items() if torch.is_tensor(v))
    save_checkpoint(args, state, pgs)  # lands, and the copy moved aside goes
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", TRACKER]


def test_load_restores_model_optimizer_schedule_and_position(tmp_path):
    args, pgs, state = make_state(tmp_path)
    for _ in range(2):
        train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    train_one_step(state, args)
    after_a = lm_loss(state.model[0], args, seed=5).item()

    _, _, resumed = make_state(tmp_path)
    load_checkpoint(args, resumed, pgs)
    assert resumed.scheduler.num_steps == state.scheduler.num_steps - args.global_batch_size
    train_one_step(resumed, args)
    assert lm_loss(resumed.model[0], args, seed=5).item() == after_a  # the same third step


def test_finetune_loads_the_model_only(tmp_path):
    """--finetune: the weights, and a fresh start from them (Megatron's rule)."""
    args, pgs, state = make_state(tmp_path)
    for _ in range(2):
        train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    tuned_args, _, tuned = make_state(tmp_path, "--finetune")
    assert load_checkpoint(tuned_args, tuned, pgs)
    assert (tuned.iteration, tuned.consumed_train_samples, tuned.scheduler.num_steps) == (0, 0, 0)
    assert not tuned.optimizer.optimizer.state  # no Adam moments carried over
    for key, value in state.model[0].state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(tuned.model[0].state_dict()[key], value), key


def test_load_rejects_a_different_model(tmp_path):
    args, pgs, state = make_state(tmp_path)
    save_checkpoint(args, state, pgs)
    other_args, _, other = make_state(tmp_path, "--ffn-hidden-size 128")
    with pytest.raises(ValueError, match="checkpoint has ffn_hidden_size=256 but this run has 128"):
        load_checkpoint(other_args, other, pgs)


def test_tracker_with_garbage_is_an_error(tmp_path):
    (tmp_path / TRACKER).write_text("banana\n")
    with pytest.raises(ValueError, match="expected an iteration number or 'release'"):
        read_tracker(str(tmp_path))
    assert read_tracker(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("flag, lr", [("", None), ("--use-checkpoint-opt_param-scheduler", 1e-3),
                                      ("--override-opt_param-scheduler", 2e-3)])
def test_schedule_settings_on_load_as_megatron_chooses_them(tmp_path, flag, lr):
    """A run resumed with another --lr: refused by default (one line saying how to choose), the
    checkpoint's settings with --use-checkpoint-opt_param-scheduler, this run's with --override."""
    args, pgs, state = make_state(tmp_path, "--lr 1e-3")
    train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    args2, _, resumed = make_state(tmp_path, f"--lr 2e-3 --ckpt-format torch {flag}")
    if lr is None:  # at start-up, before load_checkpoint is reached
        from megatron.training.training import check_load

        with pytest.raises(ValueError, match="--lr 0.002 here, 0.001 in the checkpoint.*: pass --use-checkpoint"):
            check_load(args2, pgs)
        return
    load_checkpoint(args2, resumed, pgs)
    assert resumed.scheduler.max_lr == lr


def write_megatron_checkpoint(root, directory, state, args, tracker, te_names=False):
    """Megatron-LM's torch layout, from the facts of its checkpointing.py: <dir>/iter_XXXXXXX (or
    release)/mp_rank_00/model_optim_rng.pt holding the argparse Namespace `args` (consumed samples
    inside), checkpoint_version 3.0, iteration, model, optimizer, opt_param_scheduler, rng_state (a
    list of per-replica dicts) and num_floating_point_operations_so_far. `te_names`: as Transformer
    Engine layers (Megatron-LM's GPU default) name the norms, with an _extra_state per module."""
    import argparse
    import random

    import numpy as np

    namespace = argparse.Namespace(**{k: getattr(args, k) for k in checkpointing.MUST_MATCH},
                                   group_query_attention=False, consumed_train_samples=24, consumed_valid_samples=8)
    namespace.num_query_groups = 1  # Megatron's default, meaningless without GQA
    # Written on a GPU: CUDA generator states (seed and offset, 16 bytes), which a CPU run cannot take.
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": cuda_state,
           "rng_tracker_states": {"model-parallel-rng": cuda_state.clone()}}
    path = root / directory / "mp_rank_00"
    path.mkdir(parents=True)
    torch.save({"args": namespace, "checkpoint_version": 3.0, "iteration": 3,
                "model": (_te_named if te_names else dict)(state.model[0].module.state_dict()),
                "optimizer": megatron_core_optimizer(unwrap(state.model), args)[0].state_dict(),
                "opt_param_scheduler": state.scheduler.state_dict(), "rng_state": [rng],
                "num_floating_point_operations_so_far": 123.0}, path / "model_optim_rng.pt")
    (root / TRACKER).write_text(tracker)


def test_megatron_torch_checkpoint_loads(tmp_path):
    """Weights, optimizer, iteration, data position, FLOPs and the host RNG streams from Megatron's
    own layout; a release starts at 0."""
    args, pgs, state = make_state(tmp_path, "--ckpt-format torch")
    train_one_step(state, args)
    write_megatron_checkpoint(tmp_path, "iter_0000003", state, args, "3")
    after_rng = torch.rand(2)
    args2, _, fresh = make_state(tmp_path, "--ckpt-format torch")
    assert load_checkpoint(args2, fresh, pgs)
    # its fp32 copies of the (bf16) weights it was handed
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.buffer.param_data.float())
    assert torch.equal(torch.rand(2), after_rng)
    draws()  # the tensor-parallel stream keeps this run's seeding: the checkpoint's is a CUDA state
    assert (fresh.iteration, fresh.consumed_train_samples, fresh.consumed_valid_samples, fresh.flops_so_far) == (
        3, 24, 8, 123.0)
    for key, value in state.model[0].state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(fresh.model[0].state_dict()[key], value), key

    release = tmp_path / "rel"
    write_megatron_checkpoint(release, "release", state, args, "release", te_names=True)
    args3, _, fresh = make_state(release, "--ckpt-format torch")
    assert load_checkpoint(args3, fresh, pgs) and fresh.iteration == 0 and fresh.consumed_train_samples == 0
    assert torch.equal(fresh.optimizer.buffer.param_data, state.optimizer.buffer.param_data)  # released weights


def test_a_transformer_engine_model_reads_its_own_names():
    """The renaming is for a model of local layers; Transformer Engine's layers keep theirs (and
    their _extra_state, which their load reads)."""
    te_model = torch.nn.Linear(1, 1)  # no input_layernorm: its norms live in its linears
    saved = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 1, "x._extra_state": None}
    assert checkpointing._in_model_names(te_model, saved) is saved
    local = torch.nn.Module()
    local.input_layernorm = torch.nn.LayerNorm(1)
    assert checkpointing._in_model_names(local, saved) == {"decoder.layers.0.input_layernorm.weight": 1}


def _te_named(model: dict) -> dict:
    fused = {f".{n}.weight": f".{m}.layer_norm_weight" for n, m in (("input_layernorm", "self_attention.linear_qkv"),
                                                                     ("pre_mlp_layernorm", "mlp.linear_fc1"))}
    renamed = {next((k.replace(a, b) for a, b in fused.items() if k.endswith(a)), k): v for k, v in model.items()}
    assert len([k for k in renamed if k.endswith("layer_norm_weight")]) == 2 * 2  # two layers' two norms
    return {**renamed, "decoder.layers.0.self_attention.linear_qkv._extra_state": None}


# ---- the distributed optimizer in Megatron's layout (distrib_optim.pt) --------------------------
def megatron_core_buffer(params, bucket_size, dp_group=None):
    """megatron-core's own _ParamAndGradBuffer with the distributed optimizer over `params`, built
    on the host (its storage asks torch.cuda for a device); dp_group: this rank's by default."""
    from types import SimpleNamespace
    from unittest import mock

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    pgs = grid_groups()
    dp_group = dp_group or pgs.dp_cp
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    with mock.patch("torch.cuda.current_device", lambda: "cpu"):
        return _ParamAndGradBuffer(config, params[0].dtype, torch.float32, params, dp_group, bucket_size,
                                   {p: str(i) for i, p in enumerate(params)}, 1.0, list(range(len(params))),
                                   False, pg_collection=SimpleNamespace(tp=pgs.tp, dp_cp=dp_group))


def megatron_core_coalesced(params, bucket_size):
    """Each parameter's range in Megatron's coalesced tensors, from megatron-core's own buffer."""
    # stand-ins: megatron-core's buffer moves its parameters' storage into its own
    copies = [torch.nn.Parameter(torch.empty_like(p)) for p in params]
    for copy, p in zip(copies, params):
        copy.shared_embedding = getattr(p, "shared_embedding", False)
    stand_ins = dict(zip(copies, params))
    buffer = megatron_core_buffer(copies, bucket_size)
    before = [sum(b.numel_unpadded for b in buffer.buckets[:i]) for i in range(len(buffer.buckets))]
    ranges = {}
    for copy, (start, end, b) in buffer.param_index_map.items():
        shift = before[b] - buffer.bucket_indices[b][0]  # bucket-end padding of earlier buckets removed
        ranges[stand_ins[copy]] = (start + shift, end + shift)
    return ranges, buffer.numel_unpadded


@pytest.mark.parametrize("bucket_size", [None, 400, 1])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-embedding"])
def test_coalesced_layout_is_megatron_cores_buffer(bucket_size, shared):
    """Alignment of every parameter start to 64, bucket closing, the shared embedding's own
    bucket: the same ranges as megatron-core's buffer."""
    from megatron.training.megatron_optim import coalesced_ranges

    init_single_rank_world()
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 7, 300, 65, 1, 500, 64)]
    params[0].shared_embedding = shared
    assert coalesced_ranges(params, bucket_size) == megatron_core_coalesced(params, bucket_size)


def write_megatron_distrib_optim(rank_dir, state, steps):
    """distrib_optim.pt and the optimizer entry as Megatron's DistributedOptimizer saves them, laid
    out by megatron-core's buffer (one bucket: Megatron without --overlap-grad-reduce)."""
    params = [p for p in state.model[0].parameters() if p.requires_grad]
    ranges, numel = megatron_core_coalesced(params, None)
    flats, offsets = state.optimizer.model_space_state(), state.optimizer.buffer.offsets
    world = {key: torch.zeros(numel) for key in ("param", "exp_avg", "exp_avg_sq")}
    for p in params:
        for key, ours in (("param", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            world[key][slice(*ranges[p])] = flats[ours][offsets[p] : offsets[p] + p.numel()]
    torch.save({"buckets_coalesced": True, 0: {(torch.bfloat16, torch.float32): {**world, "numel_unpadded": numel}}},
               os.path.join(rank_dir, "distrib_optim.pt"))
    groups = [{"wd_mult": w, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "step": steps}
              for w in (1.0, 0.0)]
    return {"optimizer": {"param_groups": groups}}


def test_megatrons_distributed_optimizer_checkpoint_resumes_exactly(tmp_path):
    """A torch-format checkpoint with Megatron's distrib_optim.pt (laid out by megatron-core's
    buffer): the resumed step equals the uninterrupted one bit for bit (fp32 main params and Adam
    moments carried, bias correction from the groups' step)."""
    flags = "--ckpt-format torch --use-distributed-optimizer"
    args, pgs, state = make_state(tmp_path, flags)
    for _ in range(2):
        train_one_step(state, args)
    write_megatron_checkpoint(tmp_path, "iter_0000003", state, args, "3")
    rank_dir = tmp_path / "iter_0000003" / "mp_rank_00"
    saved = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
    saved["optimizer"] = write_megatron_distrib_optim(rank_dir, state, steps=2)
    torch.save(saved, rank_dir / "model_optim_rng.pt")
    train_one_step(state, args)

    _, _, fresh = make_state(tmp_path, flags)
    assert load_checkpoint(args, fresh, pgs) and fresh.optimizer.adam_steps() == 2
    train_one_step(fresh, args)
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.main_data)
    assert torch.equal(fresh.optimizer.buffer.param_data, state.optimizer.buffer.param_data)


def test_our_distributed_optimizer_checkpoint_has_megatrons_layout(tmp_path):
    """What Megatron's loader reads: distrib_optim.pt coalesced per chunk under (param dtype, grad
    dtype) with megatron-core's element count; param groups told apart by its identifier keys, in
    its order, each with Adam's step. Resuming from it is exact, and a run without the
    distributed optimizer is refused in one line."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    args, pgs, state = make_state(tmp_path, "--ckpt-format torch --use-distributed-optimizer")
    for _ in range(2):
        train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    rank_dir = tmp_path / "iter_0000002" / "mp_rank_00"
    assert sorted(os.listdir(rank_dir)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    world = torch.load(rank_dir / "distrib_optim.pt", weights_only=False)
    params = [p for p in state.model[0].parameters() if p.requires_grad]
    _, numel = megatron_core_coalesced(params, None)
    assert world["buckets_coalesced"] is True and list(world[0]) == [(torch.bfloat16, torch.float32)]
    entry = world[0][(torch.bfloat16, torch.float32)]
    assert entry["numel_unpadded"] == numel and {k: v.shape for k, v in entry.items() if k != "numel_unpadded"} == {
        "param": (numel,), "exp_avg": (numel,), "exp_avg_sq": (numel,)}
    groups = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]  # Megatron's order: the default group first
    assert all(set(param_group_identifier_keys) <= set(g) and g["step"] == 2 and "params" not in g for g in groups)

    train_one_step(state, args)
    _, _, fresh = make_state(tmp_path, "--ckpt-format torch --use-distributed-optimizer")
    load_checkpoint(args, fresh, pgs)
    train_one_step(fresh, args)
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.main_data)
    plain_args, _, plain = make_state(tmp_path, "--ckpt-format torch")
    with pytest.raises(ValueError, match="was saved with --use-distributed-optimizer, this run differs"):
        load_checkpoint(plain_args, plain, pgs)


def megatron_core_optimizer(chunks, args):
    """megatron-core's own non-distributed optimizer over `chunks`, for its state_dict() and
    load_state_dict(): groups and their order from its _get_param_groups; with bf16 parameters
    Float16OptimizerWithFloat16Params over fp32 copies, else FP32Optimizer. Their constructors
    allocate CUDA tensors, so the objects are assembled on the host with the attributes those two
    methods read."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    config = OptimizerConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=args.bf16)
    groups = _get_param_groups(chunks, config, None)
    if not args.bf16:
        core = object.__new__(FP32Optimizer)
    else:
        core = object.__new__(Float16OptimizerWithFloat16Params)
        core.fp32_from_float16_groups = [[p.detach().float() for p in g["params"]] for g in groups]
        groups = [{**g, "params": mains} for g, mains in zip(groups, core.fp32_from_float16_groups)]
        core.grad_scaler = None
    core.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2))
    core.config = config
    return core, [p for g in _get_param_groups(chunks, config, None) for p in g["params"]]


@pytest.mark.parametrize("precision", ["--bf16", ""], ids=["bf16", "fp32"])
def test_megatrons_non_distributed_optimizer_state_both_ways(tmp_path, precision):
    """Ours loads in megatron-core's optimizer (its load_state_dict) with every parameter's main
    value and Adam moments where they belong; what megatron-core's state_dict() writes from it,
    loaded here, resumes bit for bit."""
    args, pgs, state = make_state(tmp_path, "--ckpt-format torch", precision)
    for _ in range(2):
        train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    file = tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    obj = torch.load(file, weights_only=False)
    core, params = megatron_core_optimizer(unwrap(state.model), args)
    core.load_state_dict(obj["optimizer"])

    ours, offsets = state.optimizer.model_space_state(), state.optimizer.buffer.offsets
    mains = [m for g in core.optimizer.param_groups for m in g["params"]]
    for p, main in zip(params, mains):
        piece = slice(offsets[p], offsets[p] + p.numel())
        assert torch.equal(main.detach().flatten(), ours["fp32_param"][piece])
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(core.optimizer.state[main][name].flatten(), ours[name][piece])
        assert int(core.optimizer.state[main]["step"]) == 2

    obj["optimizer"] = core.state_dict()  # as megatron-core writes it
    torch.save(obj, file)
    train_one_step(state, args)
    _, _, fresh = make_state(tmp_path, "--ckpt-format torch", precision)
    load_checkpoint(args, fresh, pgs)
    train_one_step(fresh, args)
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.main_data)
    assert torch.equal(fresh.optimizer.buffer.param_data, state.optimizer.buffer.param_data)


# What Megatron-LM's load_checkpoint reads from model_optim_rng.pt besides the model and optimizer
# (facts of its checkpointing.py): check_checkpoint_args compares these attributes of `args` (the
# vocabulary ones when it has a vocab file; the layout from checkpoint version 3.0 on) ...
MEGATRON_COMPARED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                     "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                     "tensor_model_parallel_size", "pipeline_model_parallel_size")
# ... and each entry of the rng_state list has these keys (cuda_rng_state too where CUDA ran).
MEGATRON_RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"}


def test_our_torch_checkpoint_reads_as_megatrons_loader_reads_it(tmp_path):
    """torch.load with its default weights_only=True (megatron-core registers the classes it
    allows, argparse.Namespace among them) reads both files; `args` is a Namespace of every
    argument with the data position inside; the RNG state is Megatron's list, its tracker holding
    megatron-core's three streams; and this trainer resumes from it exactly."""
    import argparse

    from megatron.core.safe_globals import register_safe_globals
    from megatron.core.tensor_parallel import random as core_random

    register_safe_globals()  # as importing megatron.core does in Megatron-LM

    args, pgs, state = make_state(tmp_path, "--ckpt-format torch --use-distributed-optimizer")
    for _ in range(2):
        train_one_step(state, args)
    draws()  # every stream moves past where a fresh run's seeding leaves it
    save_checkpoint(args, state, pgs)
    rank_dir = tmp_path / "iter_0000002" / "mp_rank_00"
    obj = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu")
    torch.load(rank_dir / "distrib_optim.pt", map_location="cpu")
    saved = obj["args"]
    assert isinstance(saved, argparse.Namespace) and obj["checkpoint_version"] == 3.0 and obj["iteration"] == 2
    assert {k: getattr(saved, k) for k in MEGATRON_COMPARED} == {k: getattr(args, k) for k in MEGATRON_COMPARED}
    assert (saved.consumed_train_samples, saved.consumed_valid_samples) == (state.consumed_train_samples, 0)
    assert {"model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far"} <= set(obj)
    [rng] = obj["rng_state"]
    assert set(rng) == MEGATRON_RNG_KEYS  # a CPU run: no CUDA state (Megatron-LM needs --no-load-rng)
    assert set(rng["rng_tracker_states"]) == {core_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                                              core_random._DATA_PARALLEL_RNG_TRACKER_NAME,
                                              core_random._EXPERT_PARALLEL_RNG_TRACKER_NAME}

    train_one_step(state, args)
    after = draws()
    _, _, fresh = make_state(tmp_path, "--ckpt-format torch --use-distributed-optimizer")
    load_checkpoint(args, fresh, pgs)
    assert fresh.consumed_train_samples == saved.consumed_train_samples
    train_one_step(fresh, args)
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.main_data)
    assert draws() == after  # python, numpy, torch and the tensor-parallel stream continue where they were


def draws() -> tuple:
    """One number from each stream a run draws from."""
    import random

    import numpy as np

    from megatron.longseq.random import get_rng_tracker

    with get_rng_tracker().fork():
        tp_stream = torch.rand(1).item()
    return random.random(), np.random.rand(), torch.rand(1).item(), tp_stream


def test_param_groups_in_megatrons_order_with_decoupled_lr():
    """Megatron sorts its groups by their overrides, none first: default, decoupled LR (max_lr,
    min_lr), decoupled LR without weight decay, then no weight decay."""
    from types import SimpleNamespace

    from megatron.training.megatron_optim import megatron_param_groups

    args = SimpleNamespace(lr=1e-3, min_lr=0.0, decoupled_min_lr=1e-5)
    ours = [{"params": [], "wd_mult": w, **({"max_lr": 5e-3, "min_lr": 1e-5} if own else {})}
            for w, own in ((1.0, False), (0.0, False), (1.0, True), (0.0, True))]  # GROUP_ORDER
    groups = megatron_param_groups(ours, args, steps=7)
    assert [(g["wd_mult"], g["max_lr"], g["default_config"]) for g in groups] == [
        (1.0, 1e-3, True), (1.0, 5e-3, False), (0.0, 5e-3, False), (0.0, 1e-3, True)]
    assert all(g["step"] == 7 and g["lr_mult"] == 1.0 and "params" not in g for g in groups)


@pytest.mark.parametrize("written_on, run_on, device_streams_taken", [
    ("cuda", "cuda", True), ("cpu", "cuda", False), ("cuda", "cpu", False), ("cpu", "cpu", True)])
def test_rng_state_takes_device_streams_only_from_the_same_kind_of_device(monkeypatch, written_on, run_on,
                                                                         device_streams_taken):
    """The CUDA state and the tracker's streams are generator states of the device that wrote
    them: a run on the other kind keeps its own seeded ones (a CUDA state cannot drive the CPU
    generator, nor the reverse); the host streams are always taken. torch.cuda's generator
    calls are stood in for by a recorder, so the CUDA side is checked on any machine."""
    from megatron.longseq import random as ls_random

    cuda_state, set_calls = torch.full((16,), 7, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: set_calls.append(state))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: None)
    written_tracker = ls_random.RNGTracker(torch.device(written_on))
    written_tracker.states = {"model-parallel-rng": torch.full((3,), 1, dtype=torch.uint8)}
    monkeypatch.setattr(ls_random, "_TRACKER", written_tracker)
    saved = ls_random.rng_state_dict()
    assert ("cuda_rng_state" in saved) == (written_on == "cuda")

    own = {"model-parallel-rng": torch.full((3,), 2, dtype=torch.uint8)}
    run_tracker = ls_random.RNGTracker(torch.device(run_on))
    run_tracker.states = dict(own)
    monkeypatch.setattr(ls_random, "_TRACKER", run_tracker)
    torch.manual_seed(123)  # the host stream moves; loading puts it back
    ls_random.load_rng_state_dict(saved)
    assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"])
    taken = torch.equal(run_tracker.states["model-parallel-rng"], written_tracker.states["model-parallel-rng"])
    assert taken == device_streams_taken
    assert len(set_calls) == (1 if device_streams_taken and run_on == "cuda" else 0)


def test_non_distributed_save_copies_no_whole_model_state(tmp_path, monkeypatch):
    """Without the distributed optimizer a save reads each parameter's state in place and copies
    it to the host alone: the three whole-model fp32 buffers of model_space_state (which a
    sharded state needs, to gather it) would be device memory a tight run does not have."""
    from megatron.training.optimizer import DistributedAdam

    args, pgs, state = make_state(tmp_path, "--ckpt-format torch")
    train_one_step(state, args)

    def forbidden(self):
        raise AssertionError("a whole-model copy of the optimizer state")

    monkeypatch.setattr(DistributedAdam, "model_space_state", forbidden)
    save_checkpoint(args, state, pgs)
    saved = torch.load(tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert all(t.device.type == "cpu" for group in saved["optimizer"]["fp32_from_fp16_params"] for t in group)


def test_non_distributed_state_of_other_groups_is_one_line(tmp_path):
    """--decoupled-lr moves the embedding into a group of its own: the saved groups no longer hold
    this run's parameters, which is said before anything is loaded into the optimizer."""
    args, pgs, state = make_state(tmp_path, "--ckpt-format torch")
    train_one_step(state, args)
    save_checkpoint(args, state, pgs)
    other, _, fresh = make_state(tmp_path, "--ckpt-format torch --decoupled-lr 1e-2")
    with pytest.raises(ValueError, match=r"optimizer groups hold \[\d+, \d+\] parameters, this model's .*--decoupled-lr"):
        load_checkpoint(other, fresh, pgs)


def _check_the_sharded_state_is_whole_on_the_writer_only(tmp_dir):
    import torch.distributed as dist

    from megatron.training.optimizer import DistributedAdam

    args = tiny_args(f"--save {tmp_dir} --load {tmp_dir} --bf16 --ckpt-format torch --use-distributed-optimizer",
                     world_size=2)
    pgs = grid_groups()

    def build():
        return setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    state = build()
    train_one_step(state, args)
    kept, whole = [], DistributedAdam.model_space_state
    DistributedAdam.model_space_state = lambda self, keep=True: kept.append(whole(self, keep)) or kept[-1]
    save_checkpoint(args, state, pgs)
    DistributedAdam.model_space_state = whole
    assert len(kept) == 1 and (kept[0] is not None) == (dist.get_rank() == 0)
    train_one_step(state, args)
    fresh, taken, read = build(), [], checkpointing.from_megatron
    checkpointing.from_megatron = lambda *a: taken.append(read(*a)) or taken[-1]
    load_checkpoint(args, fresh, pgs)
    checkpointing.from_megatron = read
    n_params = len(list(fresh.model[0].parameters()))
    assert taken[0].keys() == fresh.optimizer.fragments_of.keys() and len(taken[0]) < n_params
    train_one_step(fresh, args)
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.main_data)


def test_a_torch_format_save_gathers_the_sharded_state_whole_on_its_writer_only(tmp_path):
    """distrib_optim.pt is written by data-parallel rank 0 alone: the others take part in the
    gathers and keep nothing (12 bytes a parameter of host memory each, on every rank of a node);
    a load takes the parameters its shard touches only, and the two-rank run resumes exactly."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_check_the_sharded_state_is_whole_on_the_writer_only, 2, str(tmp_path))
