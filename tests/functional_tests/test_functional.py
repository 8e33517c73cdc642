"""End-to-end runs of pretrain_gpt.py under torchrun: the case table, exact resume, bad input."""
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest

from megatron.training.passkey import CHANCE_LOSS
from megatron.training.checkpointing import TRACKER
from tests.functional_tests.cases import BY_NAME, CASES, COMMON, TRAIN_ITERS, Case
from tests.functional_tests.run import (
    GOLDEN_DECIMALS, GOLDEN_RTOL, MACHINE_METRICS, METRICS, ROOT, command, golden_blob, golden_path, load_golden,
    precision, printed, run_case)
from tests.unit_tests.dist_utils import child_env, free_port

# Same machine, same session: a parallel layout differs from one rank only by the order of fp32
# reductions (tp all-reduce of partial GEMMs, dp gradient averaging, sharded Adam). Measured over
# 30 steps: <= 1.9e-7 relative, i.e. one unit in the 7th digit the log prints. 1e-6 leaves 5x
# margin; a real error (a missed 1/dp, a wrong shard, a wrong mask) moves the loss by > 1e-3.
LAYOUT_RTOL = 1e-6
# The gradient norm of each step likewise: measured <= 2.2e-7 relative over every layout case
# (tensorboard keeps float32, 6e-8); a gradient scaled wrong on even one tensor moves it by far more.
GRAD_NORM_RTOL = LAYOUT_RTOL
# fp16 (static loss scale): a layout with fewer micro-batches per rank scales each one's backward by
# another power of two (the loss is divided by the rank's micro-batch count) -- exact in fp16's
# normal range, not for subnormal values (below 6.1e-5, 6e-8 apart), where small gradients land.
# Measured against one rank: dp 2, loss 3.2e-6 and grad norm 3.6e-5 relative; pp 2 alone (the same
# micro-batches per rank): 0.0 and 1.1e-7. On another CPU (other fp32 GEMM blocking feeding the
# same fp16 roundings) the dp 2 x pp 2 norm moved 1.3e-4 by step 8, the loss still < 1e-5: the
# norm's bound is fp16's unit roundoff, 2^-11 = 4.9e-4. A missed 1/dp would move the norm by 2x.
LAYOUT_RTOLS = {"fp32": (LAYOUT_RTOL, GRAD_NORM_RTOL), "bf16": (LAYOUT_RTOL, GRAD_NORM_RTOL), "fp16": (1e-5, 5e-4)}


