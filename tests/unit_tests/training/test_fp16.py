"""--fp16: dynamic loss scaling by Megatron's rules, skipped steps on overflow (on every rank),
and a curve that follows fp32's."""
import torch
import torch.distributed as dist

from megatron.training.loss_scaler import LossScaler
from megatron.training.training import setup
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks
from tests.unit_tests.model_utils import lm_loss, tiny_args, tiny_gpt


def make_state(extra):
    init_single_rank_world()
    args = tiny_args(f"--lr 5e-3 {extra}")
    return args, setup(args, grid_groups(), lambda a, p, d: tiny_gpt(a, p))


def test_dynamic_scale_backs_off_after_hysteresis_and_grows_after_a_clean_window():
    s = LossScaler(1024.0, min_scale=128.0, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # the first overflow spends hysteresis only
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0  # hysteresis stays spent until a clean window restores it
    for _ in range(3):
        s.update(False)
    assert (s.scale, s.hysteresis_left, s.clean_steps) == (512.0, 2, 0)
    for _ in range(10):
        s.update(True)
    assert s.scale == 128.0  # the floor
    fixed = LossScaler(8.0, dynamic=False)
    fixed.update(True)
    assert fixed.scale == 8.0
    restored = LossScaler(1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_a_fixed_scale_is_the_flags_whatever_a_checkpoint_says():
    """megatron-core's ConstantGradScaler: nothing saved, nothing loaded. A dynamic run resuming
    a fixed one's checkpoint starts from its own --initial-loss-scale."""
    fixed = LossScaler(8.0, dynamic=False)
    assert fixed.state_dict() == {}
    fixed.load_state_dict({"scale": 2048.0, "growth_tracker": 3, "hysteresis_tracker": 1})
    assert fixed.scale == 8.0
    dynamic = LossScaler(4096.0)
    dynamic.load_state_dict({})
    assert dynamic.scale == 4096.0


def test_loss_scale_flags_build_megatrons_scaler():
    """--loss-scale fixes the scale under bf16 too (megatron-core builds its constant scaler for
    fp16, bf16 or the distributed optimizer); dynamic fp16 leaves non-finite values to the scaler
    (Megatron turns its NaN checks off); fp32 without the distributed optimizer takes no scale."""
    from megatron.training.loss_scaler import loss_scaler
    from tests.unit_tests.training.test_arguments import error_of

    args = tiny_args("--bf16 --loss-scale 1024")
    scaler = loss_scaler(args)
    assert (scaler.scale, scaler.dynamic, args.check_for_nan_in_loss_and_grad) == (1024, False, True)
    args = tiny_args("--fp16")
    assert loss_scaler(args).dynamic and not args.check_for_nan_in_loss_and_grad
    assert tiny_args("--fp16 --loss-scale 8").check_for_nan_in_loss_and_grad  # a fixed scale: Megatron keeps them
    assert loss_scaler(tiny_args("--bf16")) is None
    assert error_of("--loss-scale 8") == ("--loss-scale needs --fp16, --bf16 or --use-distributed-optimizer "
                                          "(Megatron's fp32 optimizer takes no loss scale)")
    assert error_of("--bf16 --loss-scale 0") == "--loss-scale must be positive, got 0.0"


def fp16_steps(state, args, steps, poison_at=None):
    """Train `steps` steps; at step `poison_at` one gradient element becomes inf after backward."""
    losses, skipped = [], 0
    for i in range(steps):
        state.optimizer.zero_grad()
        loss = lm_loss(state.model[0], args)  # one batch, learned step by step
        state.optimizer.scale_loss(loss).backward() if state.optimizer.scaler else loss.backward()
        if i == poison_at:
            state.optimizer.buffer.grad_data[7] = float("inf")
        state.optimizer.buffer.finish_grad_sync()
        updated, _, _ = state.optimizer.step()
        if updated:
            state.scheduler.step(args.global_batch_size)
        skipped += not updated
        losses.append(loss.item())
    return losses, skipped


def test_fp16_follows_the_fp32_curve_and_skips_an_injected_overflow():
    """Same model, one batch learned over 12 steps (the loss falls by 40%): fp16 with a dynamic
    scale of 2^12 against fp32. fp16 rounds at 2^-11 per op; measured here 1.4e-4 relative at worst
    (bf16, 2^-8 per op: 8.7e-4), so 1e-3 bounds it with 7x margin, far below what a missing or
    doubled unscale would do (the step would change by the scale factor). An inf injected into one
    gradient at step 5 skips exactly that step: weights and schedule stay, and the scale is not cut
    before its hysteresis is spent."""
    args32, fp32 = make_state("")
    ref, _ = fp16_steps(fp32, args32, 12)
    args, fp16 = make_state("--fp16 --initial-loss-scale 4096")
    assert next(fp16.model[0].parameters()).dtype == torch.float16
    got, skipped = fp16_steps(fp16, args, 12)
    assert skipped == 0 and fp16.optimizer.loss_scale == 4096.0
    assert ref[-1] < 0.9 * ref[0]
    assert max(abs(a - b) / b for a, b in zip(got, ref)) < 1e-3

    _, poisoned = make_state("--fp16 --initial-loss-scale 4096")
    losses, skipped = fp16_steps(poisoned, args, 6, poison_at=5)
    assert skipped == 1 and losses == got[:6]
    assert poisoned.optimizer.loss_scale == 4096.0 and poisoned.optimizer.scaler.hysteresis_left == 1
    assert poisoned.scheduler.num_steps == 5 * args.global_batch_size
    _, five = make_state("--fp16 --initial-loss-scale 4096")
    fp16_steps(five, args, 5)
    assert torch.equal(poisoned.optimizer.main_data, five.optimizer.main_data)  # step 5 changed nothing


def _check_overflow_on_one_rank_skips_everywhere():
    from megatron.training.distributed import GradBuffer
    from megatron.training.optimizer import DistributedAdam
    from tests.unit_tests.training.test_optimizer import OPT_ARGS, Tiny

    pgs = grid_groups()
    torch.manual_seed(0)
    model = Tiny().half()
    buffer = GradBuffer(list(model.parameters()), pgs.dp, shard=True, overlap=False)
    opt = DistributedAdam(model.named_parameters(), buffer, pgs, OPT_ARGS, LossScaler(256.0, hysteresis=1))
    opt.zero_grad()
    opt.scale_loss(model(torch.randn(3, 8).half()).float().square().mean()).backward()
    if dist.get_rank() == 1:
        model.fc2.bias.main_grad[0] = float("nan")  # on one rank only; the sum reaches its owner
    buffer.finish_grad_sync()
    weights = buffer.param_data.clone()
    assert opt.step() == (False, None, None)
    assert torch.equal(buffer.param_data, weights) and opt.loss_scale == 128.0


def test_an_overflow_on_one_rank_skips_the_step_on_all():
    run_ranks(_check_overflow_on_one_rank_skips_everywhere, 2)
