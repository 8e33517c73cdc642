"""--load checked at start-up, before anything is built: the recorded model against the run's
flags, the format, and agreement between ranks (each reads its own tracker and files)."""
import os

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.checkpointing import save_checkpoint
from tests.unit_tests.model_utils import tiny_args
from tests.unit_tests.training.test_checkpointing import make_state


def _check_ranks_agree_on_the_tracker(root):
    import torch.distributed as dist
    from megatron.training.arguments import ArgsError
    from megatron.training.training import check_load
    from tests.unit_tests.dist_utils import grid_groups

    args, pgs = tiny_args(f"--load {root}", world_size=2), grid_groups()
    # this rank's process only: two nodes' views of one tracker file
    checkpointing.read_tracker = lambda _: checkpointing.RELEASE if dist.get_rank() == 0 else 7
    with pytest.raises(ArgsError, match=r"the ranks read different checkpoints from .* \(release, 7\)"):
        check_load(args, pgs)


def _one_rank_cannot_read_its_files(root):
    import torch.distributed as dist
    from megatron.training import training
    from megatron.training.arguments import ArgsError
    from tests.unit_tests.dist_utils import grid_groups

    args, pgs = tiny_args(f"--load {root}", world_size=2), grid_groups()
    training.same_tracker_everywhere = lambda root: None
    training.loaded_checkpoint = lambda args: os.path.join(args.load, "iter_0000007")
    training.checkpoint_format = lambda path, args: "torch"

    def recorded(path, pgs):  # a torch-format checkpoint whose second tp file is missing
        if dist.get_rank() == 1:
            raise ValueError(f"{path} has no mp_rank_01/model_optim_rng.pt")
        return {}
    training.recorded_args, training.check_args = recorded, lambda recorded, args: None
    with pytest.raises(ArgsError, match=r"^rank 1: --load .*: .* has no mp_rank_01/model_optim_rng.pt$"):
        training.check_load(args, pgs)  # on rank 0 too, which read its own file


def test_a_problem_one_rank_finds_under_load_stops_every_rank_with_its_reason(tmp_path):
    """Rank 0, which prints the one line, must not go on to fail later for another reason."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_one_rank_cannot_read_its_files, 2, str(tmp_path))


def test_ranks_that_read_different_trackers_stop_before_loading(tmp_path):
    """Every rank reads the tracker itself; a rank shown an older copy by a shared file system
    would load another checkpoint than the rest: a one-line error on every rank instead."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_check_ranks_agree_on_the_tracker, 2, str(tmp_path))


def saved_state(tmp_path, fmt, extra=""):
    """A checkpoint in `fmt` of the tiny model (`extra` flags) at iteration 0 (10 iterations of 2
    samples planned): its (args, pgs, state)."""
    from megatron.training.dist_ckpt import CheckpointSaver

    args, pgs, state = make_state(tmp_path, f"{extra} --ckpt-format {fmt}")
    if fmt == "torch_dist":
        saver = CheckpointSaver(args, pgs, torch.device("cpu"))
        saver.save(state)
        saver.finish(blocking=True)
    else:
        save_checkpoint(args, state, pgs)
    return args, pgs, state