# Zero gradients are mostly structural (the embedding rows of tokens absent from the batch, with
# untied embeddings), the same in every layout. But some gradients are zero only in exact
# arithmetic: the key bias's (softmax ignores a constant added to all of a query's scores) comes
# out as rounding noise (~1e-12), now and then exactly 0.0 -- 0 to 6 of its 128 elements per step
# across these layouts, up to 13 with context parallelism, where it is the sum of the ranks'
# partials, which cancel, often exactly. A lost gradient zeroes a whole tensor (>= 64 elements
# here), beyond 24. Half precision also rounds a further ~0.1% of the count to zero (measured in
# bf16): the allowance grows by that, which at the largest counts here (32000, untied embeddings)
# still leaves a 64-element tensor 8 zeros beyond it.
def num_zeros_tol(count: float, precision: str) -> float:
    return 24 + (1e-3 * count if precision != "fp32" else 0.0)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Each case runs once per session; tests share the curves."""
    workdir = tmp_path_factory.mktemp("functional")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run_case(BY_NAME[name], workdir)
        return cache[name]

    get.workdir = workdir
    return get


def assert_curves_close(got, want, rtol, what):
    """Both curves hold every step; all finite (max() would pass over a NaN that is not first)."""
    steps = list(range(1, TRAIN_ITERS + 1))
    assert sorted(got) == steps and sorted(want) == steps, f"{what}: iterations {sorted(got)} vs {sorted(want)}"
    deviations = [abs(got[s] - want[s]) / abs(want[s]) for s in steps]
    assert all(math.isfinite(d) for d in deviations), f"{what}: a value that is not finite: {got} vs {want}"
    worst = max(deviations)
    assert worst <= rtol, f"{what}: max relative deviation {worst:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_case_matches_golden(case, runs):
    """The loss within GOLDEN_RTOL, the count of zero gradients within num_zeros_tol."""
    curve = runs(case)
    assert curve[TRAIN_ITERS] < 0.9 * curve[1], "the loss should fall over the run"
    golden = BY_NAME[case].golden_name
    assert_curves_close(curve, load_golden(golden), GOLDEN_RTOL[precision(BY_NAME[case])], case)
    want, got = load_golden(golden, "num-zeros"), curve.metrics["num-zeros"]
    assert all(math.isfinite(got[s]) for s in want), f"{case}: zero-gradient counts {got}"
    worst = max(abs(got[s] - want[s]) - num_zeros_tol(want[s], precision(BY_NAME[case])) for s in want)
    assert worst <= 0, f"{case}: zero-gradient count off by {worst:.0f} more than allowed"


@pytest.mark.parametrize("name", sorted({c.golden_name for c in CASES}))
def test_golden_files_hold_megatrons_metric_set(name, runs):
    """Each golden file has Megatron-LM's metrics, step ranges, "nan" fill and 5-decimal rounding,
    and a run reports every one of them at every step (time and memory are the machine's:
    recorded, not compared)."""
    blob = json.loads(golden_path(name).read_text())
    assert list(blob) == list(METRICS)
    measured = runs(name).metrics
    for metric, entry in blob.items():
        assert (entry["start_step"], entry["end_step"], entry["step_interval"]) == (1, TRAIN_ITERS, 1), metric
        assert list(entry["values"]) == [str(s) for s in range(1, TRAIN_ITERS + 1)], metric
        assert all(v == "nan" or round(v, GOLDEN_DECIMALS) == v for v in entry["values"].values()), metric
        first = 2 if metric == "iteration-time" else 1  # as Megatron: none for the first line (the start-up)
        assert sorted(measured[metric]) == list(range(first, TRAIN_ITERS + 1)), metric
        assert [s for s, v in entry["values"].items() if v == "nan"] == [str(s) for s in range(1, first)], metric
    assert all(v > 0 for m in MACHINE_METRICS for v in measured[m].values())


def test_golden_layout_fills_steps_without_a_value_with_nan():
    """As Megatron's harness: a step the run wrote no value for (a skipped fp16 step has no zero
    count) is "nan" in the file."""
    metrics = {m: {s: 1.234567 for s in range(1, 5)} for m in METRICS}
    del metrics["num-zeros"][2], metrics["iteration-time"][1]
    blob = golden_blob(metrics, train_iters=4)
    assert blob["num-zeros"] == {"start_step": 1, "end_step": 4, "step_interval": 1,
                                 "values": {"1": 1.23457, "2": "nan", "3": 1.23457, "4": 1.23457}}
    assert blob["iteration-time"]["values"]["1"] == "nan"


def _curve_of_golden(name, scale=1.0):
    """A Curve with the metrics of `name`'s golden file, its loss times `scale`."""
    from tests.functional_tests.run import Curve

    metrics = {m: load_golden(name, m) for m in METRICS}
    metrics["lm loss"] = {s: v * scale for s, v in metrics["lm loss"].items()}
    curve = Curve(metrics["lm loss"])
    curve.metrics = metrics
    return curve


