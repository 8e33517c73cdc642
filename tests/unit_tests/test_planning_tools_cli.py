"""The planning and benchmark tools' command lines: a bad argument is one argparse-style line and
exit status 2 before any work, --help shows the whole description and every default, and a
benchmark whose rows were not all measured says so in its exit status."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import (benchmark_attention, benchmark_gpt, benchmark_memo, cli, gpu_suite, pipeline_simulator,
                   plan_context_parallel, plan_memory)

ROOT = Path(__file__).resolve().parents[2]
PLAN = "--seq-length 131072 --hidden-size 4096 --num-attention-heads 32".split()
TINY_GPT = ["--model", "tiny", "--seq-lengths", "128"]
TINY_MEMO = ["--shape", "tiny", "--seq-lengths", "128", "--modes", "none"]

BAD = [  # (tool, argv, the error line's text after "error: "); "{tmp}" is a temporary directory
    (pipeline_simulator, ["--pipeline-size", "0"], "argument --pipeline-size: must be positive, got 0"),
    (pipeline_simulator, ["--pipeline-size", "-2"], "argument --pipeline-size: must be positive, got -2"),
    (pipeline_simulator, ["--micro-batches", "0"], "argument --micro-batches: must be positive, got 0"),
    (pipeline_simulator, ["--chunks", "0"], "argument --chunks: must be positive, got 0"),
    (pipeline_simulator, ["--splits", "0"], "argument --splits: must be positive, got 0"),
    (pipeline_simulator, ["--seq-length", "0"], "argument --seq-length: must be positive, got 0"),
    (pipeline_simulator, ["--num-layers", "0"], "argument --num-layers: must be positive, got 0"),
    (pipeline_simulator, ["--hidden-size", "0"], "argument --hidden-size: must be positive, got 0"),
    (pipeline_simulator, ["--documents", "-5"], "argument --documents: must be positive and finite, got -5"),
    (pipeline_simulator, ["--documents", "0"], "argument --documents: must be positive and finite, got 0"),
    (pipeline_simulator, ["--png", "/nonexistent/x.png"],
     "argument --png: no directory /nonexistent to write /nonexistent/x.png in"),
    (pipeline_simulator, ["--chunks", "2", "--micro-batches", "6"],
     "the baseline 1F1B-I (--splits 1): the interleaved schedule runs the 6 micro-batches x 1 segments = 6 units "
     "in groups of the pipeline size 4: 6 is not divisible by 4"),
    (pipeline_simulator, ["--pipeline-size", "1", "--micro-batches", "4", "--splits", "2", "--chunks", "2"],
     "an interleaved schedule (--chunks 2) needs --pipeline-size > 1"),  # as the trainer refuses it
    (pipeline_simulator, ["--seq-length", "3"],
     "--splits 4 does not fit --seq-length 3: at most one segment per token"),
    (pipeline_simulator, ["--documents", "100", "--chunks", "2"],
     "--documents runs without interleaving: leave out --chunks 2"),
    (pipeline_simulator, ["--documents", "100", "--strategy", "average"],
     "--documents does not read --strategy: leave it out"),
    (pipeline_simulator, ["--paper-table", "--splits", "8", "--png", "t.png"],
     "--paper-table does not read --splits, --png: leave it out"),
    (pipeline_simulator, ["--from-run", "d", "--pipeline-size", "2"],
     "--from-run does not read --pipeline-size: leave it out"),
    (plan_context_parallel, PLAN + ["--num-attention-heads", "0", "--context-parallel-size", "8"],
     "argument --num-attention-heads: must be positive, got 0"),
    (plan_context_parallel, PLAN + ["--gpus-per-node", "0", "--context-parallel-size", "8"],
     "argument --gpus-per-node: must be positive, got 0"),
    (plan_context_parallel, PLAN + ["--nic-gbps", "0", "--context-parallel-size", "8"],
     "argument --nic-gbps: must be positive and finite, got 0"),
    (plan_context_parallel, ["--document-balance", "--seq-length", "4096", "--document-mean-length", "512",
                             "--context-parallel-size", "0"],
     "argument --context-parallel-size: must be positive, got 0"),
    (plan_context_parallel, PLAN + ["--document-samples", "0", "--context-parallel-size", "8"],
     "argument --document-samples: must be positive, got 0"),
    (plan_context_parallel, PLAN + ["--document-mean-length", "-1", "--context-parallel-size", "8"],
     "argument --document-mean-length: must be positive and finite, got -1"),
    (plan_context_parallel, PLAN + ["--context-parallel-size", "0"],
     "argument --context-parallel-size: must be positive, got 0"),
    (plan_context_parallel, PLAN + ["--context-parallel-size", "-4"],
     "argument --context-parallel-size: must be positive, got -4"),
    (plan_context_parallel, ["--seq-length", "0", "--hidden-size", "4096", "--num-attention-heads", "32",
                             "--context-parallel-size", "8"], "argument --seq-length: must be positive, got 0"),
    (plan_context_parallel, PLAN + ["--num-query-groups", "0", "--context-parallel-size", "8"],
     "argument --num-query-groups: must be positive, got 0"),
    (plan_context_parallel, ["--seq-length", "4096", "--hidden-size", "100", "--num-attention-heads", "3",
                             "--context-parallel-size", "2"],
     "--num-attention-heads 3 does not divide --hidden-size 100"),
    (plan_context_parallel, PLAN + ["--num-query-groups", "5", "--context-parallel-size", "8"],
     "--num-query-groups 5 does not divide --num-attention-heads 32"),
    (plan_context_parallel, ["--seq-length", "1000", "--hidden-size", "4096", "--num-attention-heads", "32",
                             "--context-parallel-size", "16"],
     "--seq-length 1000 is not divisible by 2 x --context-parallel-size 16"),
    (plan_context_parallel, PLAN + ["--num-query-groups", "8", "--tensor-model-parallel-size", "16",
                                    "--context-parallel-size", "8"],
     "--num-query-groups 8 is not divisible by --tensor-model-parallel-size 16"),
    (plan_memory, ["--trace", "/nonexistent.json"],
     "--trace /nonexistent.json: cannot read it: No such file or directory"),
    (plan_memory, ["--trace", "{tmp}/bad.json"],
     "--trace {tmp}/bad.json is not a memo trace file (JSONDecodeError: "
     "Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (plan_memory, ["--trace", "{tmp}/other.json"], "--trace {tmp}/other.json is not a memo trace file"),
    (plan_memory, ["--trace", "{tmp}/bad.json", "--time-limit", "-1"],
     "argument --time-limit: must be positive and finite, got -1"),
    (plan_memory, ["--trace", "{tmp}/bad.json", "--out", "/nonexistent/p.json"],
     "argument --out: no directory /nonexistent to write /nonexistent/p.json in"),
    (plan_memory, ["--trace", "{tmp}/bad.json", "--out", "{tmp}"], "argument --out: {tmp} is a directory: name a file"),
    (plan_memory, ["--trace", "{tmp}/bad.json", "--png", "{tmp}/plan.txt"],
     "argument --png: {tmp}/plan.txt: name a drawing by its kind, one of .png, .pdf, .svg, .jpg, .jpeg"),
    (plan_memory, ["--out", "{tmp}/p.json", "--", "--num-layers", "2"],  # the trainer would refuse the plan
     "--out writes a plan for pretrain_gpt.py --memo-plan, which needs --memo: add it to the model flags"),
    (plan_memory, ["--trace", "{tmp}/bad.json", "--save-trace", "{tmp}/t.json"],
     "--save-trace writes a profiled trace: --trace reads one, there is none to write"),
    (plan_memory, ["--trace", "{tmp}/dup.json"], "--trace {tmp}/dup.json is not a memo trace file (ValueError: "
                                                 "event 1 ['malloc', 'a', 512] allocates 'a', which is still alive)"),
    (plan_memory, ["--trace", "{tmp}/sizes.json"],
     "--trace {tmp}/sizes.json is not a memo trace file (ValueError: "
     "event 0 ['malloc', 'a', 1.5] is not [malloc|free|mark, id, bytes >= 0])"),
    (plan_memory, [], "give --trace PATH or pretrain_gpt.py model flags after --"),
    (pipeline_simulator, ["--documents", "inf", "--seq-length", "1024"],
     "argument --documents: must be positive and finite, got inf"),
    (plan_memory, ["--trace", "{tmp}/bad.json", "--", "--num-layers", "2"],
     "give --trace PATH or pretrain_gpt.py model flags after --, not both"),
    (benchmark_gpt, TINY_GPT + ["--iters", "0"], "argument --iters: must be positive, got 0"),
    (benchmark_gpt, TINY_GPT + ["--iters", "2", "--warmup", "1"],
     "--iters 2 leaves no iteration to measure: the means drop the first max(--warmup, 2) = 2 logged iterations"),
    (benchmark_gpt, TINY_GPT + ["--iters", "5", "--warmup", "5"],
     "--iters 5 leaves no iteration to measure: the means drop the first max(--warmup, 2) = 5 logged iterations"),
    (benchmark_gpt, TINY_GPT + ["--warmup", "-1"], "argument --warmup: must be non-negative, got -1"),
    (benchmark_gpt, TINY_GPT + ["--", "--bogus-flag"], "pretrain_gpt.py flags: unrecognized arguments: --bogus-flag"),
    (benchmark_gpt, TINY_GPT + ["--log-dir", "/proc/nope"],
     "--log-dir: cannot make the directory /proc/nope: No such file or directory"),
    (benchmark_memo, TINY_MEMO + ["--iters", "1", "--warmup", "1"],
     "--iters 1 leaves no iteration to measure: the means drop the first max(--warmup, 2) = 2 logged iterations"),
    (benchmark_memo, TINY_MEMO + ["--", "--hidden-size", "x"], "pretrain_gpt.py flags: --hidden-size: invalid int "
                                                               "value: 'x'"),
    (benchmark_memo, TINY_MEMO + ["--log-dir", "/proc/nope"],
     "--log-dir: cannot make the directory /proc/nope: No such file or directory"),
    (benchmark_attention, ["--iters", "0"], "argument --iters: must be positive, got 0"),
    (benchmark_attention, ["--heads", "4", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
    (benchmark_attention, ["--backend", "bogus"], "argument --backend: invalid choice: 'bogus' (choose from 'auto', "
                                                  "'flash', 'fused', 'unfused', 'local')"),
    (benchmark_attention, ["--seq-lengths", "130", "--ring", "4"],
     "--seq-lengths 130 is not divisible by 2 x --ring 4"),
    (benchmark_attention, ["--seq-lengths", "0"], "argument --seq-lengths: must be positive, got 0"),
    (gpu_suite, ["{tmp}/afile"], "argument out: cannot make the directory {tmp}/afile: File exists"),
    (gpu_suite, ["{tmp}/out", "--budget", "0"], "argument --budget: must be positive and finite, got 0"),
]


def _refusal(tool, argv, capsys):
    """(exit status, stdout, stderr) of tool.main(argv) as the script runs it (cli.run)."""
    try:
        code = cli.run(tool.main, argv)
    except SystemExit as stop:  # argparse's own refusal
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    (tmp_path / "afile").write_text("")
    for name, events in (("dup", [["malloc", "a", 512], ["malloc", "a", 512]]), ("sizes", [["malloc", "a", 1.5]])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"format": "memo-trace-1", "events": events}))
    return tmp_path


@pytest.mark.parametrize("tool, argv, message", BAD, ids=[f"{t.__name__.split('.')[-1]}:{' '.join(a)}"
                                                           for t, a, _ in BAD])
def test_a_bad_argument_is_one_line_before_any_work(tool, argv, message, files, capsys, monkeypatch):
    for runs in (benchmark_gpt.Runs, benchmark_memo.Runs):  # no benchmark run may start
        monkeypatch.setattr(runs, "__call__", lambda *a: pytest.fail("a run started"))
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    code, out, err = _refusal(tool, argv, capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].split(": error: ", 1)[1] == message.replace("{tmp}", str(files))
    assert not (files / "out").exists()  # gpu_suite made no directory for a refused command


def test_the_timeline_is_labelled_in_whole_model_forwards(tmp_path, capsys, monkeypatch):
    """The costs are flops / (one micro-batch's whole-model forward) / (P v): the x axis says so."""
    drawn = []
    monkeypatch.setattr(pipeline_simulator, "plot", lambda *a: drawn.append(a))
    pipeline_simulator.main(["--pipeline-size", "2", "--micro-batches", "2", "--splits", "2",
                             "--png", str(tmp_path / "t.png")])
    assert drawn[0][-1] == "one micro-batch's forward on the whole model"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 't.png'}"