def _saved(tmp_path, fmt):
    return saved_state(tmp_path, fmt)[:2]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_changed_schedule_is_one_line_before_anything_is_built(tmp_path, fmt):
    """A longer --train-iters on resume moves the LR decay and the weight-decay span (both in
    samples); megatron-core's scheduler would assert after the model is built. Said at start-up,
    with both ways out; either flag, or --finetune / --no-load-optim (a new schedule), lets it load."""
    from megatron.training.arguments import ArgsError
    from megatron.training.training import check_load

    _, pgs = _saved(tmp_path, fmt)
    longer = f"--load {tmp_path} --ckpt-format {fmt} --bf16 --train-iters 12 --lr 2e-3"
    with pytest.raises(ArgsError, match=(
            r"schedule is not the checkpoint's \(--lr 0.002 here, 0.001 in the checkpoint, LR decay samples 24 "
            r"here, 20 in the checkpoint, weight-decay samples \(--train-samples, or --train-iters x "
            r"--global-batch-size\) 24 here, 20 in the checkpoint\): pass --use-checkpoint-opt_param-scheduler .* "
            r"or --override-opt_param-scheduler")):
        check_load(tiny_args(longer), pgs)
    for way in ("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler", "--finetune",
                "--no-load-optim"):
        check_load(tiny_args(f"{longer} {way}"), pgs)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_contradicting_model_is_one_line_before_anything_is_built(tmp_path, fmt):
    """pretrain checks --load's recorded model before building its own (check_load needs no
    model): a contradiction or a format mismatch is an ArgsError, one line, exit 2."""
    from megatron.training.arguments import ArgsError
    from megatron.training.training import check_load

    args, pgs = _saved(tmp_path, fmt)
    check_load(args, pgs)  # the same model passes
    other = tiny_args(f"--load {tmp_path} --ckpt-format {fmt} --ffn-hidden-size 128")
    with pytest.raises(ArgsError, match=f"--load {tmp_path}: checkpoint has ffn_hidden_size=256 but this run has 128"):
        check_load(other, pgs)
    for norm in ("apply_layernorm_1p", "qk_layernorm"):  # weights that mean another model under the other setting
        with pytest.raises(ArgsError, match=f"checkpoint has {norm}=False but this run has True"):
            check_load(tiny_args(f"--load {tmp_path} --ckpt-format {fmt} --{norm.replace('_', '-')}"), pgs)
    flipped = "torch" if fmt == "torch_dist" else "torch_dist"
    with pytest.raises(ArgsError, match=f"is a {fmt}-format checkpoint but --ckpt-format is {flipped}"):
        check_load(tiny_args(f"--load {tmp_path} --ckpt-format {flipped}"), pgs)
    if fmt == "torch":  # saved under another layout: this rank's file is not there
        path = checkpointing.latest_checkpoint(str(tmp_path))
        os.rename(os.path.join(path, "mp_rank_00"), os.path.join(path, "mp_rank_01"))
        with pytest.raises(ArgsError, match="has no mp_rank_00/model_optim_rng.pt: a torch-format checkpoint loads"):
            check_load(args, pgs)


def test_an_optimizer_state_that_does_not_carry_over_is_one_line(tmp_path):
    """Found while loading (the optimizer's files): still ArgsError, one line naming the way out."""
    from megatron.training.arguments import ArgsError
    from megatron.training.training import load_and_report

    _saved(tmp_path, "torch")
    args, pgs, state = make_state(tmp_path, "--ckpt-format torch --use-distributed-optimizer")
    with pytest.raises(ArgsError, match=r"^--load .*: .*mp_rank_00 was saved without --use-distributed-optimizer, "
                                        r"this run differs: .* \(load with --no-load-optim\)$"):
        load_and_report(args, state, pgs)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_no_load_optim_starts_the_schedule_afresh_and_keeps_the_position(tmp_path, fmt):
    """Megatron's rule: the LR schedule is loaded with the optimizer state, so --no-load-optim starts
    it at step 0 under this run's flags (another --lr is no refusal), while the weights, the
    iteration and the data position carry on."""
    from megatron.training.training import check_load, load_and_report
    from tests.unit_tests.training.test_checkpointing import train_one_step

    args, pgs, state = make_state(tmp_path, f"--ckpt-format {fmt} --lr-warmup-iters 4")
    for _ in range(2):
        train_one_step(state, args)
    save_checkpoint(args, state, pgs) if fmt == "torch" else _save_dist(args, state, pgs)
    weights = state.model[0].state_dict()
    new_run = f"--ckpt-format {fmt} --lr-warmup-iters 4 --lr 2e-3 --no-load-optim"
    check_load(tiny_args(f"--load {tmp_path} --bf16 {new_run}"), pgs)
    args2, _, resumed = make_state(tmp_path, new_run)
    load_and_report(args2, resumed, pgs)
    assert (resumed.iteration, resumed.consumed_train_samples) == (2, 2 * args.global_batch_size)
    assert resumed.scheduler.num_steps == 0 and resumed.optimizer.adam_steps() == 0
    assert resumed.scheduler.max_lr == 2e-3
    for key, value in resumed.model[0].state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, weights[key]), key