def test_regenerating_a_golden_refuses_a_moved_loss_unless_asked(tmp_path, monkeypatch, capsys):
    """A regression would otherwise bless itself: 0.1% off the file (10x GOLDEN_RTOL) is refused and
    the file kept; --accept-change writes it, with the old file's time and memory unless
    --record-machine. A curve that does not fall is never written."""
    from tests.functional_tests import run

    case, original = BY_NAME["gpt_base"], golden_path("gpt_base").read_text()
    monkeypatch.setattr(run, "GOLDEN_DIR", tmp_path)
    (tmp_path / "gpt_base.json").write_text(original)
    with pytest.raises(SystemExit, match="the lm loss moved 1.00e-03 .* rerun with --accept-change"):
        run.write_golden(case, _curve_of_golden("gpt_base", 1.001))
    assert (tmp_path / "gpt_base.json").read_text() == original
    moved = _curve_of_golden("gpt_base", 1.001)
    moved.metrics["iteration-time"] = {s: 99.0 for s in range(2, TRAIN_ITERS + 1)}
    run.write_golden(case, moved, accept_change=True)
    written = json.loads((tmp_path / "gpt_base.json").read_text())
    assert written["iteration-time"] == json.loads(original)["iteration-time"]
    assert written["lm loss"]["values"]["30"] == round(moved[30], GOLDEN_DECIMALS)
    assert "lm loss: largest relative change 1.00e-03" in capsys.readouterr().out
    run.write_golden(case, moved, accept_change=True, record_machine=True)
    assert json.loads((tmp_path / "gpt_base.json").read_text())["iteration-time"]["values"]["2"] == 99.0
    flat = _curve_of_golden("gpt_base")
    flat[TRAIN_ITERS] = flat[1]
    with pytest.raises(SystemExit, match="not written"):
        run.write_golden(case, flat, accept_change=True)


@pytest.mark.parametrize("case", [c.name for c in CASES if c.golden_name != c.name])
def test_layout_reproduces_its_single_rank_run(case, runs):
    """The loss curve and the gradient norm of every step."""
    got, want = runs(case), runs(BY_NAME[case].golden_name)
    loss_rtol, norm_rtol = LAYOUT_RTOLS[precision(BY_NAME[case])]
    assert_curves_close(got, want, loss_rtol, case)
    assert_curves_close(got.metrics["grad-norm"], want.metrics["grad-norm"], norm_rtol, f"{case} grad norm")


EVAL = ["--eval-iters", "2", "--eval-interval", "10"]
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def eval_runs(runs):
    """{case: {iteration: validation loss}} of runs with EVAL, each case run once."""
    cache = {}

    def get(name):
        if name not in cache:
            log = run_case(BY_NAME[name], runs.workdir, EVAL).log
            cache[name] = {int(m.group(1)): float(m.group(2)) for m in VALIDATION.finditer(log)}
        return cache[name]
    return get


@pytest.mark.parametrize("case", ["gpt_llama_pp2_vp2_seq1f1b_k2_uniform_comp", "gpt_llama_pp2_cp2_seq1f1b_k2"])
def test_layout_reproduces_its_single_rank_validation_losses(case, eval_runs):
    """Evaluation runs the schedules forward only (their own operation lists, no backward to wait
    for): every 10 iterations, 2 batches, the one-rank run's validation losses."""
    got, want = eval_runs(case), eval_runs(BY_NAME[case].golden_name)
    assert sorted(want) == [10, 20, 30] and sorted(got) == sorted(want), (got, want)
    assert all(abs(got[s] - want[s]) <= LAYOUT_RTOL * want[s] for s in want), (got, want)


# What a case's name promises, and the validated setting that keeps it: sizes ...
NAMED = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
         "dp": "data_parallel_size", "vp": "virtual_pipeline_chunks", "k": "pipe_sp_splits"}