def test_the_documents_table_runs_for_a_given_mean(capsys):
    pipeline_simulator.main(["--documents", "64", "--seq-length", "1024", "--pipeline-size", "2",
                             "--micro-batches", "2", "--splits", "2", "--num-layers", "2", "--hidden-size", "64"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["static", "per"] and all(float(r[-1]) >= 0 for r in rows)


def test_a_malformed_recorded_timeline_is_one_line(tmp_path, capsys):
    (tmp_path / "rank_0.json").write_text('{"stage": 0}')
    code, out, err = _refusal(pipeline_simulator, ["--from-run", str(tmp_path)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"--from-run {tmp_path}/rank_0.json: not a recorded timeline "
                                                 "(KeyError: 'stages')")


def test_timelines_of_two_runs_in_one_directory_are_refused(tmp_path, capsys):
    """A 2-stage run recorded where a 4-stage run left rank_2/3.json: mixed, its bubble would be
    of 4 stages' span."""
    op = [["F0:0.0", 0.0, 1.0]]
    for stage, stages in ((0, 2), (1, 2), (2, 4), (3, 4)):
        (tmp_path / f"rank_{stage}.json").write_text(json.dumps({"stage": stage, "stages": stages, "events": op}))
    code, out, err = _refusal(pipeline_simulator, ["--from-run", str(tmp_path)], capsys)
    assert code == 2 and out == "" and err.strip().splitlines()[-1].endswith(
        f"--from-run {tmp_path}: files of runs with different stage counts (rank_0.json: 2 stages, rank_1.json: "
        "2 stages, rank_2.json: 4 stages, rank_3.json: 4 stages): record into an empty directory")


@pytest.mark.parametrize("groups, kv_heads", [([], 32), (["--num-query-groups", "8"], 8)])
def test_query_groups_default_to_the_heads_only_when_left_out(groups, kv_heads, capsys):
    plan_context_parallel.main(PLAN + groups + ["--context-parallel-size", "8", "--top", "1"])
    assert f" H=32 H_kv={kv_heads} d_sp=8 " in capsys.readouterr().out.splitlines()[0]


def test_a_list_that_is_no_trace_is_refused(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[]")
    code, _, err = _refusal(plan_memory, ["--trace", str(tmp_path / "list.json")], capsys)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        f"--trace {tmp_path}/list.json is not a memo trace file (AttributeError: 'list' object has no attribute 'get')")


TOOLS = [pipeline_simulator, plan_context_parallel, plan_memory, benchmark_gpt, benchmark_memo, benchmark_attention,
         gpu_suite]


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t.__name__.split(".")[-1])
def test_help_shows_the_whole_description_and_every_default(tool, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: its default is found whole
    made = []
    monkeypatch.setattr(cli, "parser", lambda doc, real=cli.parser, **kw: made.append(real(doc, **kw)) or made[-1])
    with pytest.raises(SystemExit) as stop:
        tool.main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and tool.__doc__.strip() in out
    for action in made[0]._actions:
        if action.dest == "help" or (not action.option_strings and action.nargs is None):  # a required positional
            continue
        assert action.help, action.dest
        if action.nargs == 0 or "default" in action.help:  # a switch, or a help naming its default
            assert f"{action.help} (default:" not in " ".join(out.split()), action.dest
        else:
            assert f"(default: {action.default})" in out, action.dest
    if tool is plan_memory:  # the model flags' place
        assert "-- PRETRAIN_GPT_MODEL_FLAGS" in out.splitlines()[0] and "model flags after `--`" in out


def _gpt_rows(monkeypatch, statuses):
    """benchmark_gpt.main over tiny lengths whose runs end with `statuses` (output: none)."""
    said = iter(statuses)
    monkeypatch.setattr(benchmark_gpt.Runs, "__call__", lambda self, cmd, name: (next(said), "boom"))
    monkeypatch.setattr(benchmark_gpt, "device_name", lambda: "CPU")
    return benchmark_gpt.main(["--model", "tiny", "--seq-lengths", "128", "256", "--iters", "3", "--warmup", "1"])


def test_a_benchmark_row_without_a_measurement_makes_the_exit_status_1(monkeypatch, capsys):
    assert _gpt_rows(monkeypatch, ["failed", "failed"]) == benchmark_gpt.UNMEASURED == 1
    out, err = capsys.readouterr()
    assert [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| 1")] == ["failed"]
    assert "| 256 | failed |" in out and err.endswith("2 of 2 lengths not measured\n")
    # out of memory, then out of memory again with full recompute: still no number for the row
    assert _gpt_rows(monkeypatch, ["out of memory", "out of memory", "failed"]) == 1
    assert "| 128 | out of memory | | | | full |" in capsys.readouterr().out


def _memo_search(monkeypatch, statuses, modes=("none",)):
    said = iter(statuses)
    monkeypatch.setattr(benchmark_memo.Runs, "__call__", lambda self, cmd, name: (next(said), "boom"))
    monkeypatch.setattr(benchmark_memo, "device_name", lambda: "CPU")
    return benchmark_memo.main(["--shape", "tiny", "--seq-lengths", "128", "256", "--iters", "3", "--modes", *modes])


@pytest.mark.parametrize("statuses, unfinished", [
    (["out of memory", "out of memory"], []),  # each mode's limit found: the finding, not a failure
    (["out of memory", "timeout"], []),
    (["failed", "out of memory"], ["none"]),
    (["out of memory", "stopped (budget)"], ["full"]),  # the budget ended a search before its limit
    (["not run (budget)", "not run (budget)"], ["none", "full"]),
])
def test_a_memo_search_fails_only_short_of_its_limit(statuses, unfinished, monkeypatch, capsys):
    assert _memo_search(monkeypatch, statuses, modes=("none", "full")) == (1 if unfinished else 0)
    out, err = capsys.readouterr()
    assert f"| full | 128 | {statuses[1]} |" in out and out.rstrip().endswith("| full | none |")
    assert err == (f"modes whose search did not end at a limit: {' '.join(unfinished)}\n" if unfinished else "")


def test_memo_bandwidth_without_cuda_is_one_line(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _refusal(benchmark_memo, ["--bandwidth"], capsys)
    assert code == 2 and out == "" and err == ("tool: error: --bandwidth: pinned copies are measured to and from a "
                                               "CUDA device; none is visible\n")


def test_the_gpu_suite_records_a_tool_by_its_exit_status(tmp_path, monkeypatch):
    """A benchmark that exits 1 has rows without a measurement: "failed (exit 1)", even where its
    table says a row ran out of memory; pretrain_gpt.py's own run out of memory is still named."""
    def fake_run(cmd, timeout, log):
        log.write_text("")
        return 1, "| 32768 | out of memory | | | | full |\nCUDA out of memory"
    monkeypatch.setattr(gpu_suite, "run_pretrain", fake_run)
    suite = gpu_suite.Suite(tmp_path, 60.0, cuda=False)
    try:
        assert suite.command("gpt", gpu_suite.tool("benchmark_gpt.py"), 10)[0] == "failed (exit 1)"
        trainer = [sys.executable, str(ROOT / "pretrain_gpt.py")]
        assert suite.command("smoke", trainer, 10)[0] == "out of memory"
    finally:
        suite.close()


def test_the_gpu_suite_part_of_a_tool_that_exits_1_is_not_ok(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_suite.PARTS, "fake", lambda cuda: [("bench", gpu_suite.tool("benchmark_gpt.py"), 10)])
    monkeypatch.setattr(gpu_suite, "run_pretrain", lambda cmd, timeout, log: (log.write_text(""), (1, "| x |"))[1])
    suite = gpu_suite.Suite(tmp_path, 60.0, cuda=False)
    assert not suite.part("fake")
    suite.close()
    assert json.loads((tmp_path / "suite.json").read_text())["parts"]["fake"]["status"] == "not all ok"


def test_the_suites_own_benchmark_commands_pass_the_up_front_checks():
    """The CPU and CUDA commands the GPU suite gives the benchmarks are not refused by their checks."""
    for cuda in (False, True):
        for name in ("gpt", "memo-none", "memo", "memo-expandable", "attention"):
            for _, cmd, _ in gpu_suite.PARTS[name](cuda) or []:
                tool = {"benchmark_gpt.py": benchmark_gpt, "benchmark_memo.py": benchmark_memo,
                        "benchmark_attention.py": benchmark_attention}[Path(cmd[1]).name]
                flags = [a for a in cmd[2:] if a != "--log-dir" and not a.startswith("/tmp/gpu_suite")]
                assert tool.arguments(flags) is not None, cmd


@pytest.mark.parametrize("argv, line", [
    (["tools/pipeline_simulator.py", "--chunks", "2", "--micro-batches", "6"], "pipeline_simulator.py: error: the "
     "baseline 1F1B-I (--splits 1): the interleaved schedule runs the 6 micro-batches x 1 segments = 6 units in "
     "groups of the pipeline size 4: 6 is not divisible by 4"),
    (["tools/benchmark_memo.py", "--shape", "tiny", "--seq-lengths", "128", "--modes", "none", "--iters", "1",
      "--warmup", "1"], "benchmark_memo.py: error: --iters 1 leaves no iteration to measure: the means drop the "
                        "first max(--warmup, 2) = 2 logged iterations"),
])
def test_as_scripts_a_refusal_is_one_line_and_status_2(argv, line):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.splitlines()[-1] == line, proc.stderr


def test_attention_help_prints_no_warnings():
    """megatron.longseq's warning filter is in place before megatron-core is imported."""
    proc = subprocess.run([sys.executable, "tools/benchmark_attention.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.startswith("usage: benchmark_attention.py")