def _save_dist(args, state, pgs):
    from megatron.training.dist_ckpt import CheckpointSaver

    state.saver = CheckpointSaver(args, pgs, torch.device("cpu"))
    state.saver.save(state)
    state.saver.finish(blocking=True)


def test_a_released_torch_dist_checkpoint_loads_the_model_only(tmp_path):
    """As in the torch format (Megatron's rule): tracker `release` means iteration 0 and a new
    optimizer, schedule and data position, even when the checkpoint holds them."""
    from megatron.training.training import load_and_report
    from tests.unit_tests.training.test_checkpointing import train_one_step

    args, pgs, state = make_state(tmp_path, "--ckpt-format torch_dist")
    for _ in range(2):
        train_one_step(state, args)
    _save_dist(args, state, pgs)
    os.rename(checkpointing.iteration_dir(str(tmp_path), 2), tmp_path / checkpointing.RELEASE)
    checkpointing.atomic_write_text(str(tmp_path / checkpointing.TRACKER), checkpointing.RELEASE)
    _, _, released = make_state(tmp_path, "--ckpt-format torch_dist")
    load_and_report(args, released, pgs)
    assert (released.iteration, released.consumed_train_samples, released.scheduler.num_steps) == (0, 0, 0)
    assert released.optimizer.adam_steps() == 0
    assert torch.equal(released.optimizer.buffer.param_data, state.optimizer.buffer.param_data)


def test_a_missing_checkpoint_is_one_line_where_the_run_needs_one(tmp_path):
    """--exit-on-missing-checkpoint and --ckpt-convert-format stop at start-up when --load holds no
    checkpoint (an iteration directory given for the run's, say), where a plain run starts afresh;
    --ckpt-step loads the iteration it names, and a directory that is not there is said as such."""
    from megatron.training.arguments import ArgsError
    from megatron.training.training import check_load

    args, pgs = _saved(tmp_path, "torch")
    inner = checkpointing.latest_checkpoint(str(tmp_path))
    check_load(tiny_args(f"--load {inner}"), pgs)  # nothing to load: a fresh start
    for extra in ("--exit-on-missing-checkpoint", f"--ckpt-convert-format torch_dist --ckpt-convert-save {tmp_path}/c"):
        with pytest.raises(ArgsError, match=f"^--load {inner}: no checkpoint \\(latest_checkpointed_iteration.txt "
                                            "names none\\): is --load the run's directory\\?$"):
            check_load(tiny_args(f"--load {inner} {extra}"), pgs)
    assert checkpointing.loaded_checkpoint(tiny_args(f"--load {tmp_path} --ckpt-step 0")) == inner
    with pytest.raises(ArgsError, match=f"no checkpoint directory {tmp_path}/iter_0000007 \\(named by the tracker, "
                                        "or --ckpt-step\\)"):
        check_load(tiny_args(f"--load {tmp_path} --ckpt-step 7"), pgs)
    os.makedirs(tmp_path / "iter_0000008")
    with pytest.raises(ArgsError, match="iter_0000008 holds neither a torch_dist checkpoint .* nor a torch one"):
        check_load(tiny_args(f"--load {tmp_path} --ckpt-step 8"), pgs)


def test_a_checkpoint_without_args_or_with_the_old_schedule_key_loads(tmp_path):
    """Megatron's loader takes a torch checkpoint without `args` (nothing to compare) and reads the
    schedule under its old name `lr_scheduler`."""
    from megatron.training.training import check_load, load_and_report

    args, pgs = _saved(tmp_path, "torch")
    file = os.path.join(checkpointing.latest_checkpoint(str(tmp_path)), "mp_rank_00", "model_optim_rng.pt")
    obj = torch.load(file, weights_only=False)
    del obj["args"]
    obj["lr_scheduler"] = obj.pop(checkpointing.SCHEDULE)
    obj["lr_scheduler"]["num_steps"] = 6  # not a fresh schedule's: the load must read it
    torch.save(obj, file)
    check_load(args, pgs)
    _, _, state = make_state(tmp_path, "--ckpt-format torch")
    load_and_report(args, state, pgs)
    assert state.scheduler.num_steps == 6