# ... and modes, each a word (or words) of the name.
PROMISED = {
    "ulysses": lambda a: a.cp_comm_type == "a2a",
    "ring": lambda a: a.cp_comm_type == "p2p",
    "double_ring": lambda a: (a.cp_inner_ring_size or a.ring_size) < a.ring_size,
    "2d": lambda a: a.cp_comm_type == "a2a+p2p" and min(a.head_parallel_size, a.ring_size) > 1,
    "head_first": lambda a: a.cp_placement == "head-first" and min(a.head_parallel_size, a.ring_size) > 1,
    "context_first": lambda a: a.cp_placement == "context-first" and min(a.head_parallel_size, a.ring_size) > 1,
    "kv_replicated": lambda a: a.head_parallel_size > a.num_query_groups // a.tensor_model_parallel_size,
    "selective_checkpoint_pp": lambda a: a.selective_checkpoint_pp,
    "1f1b": lambda a: a.pipeline_model_parallel_size > 1 and a.pipe_sp_splits == 1,
    "seq1f1b": lambda a: a.pipe_sp_splits > 1,
    "uniform_comp": lambda a: a.pipe_sp_strategy == "uniform_comp",
    "memo": lambda a: a.memo,
    "memo_alpha_half": lambda a: a.memo_swap_fraction == "0.5",  # a number or "auto": kept as given
    "memo_quarter": lambda a: a.memo_swap_fraction == "0.25",
    "memo_auto": lambda a: a.memo_swap_fraction == "auto",
    "distopt": lambda a: a.use_distributed_optimizer,
    "overlap": lambda a: a.overlap_grad_reduce,
    "bf16": lambda a: a.bf16,
    "fp16": lambda a: a.fp16,
    "sequence_parallel": lambda a: a.sequence_parallel,
    "per_token_loss": lambda a: a.calculate_per_token_loss,
    "cross_entropy_chunks": lambda a: a.cross_entropy_chunk_tokens > 0,
    "recompute_full_uniform": lambda a: (a.recompute_granularity, a.recompute_method) == ("full", "uniform"),
    "recompute": lambda a: a.recompute_granularity == "full",
    "dropout": lambda a: a.hidden_dropout > 0 and a.attention_dropout > 0,
    "documents": lambda a: a.reset_attention_mask and a.reset_position_ids and a.eod_mask_loss,
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_case_runs_the_layout_its_name_says(case, monkeypatch):
    """gpt_..._pp2_vp2_seq1f1b_k2: 2 stages of 2 chunks each, 2 Seq1F1B segments -- checked on the
    validated flags, so that a case cannot quietly run another layout (2 layers over 2 x 2 chunks
    of one layer each would leave one chunk per stage)."""
    from megatron.training import validate
    from megatron.training.arguments import parse_args

    # --sequence-parallel runs on CPU through its launcher (sequence_parallel_on_host.py)
    monkeypatch.setattr(validate, "sequence_parallel_device", lambda args: None)
    args = validate.validate_args(parse_args(list(COMMON) + case.flags), case.nproc)
    for axis, size in re.findall(r"_(tp|pp|cp|dp|vp|k)(\d+)(?=_|$)", case.name):
        assert getattr(args, NAMED[axis]) == int(size), f"{case.name}: {NAMED[axis]} is {getattr(args, NAMED[axis])}"
    for words, holds in PROMISED.items():
        if re.search(rf"(^|_){words}(_|$)", case.name):
            assert holds(args), f"{case.name} does not run what '{words}' names"
    instances = re.search(r"_(\d+)_instances(_|$)", case.name)
    assert not instances or args.num_distributed_optimizer_instances == int(instances.group(1)), case.name


@pytest.mark.parametrize("case, kernel", [("gpt_base", "torch-cpu-flash"), ("gpt_documents_cp2_ring", "torch-cpu-flash"),
                                          ("gpt_documents", "torch-cpu-flash")])
def test_log_names_the_attention_kernel_that_ran(case, kernel, runs):
    assert f"attention kernel: {kernel} (--attention-backend auto)" in runs(case).log


def test_resume_reproduces_the_uninterrupted_run_exactly(runs, tmp_path):
    """Stop at iteration 15 (checkpoint), resume to 30: iterations 16-30 have the same losses as
    the run that never stopped (2 ranks, distributed optimizer, overlapped reduction); the resumed
    process prints its first iteration, and its next line averages both, as Megatron's."""
    case = BY_NAME["gpt_base_dp2_distopt_overlap"]
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    first = run_case(case, runs.workdir, ["--save", ckpt, "--save-interval", "5", "--exit-interval", "15"])
    assert sorted(first) == list(range(1, 16))
    resumed = run_case(case, runs.workdir, ["--save", ckpt, "--load", ckpt, "--tensorboard-dir", tb,
                                            "--log-timers-to-tensorboard"])
    assert sorted(resumed) == list(range(16, TRAIN_ITERS + 1))
    full = runs(case.name)
    assert {s: full[s] for s in resumed} == resumed  # identical values
    lines = printed(resumed.log)
    assert sorted(lines) == list(range(16, TRAIN_ITERS + 1))
    for step, want in ((16, full[16]), (17, (full[16] + full[17]) / 2), (18, full[18])):
        assert abs(lines[step] - want) <= 5e-7 * want, step  # the line's 7 digits
    # The tensorboard scalars carry Megatron's names.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    assert {"learning-rate", "grad-norm", "iteration-time", "loss-scale"} <= set(events.Tags()["scalars"])


def test_a_signal_to_one_rank_saves_stops_every_rank_and_resumes_exactly(runs, tmp_path):
    """--exit-signal-handler --exit-signal SIGUSR1, the signal sent to rank 1 alone during iteration
    7 (2 ranks, distributed optimizer): both ranks finish 7, save it, and exit 0; the resumed run
    prints the uninterrupted run's losses."""
    case = BY_NAME["gpt_base_dp2_distopt_overlap"]
    ckpt = str(tmp_path / "ckpt")
    cmd = command(case, ["--save", ckpt, "--save-interval", "5", "--exit-signal-handler", "--exit-signal", "SIGUSR1"],
                  None)
    at = cmd.index(str(ROOT / "pretrain_gpt.py"))
    cmd[at : at + 1] = [str(ROOT / "tests" / "functional_tests" / "signal_at.py"), "SIGUSR1", "7", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exiting program on SIGUSR1 at iteration 7" in proc.stdout
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "7"
    resumed = run_case(case, runs.workdir, ["--load", ckpt])
    assert sorted(resumed) == list(range(8, TRAIN_ITERS + 1))
    full = runs(case.name)
    assert {s: full[s] for s in resumed} == resumed


def test_exit_duration_saves_and_stops_after_the_iteration_that_passes_it(runs, tmp_path):
    """Checked between evaluation iterations too (Megatron's): the evaluation after iteration 1
    stops after its first of 50, and the run saves and exits."""
    ckpt = str(tmp_path / "ckpt")
    curve = run_case(BY_NAME["gpt_base"], runs.workdir, ["--save", ckpt, "--exit-duration-in-mins", "0.0001",
                                                         "--eval-interval", "1", "--eval-iters", "50"])
    assert sorted(curve) == [1]  # the start-up alone takes longer than 6 ms
    assert "exiting during evaluation after 0.0001 minutes (--exit-duration-in-mins)" in curve.log
    assert "validation loss at iteration 1" not in curve.log  # the evaluation was cut, not printed
    assert "exiting program after 0.0001 minutes (--exit-duration-in-mins) at iteration 1" in curve.log
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "1"


def test_skip_train_evaluates_the_loaded_model_from_the_first_validation_samples(runs, tmp_path):
    """Megatron's --skip-train: no iteration, no save; the validation loss of the loaded checkpoint
    on the validation set's first samples, whatever the training run had read of it (the loader
    starts at 0, as Megatron's), so checkpoints compare; and the test loss. The reference: the same
    training without interval evaluations, whose final validation reads those first samples."""
    ckpt = str(tmp_path / "ckpt")
    trained = ["--eval-iters", "1", "--eval-interval", "10"]  # three evaluations read the first samples
    run_case(BY_NAME["gpt_base"], runs.workdir, ["--save", ckpt, "--save-interval", "10", *trained])
    first = run_case(BY_NAME["gpt_base"], runs.workdir, ["--eval-iters", "1"]).log  # evaluated at the end only
    final = re.search(rf"validation loss at iteration {TRAIN_ITERS} on validation set \| lm loss value: (\S+)", first)
    assert final is not None, first[-3000:]
    before = sorted(os.listdir(ckpt))
    alone = run_case(BY_NAME["gpt_base"], runs.workdir, ["--load", ckpt, "--save", ckpt, "--skip-train", *trained])
    assert sorted(alone) == [] and f"evaluating the model of iteration {TRAIN_ITERS}" in alone.log
    assert f"validation loss at iteration {TRAIN_ITERS} on validation set | lm loss value: {final[1]}" in alone.log
    assert f"validation loss at iteration {TRAIN_ITERS} on test set" in alone.log
    assert sorted(os.listdir(ckpt)) == before


def test_two_optimizer_instances_save_one_copy_and_resume_exactly(runs, tmp_path):
    """--num-distributed-optimizer-instances 2 on 4 ranks, torch format: one distrib_optim.pt in
    Megatron's layout (the optimizer state gathered whole), the run resumed from iteration 10
    prints the uninterrupted run's losses, and the same checkpoint resumes on 2 ranks with one
    instance (another data-parallel size: the single-rank curve within LAYOUT_RTOL)."""
    case = BY_NAME["gpt_base_dp4_distopt_2_instances"]
    ckpt = str(tmp_path / "ckpt")
    flags = ["--save", ckpt, "--ckpt-format", "torch", "--save-interval", "10"]
    assert sorted(run_case(case, runs.workdir, flags + ["--exit-interval", "10"])) == list(range(1, 11))
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000010", "mp_rank_00"))) == [
        "distrib_optim.pt", "model_optim_rng.pt"]
    dp2 = Case("dp2_from_dp4_instances", 2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 20000 "
               "--ckpt-format torch".split())
    on_dp2 = run_case(dp2, runs.workdir, ["--load", ckpt, "--exit-interval", "15"])  # saves nothing
    assert sorted(on_dp2) == list(range(11, 16))
    full = runs(case.name)
    assert_curves_close({**full, **on_dp2}, runs("gpt_base"), LAYOUT_RTOL, "dp2 from dp4 x 2 instances")
    resumed = run_case(case, runs.workdir, flags + ["--load", ckpt, "--exit-interval", "15"])
    assert sorted(resumed) == list(range(11, 16))
    assert {s: full[s] for s in resumed} == resumed


def test_recorded_pipeline_timeline_is_read_by_the_simulator(runs, tmp_path):
    from tools import pipeline_simulator

    case = BY_NAME["gpt_base_pp2_seq1f1b_k4"]
    run_case(case, runs.workdir, ["--pipeline-timeline", str(tmp_path / "tl"), "--timing-log-level", "1"])
    events, stages = pipeline_simulator.recorded_events(str(tmp_path / "tl"))
    assert stages == 2 and len(events) == 2 * 2 * 4 * 4  # stages x (F, B) x micro-batches x splits
    pipeline_simulator.main(["--from-run", str(tmp_path / "tl"), "--png", str(tmp_path / "real.png")])
    assert (tmp_path / "real.png").stat().st_size > 10_000


def test_memo_plan_over_the_host_budget_is_refused_before_training():
    # four layers: MEMO manages all but the last two, so two layers hold host copies
    flags = bad_command(["--num-layers", "4"]) + ["--memo", "--memo-host-memory-gb", "0.00001"]
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py")] + flags,
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "host memory" in lines[0] and "--memo-host-memory-gb allows" in lines[0], proc.stderr
    assert "iteration" not in proc.stdout  # refused before the first training step


BAD = [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--num-layers", None], "--num-layers is required"),
    (["--tensor-model-parallel-size", "3"], "world size 1 is not divisible by tensor (3)"),
    (["--global-batch-size", "7"], "--global-batch-size 7 is not divisible by --micro-batch-size 2"),
    (["--seq-length", "256"], "--seq-length 256 exceeds --max-position-embeddings 128"),
    (["--data-path", "/no/such/corpus"], "--data-path: cannot read /no/such/corpus.bin"),
]


def bad_command(change):
    from tests.functional_tests.cases import COMMON

    flags = list(COMMON)
    flag, value = change[0], change[1] if len(change) > 1 else "__flag__"
    if flag in flags and value is None:  # remove a required flag
        i = flags.index(flag)
        del flags[i : i + 2]
    elif flag == "--data-path":
        flags.remove("--mock-data")
        flags += change
    elif flag in flags:
        flags[flags.index(flag) + 1] = value
    else:
        flags += [flag] if value == "__flag__" else change
    return flags


@pytest.mark.parametrize("change, message", BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_bad_input_fails_in_one_line_before_any_work(change, message):
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py")] + bad_command(change),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], proc.stderr
    assert "> world" not in proc.stdout  # no process group was built


def test_bad_input_under_torchrun_is_reported_once():
    flags = bad_command(["--tensor-model-parallel-size", "2"])
    flags[flags.index("--num-attention-heads") + 1] = "3"
    flags[flags.index("--hidden-size") + 1] = "63"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py")] + flags,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert ours == ["pretrain_gpt.py: error: --num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"]


def test_passkey_is_learned_across_context_parallel_ranks(tmp_path):
    """The key sits anywhere before the query at the end of a 128-token sequence split over 2 ring
    ranks. Zigzag placement gives rank 0 tokens 0-31 and 96-127 (the query's) and rank 1 tokens
    32-95, so about half the keys live on the other rank: an answer loss below 0.4 x chance
    (ln 10 = 2.30), under the ~1.15 that retrieving only same-rank keys would give, needs queries
    to attend across both ranks' tokens (this run reaches ~0.19)."""
    flags = ("--context-parallel-size 2 --cp-comm-type p2p --num-layers 2 --hidden-size 64 "
             "--num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--position-embedding-type rope --seq-length 128 --micro-batch-size 8 --global-batch-size 32 "
             "--train-iters 160 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 "
             "--weight-decay 0.0 --hidden-dropout 0 --attention-dropout 0 --passkey-data --passkey-depth 1 "
             "--tokenizer-type NullTokenizer --vocab-size 256 --log-interval 20 --eval-interval 160 "
             "--eval-iters 4 --num-workers 0 --distributed-backend gloo").split()  # CPU ranks on a GPU machine too
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py")] + flags,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"validation loss at iteration 160 \| lm loss value: ([0-9.E+-]+)", proc.stdout)
    assert found and float(found.group(1)) < 0.4 * CHANCE_LOSS, proc.stdout[-2000:]


def test_async_save_killed_mid_write_resumes_from_the_previous_checkpoint(runs, tmp_path):
    """SIGKILL (trainer and writer processes) while the save of iteration 10 is on disk in part:
    the tracker still names iteration 5, the half-written directory is never taken for a
    checkpoint, and the resumed run prints the uninterrupted run's losses (6-12 are compared)."""
    case = BY_NAME["gpt_base"]
    ckpt = str(tmp_path / "ckpt")
    flags = list(COMMON) + ["--save", ckpt, "--save-interval", "5", "--async-save"]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "functional_tests" / "kill_during_save.py"), "2"]
                          + flags, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=child_env(), start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "5"
    assert sorted(os.listdir(ckpt)) == ["iter_0000005", "iter_0000010.tmp", TRACKER]
    written = os.listdir(os.path.join(ckpt, "iter_0000010.tmp"))
    assert any(f.endswith(".distcp") for f in written) and ".metadata" not in written  # killed mid-save
    resumed = run_case(case, runs.workdir, ["--load", ckpt, "--exit-interval", "12"])  # enough to compare
    assert sorted(resumed) == list(range(6, 13))
    full = runs(case.name)
    assert {s: full[s] for s in resumed} == resumed


