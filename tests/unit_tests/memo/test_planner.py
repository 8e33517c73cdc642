"""The DSA planner and the bi-level plan: valid plans, near the bound, the solver fallbacks."""
import contextlib
import json
import random

import pytest
import torch

from megatron.longseq.memo import dsa
from megatron.longseq.memo.planner import _window_finder, bilevel_plan
from megatron.longseq.memo.profiler import trace_iteration
from megatron.longseq.memo.runtime import Memo
from megatron.longseq.memo.trace import AllocationTracer, Trace, from_cuda_snapshot
from tests.unit_tests.dist_utils import child_env, grid_groups, init_single_rank_world
from tests.unit_tests.model_utils import lm_loss, tiny_args, tiny_gpt


def synthetic(n, seed):
    rng = random.Random(seed)
    blocks = []
    for i in range(n):
        start = rng.randint(0, 3 * n)
        blocks.append(dsa.Block(f"t{i}", rng.choice([1, 2, 3, 4, 8, 16]) * 4096, start, start + rng.randint(1, n // 2 + 1)))
    return blocks


@pytest.mark.parametrize("solver", dsa.SOLVERS)
@pytest.mark.parametrize("n, seed", [(12, 0), (30, 1), (60, 2)])
def test_plans_are_valid_and_never_below_the_bound(solver, n, seed):
    blocks = synthetic(n, seed)
    plan = dsa.plan(blocks, solver, time_limit=10)
    dsa.check_plan(blocks, plan.offsets, plan.peak)
    assert plan.peak >= plan.lower_bound == dsa.lower_bound(blocks)
    if plan.optimal and plan.solver != "greedy":
        assert plan.peak <= 1.05 * plan.lower_bound


@pytest.mark.parametrize("solver", dsa.SOLVERS)
def test_offsets_are_512_byte_aligned_whatever_the_sizes(solver):
    """Real traces hold sizes like 4000 or 12 bytes: every solver still places on 512-byte
    boundaries (torch's allocator alignment; kernels assume >= 16)."""
    rng = random.Random(5)
    blocks = [dsa.Block(f"t{i}", rng.randint(1, 5000), s, s + rng.randint(1, 6))
              for i, s in enumerate(rng.randint(0, 20) for _ in range(25))]
    plan = dsa.plan(blocks, solver, time_limit=10)
    assert all(off % dsa.ALIGN == 0 for off in plan.offsets.values()) and plan.peak % dsa.ALIGN == 0
    dsa.check_plan(blocks, plan.offsets, plan.peak)


def test_gurobi_size_limit_falls_back_to_cpsat():
    blocks = synthetic(150, 3)  # ~1000+ overlapping pairs: over the pip licence's 2000 limit
    plan = dsa.plan(blocks, "gurobi", time_limit=10)
    assert plan.solver == "cpsat" and any("size-limited licence" in n for n in plan.notes)
    dsa.check_plan(blocks, plan.offsets, plan.peak)


def test_any_gurobi_error_falls_back_with_its_reason(monkeypatch):
    """No licence (10009), or the bundled one expired: CP-SAT plans, and the notes say why."""
    gp = pytest.importorskip("gurobipy")

    def no_licence(*args, **kwargs):
        raise gp.GurobiError(10009, "No Gurobi license found")
    monkeypatch.setattr(gp, "Env", no_licence)
    blocks = synthetic(12, 0)
    plan = dsa.plan(blocks, "gurobi", time_limit=10)
    assert plan.solver == "cpsat" and plan.notes == ["gurobi: error 10009 (No Gurobi license found); falling back"]
    dsa.check_plan(blocks, plan.offsets, plan.peak)


def test_gurobi_calls_optimal_only_what_is_proven():
    """Gurobi's default 1e-4 relative gap is megabytes at a real peak: 40 small tensors beside one
    of 488 MiB alive throughout. Called optimal, the plan must be CP-SAT's proven optimum."""
    pytest.importorskip("gurobipy")
    rng = random.Random(1)
    blocks = [dsa.Block(f"r{i}", rng.choice([1, 512, 700, 4096, 8192, 100000]), s, s + rng.randint(1, 9))
              for i, s in enumerate(rng.randrange(0, 30) for _ in range(40))]
    blocks.append(dsa.Block("big", 512 * 10**6, 0, 100))
    exact = dsa.plan(blocks, "cpsat", time_limit=20)
    plan = dsa.plan(blocks, "gurobi", time_limit=20)
    assert plan.solver == "gurobi" and exact.optimal, (plan.notes, exact.notes)
    assert plan.peak == exact.peak or not plan.optimal, (plan.peak, exact.peak)


def test_a_plan_that_fails_the_check_is_never_handed_out(monkeypatch):
    """A solver whose tolerance let two tensors touch: the next solver plans instead."""
    blocks = synthetic(12, 0)
    monkeypatch.setattr(dsa, "gurobi", lambda blocks, *a: ({b.id: 0 for b in blocks}, True))
    plan = dsa.plan(blocks, "gurobi", time_limit=10)
    assert plan.solver == "cpsat" and "its plan failed the check" in plan.notes[0]
    dsa.check_plan(blocks, plan.offsets, plan.peak)


def test_windows_share_a_plan_only_when_their_lifetimes_match_too():
    """Two layer windows with the same sizes in the same order, tensors one after the other in
    the first and nested in the second: the first's plan (both at offset 0) would overlap them in
    the second. Windows equal in sizes and lifetimes still share."""
    def window(label, nested):
        a, b = f"a:{label}", f"b:{label}"
        inner = [("malloc", b, 4096), ("free", a, 4096), ("free", b, 4096)] if nested else \
            [("free", a, 4096), ("malloc", b, 4096), ("free", b, 4096)]
        return [("mark", f"begin {label}", 0), ("malloc", a, 4096), *inner, ("mark", f"end {label}", 0)]

    trace = Trace(window("fwd L1", False) + window("fwd L2", True) + window("fwd L3", False))
    plan = bilevel_plan(trace, "greedy")
    assert plan.reused == {"fwd L3": "fwd L1"}
    assert plan.offsets["a:fwd L2"] != plan.offsets["b:fwd L2"]


def test_check_plan_catches_an_overlap():
    a, b = dsa.Block("a", 100, 0, 5), dsa.Block("b", 100, 3, 8)
    with pytest.raises(AssertionError, match="overlap"):
        dsa.check_plan([a, b], {"a": 0, "b": 50}, 200)


def test_tracer_records_allocations_and_frees():
    trace = Trace()
    with AllocationTracer(trace):
        x = torch.ones(1000)
        y = x * 2  # a new storage
        z = y.view(10, 100)  # a view: no allocation
        del y, z
        w = x + 1  # noqa: F841 (allocated, traced, never read)
    kinds = [e[0] for e in trace.events]
    assert kinds.count("malloc") == 3 and kinds.index("free") == 2  # y (with its view) freed before w
    assert all(e[2] == 4000 for e in trace.events)


def test_tracer_takes_no_view_of_an_older_storage_for_an_allocation():
    """A parameter made before tracing began, viewed (weight.t()) or updated in place by an op, is
    no allocation: it would stay in the trace as a block never freed, sized like the parameter."""
    weight = torch.nn.Parameter(torch.ones(30, 20))
    trace = Trace()
    with AllocationTracer(trace):
        with torch.no_grad():
            weight.t().mul_(1.0)
        out = torch.ones(5, 20) @ weight.t()
        del out
    # the input of ones (400 bytes) and the product (600), each freed; nothing of the weight's 2400
    assert [(kind, size) for kind, _, size in trace.events] == [("malloc", 400), ("malloc", 600), ("free", 400),
                                                              ("free", 600)]


def test_cuda_history_carries_the_window_marks():
    """On a GPU the marks travel through torch's allocator history as allocations on a marker
    stream (profiler.CudaMarks); the trace gets them back in place, and a lost one is an error."""
    M = 0x77

    def entry(action, addr, stream=0, size=512):
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    history = [entry("alloc", 0x1000, size=4096), entry("alloc", 0x9000, M), entry("free_requested", 0x9000, M),
               entry("free_completed", 0x9000, M), entry("alloc", 0x2000), entry("free_requested", 0x2000),
               entry("free_completed", 0x2000), entry("alloc", 0x9000, M), entry("free_requested", 0x9000, M),
               entry("free_requested", 0x1000, size=4096)]
    trace = from_cuda_snapshot({"device_traces": [history]}, 0, M, ["begin fwd L1", "end fwd L1"])
    assert trace.events == [("malloc", "1000.1", 4096), ("mark", "begin fwd L1", 0), ("malloc", "2000.1", 512),
                            ("free", "2000.1", 512), ("mark", "end fwd L1", 0), ("free", "1000.1", 4096)]
    assert trace.windows() == {"fwd L1": (1, 4)}
    with pytest.raises(ValueError, match="lost 1 of 3 window marks"):
        from_cuda_snapshot({"device_traces": [history]}, 0, M, ["begin fwd L1", "end fwd L1", "begin bwd L1"])
    oom = {"action": "oom", "size": 2**40, "stream": 0, "device_free": 2**30}  # torch 2.11: no "addr"
    assert from_cuda_snapshot({"device_traces": [history[:2] + [oom] + history[2:]]}, 0, M,
                              ["begin fwd L1", "end fwd L1"]).events == trace.events


@pytest.mark.parametrize("fails", [False, True])
def test_the_cuda_history_records_no_tracebacks_and_stops_whatever_happens(monkeypatch, fails):
    """torch's defaults unwind the C++ stack at every allocation and symbolise it in the snapshot,
    none of which the trace reads; and a history left on slows every later allocation."""
    from types import SimpleNamespace

    from megatron.longseq.memo import profiler

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [[]]})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def iteration():
        if fails:
            raise RuntimeError("CUDA out of memory")
    marks = SimpleNamespace(stream=SimpleNamespace(cuda_stream=7), labels=[])
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        profiler._traced(iteration, torch.device("cuda", 0), marks, Trace())
    assert calls[0]["context"] is None and calls[0]["stacks"] == "python" and calls[0]["enabled"] == "all"
    assert {"alloc", "free_requested", "oom"}.isdisjoint(calls[0]["skip_actions"])
    assert calls[1:] == [{"enabled": None}]


def test_a_torch_without_skip_actions_records_every_kind(monkeypatch):
    """skip_actions is recent; a recorder without it gets the rest (the trace skips those kinds)."""
    from megatron.longseq.memo import profiler

    def older(enabled="all", context="all", stacks="all", max_entries=1, device=None, clear_history=False):
        pass
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", older)
    assert profiler.history_settings() == {k: v for k, v in profiler.HISTORY.items() if k != "skip_actions"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the allocator history exists on a GPU only"))])
def test_every_layer_window_is_in_the_trace_on_each_device(device):
    layers = [torch.nn.Linear(64, 64, device=device) for _ in range(3)]
    for i, layer in enumerate(layers, 1):
        layer.layer_number = i
    net = torch.nn.Sequential(*layers)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    trace = trace_iteration(lambda: net(x).square().sum().backward(), layers, torch.device(device))
    assert set(trace.windows()) == {f"{k} L{i}" for k in ("fwd", "bwd") for i in (1, 2, 3)}
    assert bilevel_plan(trace, "greedy").replay.marks  # the plan places the windows' tensors


@pytest.mark.parametrize("offset", [100, -512, 10**12])
def test_a_saved_plan_with_an_offset_the_arena_cannot_hand_out_is_refused(tmp_path, offset):
    """--memo-plan takes a file: an offset that is not 512-aligned, negative or past the arena
    (a plan edited or made elsewhere) is one line at load, not a misaligned device pointer."""
    from megatron.longseq.memo.planner import load_plan_summary

    layers = [torch.nn.Linear(64, 64) for _ in range(2)]
    for i, layer in enumerate(layers, 1):
        layer.layer_number = i
    x = torch.randn(8, 64, requires_grad=True)
    trace = trace_iteration(lambda: torch.nn.Sequential(*layers)(x).square().sum().backward(), layers,
                            torch.device("cpu"))
    path = tmp_path / "plan.json"
    bilevel_plan(trace, "greedy").save(str(path), None)
    assert load_plan_summary(str(path))["replay"]["sizes"]  # as saved: loads
    blob = json.loads(path.read_text())
    placed = next(i for i, o in enumerate(blob["replay"]["offsets"]) if o != -1)
    blob["replay"]["offsets"][placed] = offset
    path.write_text(json.dumps(blob))
    with pytest.raises(ValueError, match=f"request {placed} is planned at offset {offset} .* plan again"):
        load_plan_summary(str(path))


def _real_trace(alpha, microbatches=1):
    init_single_rank_world()
    args = tiny_args("--num-layers 4 --seq-length 64 --max-position-embeddings 64")
    model = tiny_gpt(args, grid_groups())
    layers = list(model.decoder.layers)
    if alpha is not None:
        memo = Memo(alpha, torch.device("cpu"), {p.untyped_storage().data_ptr() for p in model.parameters()})
        memo.wrap(model.decoder.layers)
        memo.calibrate(lambda: lm_loss(model, args).backward())

    def iteration():
        for _ in range(microbatches):
            lm_loss(model, args).backward()

    return trace_iteration(iteration, layers, torch.device("cpu"))


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_bilevel_plan_of_real_layer_traces(alpha):
    trace = _real_trace(alpha)
    windows = trace.windows()
    assert {f"{k} L{i}" for k in ("fwd", "bwd") for i in range(1, 5)} <= set(windows)
    window_of = _window_finder(windows)  # the planner's lookup agrees with a scan of every window
    for b in trace.blocks():
        assert window_of(b) == next((w for w, (lo, hi) in windows.items() if lo < b.start and b.end < hi), None)
    plan = bilevel_plan(trace, "gurobi", time_limit=20)  # checks every tensor of the trace itself
    summary = plan.summary()
    assert plan.peak >= plan.lower_bound and summary["windows_reusing_a_plan"] >= 2  # identical layers
    for level1 in summary["level1"].values():
        if level1["optimal"] and level1["solver"] != "greedy":
            assert level1["peak"] <= 1.05 * level1["lower_bound"]
    assert summary["level2"]["seconds"] < 60


def test_plan_memory_profiles_on_the_device_it_is_given(monkeypatch):
    """tools/plan_memory.py on a GPU machine: the model is built on the GPU (the backend decides
    the device), so the batch, MEMO and the trace must be there too -- a CPU batch crashed the
    first forward, and a CPU MEMO kept every device tensor whole (nothing managed). Here a device
    object of its own stands for the GPU, and MEMO and the trace must get exactly it; the batches
    go where the model is (pretrain_gpt.forward_step, as in training)."""
    import pretrain_gpt
    from megatron.longseq.memo import profiler
    from megatron.training import memo_setup
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup
    from tools import plan_memory

    init_single_rank_world()
    args = tiny_args("--num-layers 4 --memo --memo-swap-fraction 0.5")
    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: build_model_chunks(a, p, d))
    device, seen = torch.device("cpu", 0), []
    for module, name in ((pretrain_gpt, "to_device"), (memo_setup, "wrap_model"), (profiler, "trace_iteration")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: seen.append((_name, a[-1])) or _real(*a))
    trace = plan_memory.profile_state(state, args, pgs, device)
    assert trace.windows() and [s for s in seen if s[0] != "to_device"] == [("wrap_model", device),
                                                                            ("trace_iteration", device)]
    model_device = next(state.model[0].parameters()).device
    assert {d for name, d in seen if name == "to_device"} == {model_device}


def test_plan_memory_profiles_the_iteration_the_trainer_runs(tmp_path):
    """Every micro-batch, every Seq1F1B segment: the tool's plan has the requests and windows of
    the trainer's (--memo-save-plan), not those of one whole micro-batch (254 requests where the
    trainer makes 1220 here, which its planned allocator could not follow)."""
    import pretrain_gpt
    from megatron.longseq.memo.planner import bilevel_plan, load_plan_summary
    from megatron.training.memo_setup import setup_memo
    from megatron.training.model import build_model_chunks
    from megatron.training.training import setup
    from tools import plan_memory

    init_single_rank_world()
    flags = (f"--num-layers 4 --memo --memo-swap-fraction 0.5 --memo-planner greedy --global-batch-size 2 "
             f"--pipe-sp-splits 2 --memo-save-plan {tmp_path}/plan.json")
    args, pgs, cpu = tiny_args(flags), grid_groups(), torch.device("cpu")
    setup_memo(args, pgs, setup(args, pgs, build_model_chunks), pretrain_gpt.forward_step, cpu)
    trainer = load_plan_summary(f"{tmp_path}/plan.json")["replay"]
    tool = bilevel_plan(plan_memory.profile_state(setup(args, pgs, build_model_chunks), args, pgs, cpu), "greedy")
    assert (tool.replay.sizes, [list(m) for m in tool.replay.marks]) == (trainer["sizes"], trainer["marks"])
    assert len(trainer["sizes"]) > 2 * len({label for label, _ in trainer["marks"]})


def test_plan_memory_tool_profiles_plans_and_draws(tmp_path):
    """tools/plan_memory.py (its own process: it builds its own world) on a model given by its
    model flags only (training-only flags default to one step of mock data), then on the trace it
    saved: the same plan. Bad model flags: pretrain_gpt.py's one line, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron.longseq.memo.planner import load_plan_summary

    tool = str(Path(__file__).resolve().parents[3] / "tools" / "plan_memory.py")
    model = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
             "--hidden-dropout 0 --memo --memo-swap-fraction 0.5").split()
    out, png, trace = tmp_path / "plan.json", tmp_path / "plan.png", tmp_path / "trace.json"

    def run(*flags):
        proc = subprocess.run([sys.executable, tool, *flags], capture_output=True, text=True, timeout=300,
                              env=child_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "plan: peak" in proc.stdout
        return load_plan_summary(str(out))

    first = run("--planner", "cpsat", "--out", str(out), "--png", str(png), "--save-trace", str(trace), "--", *model)
    assert png.stat().st_size > 10_000
    assert set(first["level1"]) == {"fwd L1", "fwd L2", "bwd L1", "bwd L2"}  # the last two keep theirs
    assert {label for label, _ in first["replay"]["marks"]} == {f"{what} {k} L{i}" for what in ("begin", "end")
                                                                for k in ("fwd", "bwd") for i in (1, 2)}
    assert first["peak_bytes"] >= first["lower_bound_bytes"] > 0
    again = run("--trace", str(trace), "--planner", "cpsat", "--out", str(out))
    assert again["peak_bytes"] == first["peak_bytes"]
    # what the run is that can reuse it, through the saved trace too
    assert first["planned_for"]["memo_swap_fraction"] == 0.5 and first["planned_for"]["seq_length"] == 128
    assert again["planned_for"] == first["planned_for"]
    # the same requests and marks (CP-SAT's parallel search may place them differently at the same peak)
    assert [again["replay"][k] == first["replay"][k] for k in ("sizes", "marks")] == [True, True]
    bad = subprocess.run([sys.executable, tool, "--", "--num-layers", "4"], capture_output=True, text=True,
                         timeout=300, env=child_env())
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "model flags: " in lines[-1] and "--hidden-size" in lines[-1]


def test_bandwidth_is_the_slower_direction(monkeypatch):
    """MEMO's LP gets the slower of the offload (device to host, in forward) and the prefetch (host
    to device, in backward): both must hide behind compute."""
    from megatron.longseq.memo import profiler

    calls = []

    def rate(dst, src, device, copies=4):
        calls.append((dst, src))
        return 2e9 if len(calls) == 1 else 1e9
    monkeypatch.setattr(profiler, "copy_rate", rate)
    assert profiler.bandwidth(torch.device("cpu")) == 1e9
    (a, b), (c, d) = calls
    assert a is d and b is c  # one way and back between the same two buffers
    monkeypatch.undo()
    assert 0 < profiler.copy_rate(torch.empty(4096), torch.ones(4096), torch.device("cpu")) < float("inf")


def test_layer_time_is_the_median_after_a_warm_up(monkeypatch):
    """The LP's forward time: a warm-up run left out, then the median of three."""
    from types import SimpleNamespace

    from megatron.longseq.memo import profiler

    class Layer(torch.nn.Linear):
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    ticks = iter([0, 10, 10, 11, 11, 16, 16, 18])  # runs of 10 s (warm-up), 1, 5, 2
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(ticks))
    state = SimpleNamespace(_input_view=[(2, 4)], kwargs={})
    assert profiler._forward_seconds(Layer(4, 4), state, torch.device("cpu")) == 2