def test_torch_dist_checkpoint_resumes_in_other_layouts(tmp_path):
    """Saved at tp2 x pp2 (distributed optimizer, async), resumed at tp4 x pp1 (tensors cut finer,
    stages merged), at tp1 x pp2 with uneven stages, 1 + 3 layers (tensors merged, layers moved
    across stages) and at dp4 with two distributed-optimizer instances (the optimizer state cut
    into two shards, each held twice): every layout's losses are the single-rank run's within LAYOUT_RTOL (only the
    order of fp32 reductions differs), before and after the change of layout."""
    ckpt = str(tmp_path / "ckpt")

    def run(name, nproc, flags):
        return run_case(Case(name, nproc, flags), tmp_path, ["--train-iters", "8"])

    ref = run("reshard_ref", 1, ["--num-layers", "4"])
    first = run("reshard_tp2_pp2", 4, "--num-layers 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                f"--use-distributed-optimizer --async-save --save {ckpt} --save-interval 4 --exit-interval 4".split())
    assert sorted(first) == [1, 2, 3, 4]
    layouts = [("tp4", 4, "--tensor-model-parallel-size 4"),
               ("pp2_uneven", 2, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1"),
               ("dp4_2_instances", 4, "--use-distributed-optimizer --num-distributed-optimizer-instances 2")]
    for name, nproc, layout in layouts:
        resumed = run(f"reshard_{name}", nproc, f"--num-layers 4 {layout} --load {ckpt}".split())
        assert sorted(resumed) == [5, 6, 7, 8], name
        for step, loss in {**first, **resumed}.items():
            assert abs(loss - ref[step]) <= LAYOUT_RTOL * ref[step], (name, step, loss, ref[step])


def _run_exit(case: Case, workdir, extra):
    proc = subprocess.run(command(case, list(extra), None), cwd=workdir, capture_output=True, text=True,
                          timeout=300, env=child_env())
    return proc.returncode, proc.stdout + proc.stderr


def test_rerun_report_stats_runs_every_iteration_twice_and_changes_nothing(runs):
    """With dropout: the rerun repeats the first run's micro-batches and random streams, so every
    loss is the same (relative difference 0) and the curve is the validated run's, bitwise."""
    case = BY_NAME["gpt_dropout"]
    twice = run_case(case, runs.workdir, ["--rerun-mode", "report_stats"])
    assert twice == runs(case.name)
    assert twice.log.count("rerun: determinism up to iteration") == TRAIN_ITERS
    # 4 micro-batch losses and the gradient norm of the one rank
    assert f"determinism up to iteration {TRAIN_ITERS}: 5 checked values run twice, largest relative difference " \
           "0.000e+00" in twice.log


def test_rerun_injected_errors_checkpoint_and_exit_as_megatrons(tmp_path):
    """Two pipeline stages, --error-injection-rate 1 (the second iteration's first loss check is
    rejected on the last stage): a persistent error reproduces in place, so the state before
    iteration 2 is saved with the machine's and the run exits 16; resumed on the same node and
    device it exits 16 again. A transient error does not reproduce: checkpoint, exit 17."""
    case = BY_NAME["gpt_base_pp2_1f1b"]
    ckpt = str(tmp_path / "ckpt")
    inject = ["--error-injection-rate", "1", "--save", ckpt, "--save-interval", "100"]
    code, log = _run_exit(case, tmp_path, inject + ["--error-injection-type", "persistent_error"])
    assert code != 0 and "exitcode  : 16" in log, log[-3000:]
    assert "reproducible in place" in log and (tmp_path / "ckpt" / TRACKER).read_text() == "1"
    code, log = _run_exit(case, tmp_path, inject + ["--error-injection-type", "persistent_error", "--load", ckpt])
    assert "exitcode  : 16" in log and "resumed on the node and device that reproduced the result" in log, log[-3000:]
    ckpt = str(tmp_path / "torch")
    code, log = _run_exit(case, tmp_path, inject[:2] + ["--save", ckpt, "--ckpt-format", "torch"])
    assert "exitcode  : 17" in log and "possible transient error" in log, log[-3000:]
    assert (tmp_path / "torch" / TRACKER).read_text() == "1"
