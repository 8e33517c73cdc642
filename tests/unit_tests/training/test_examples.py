"""The GPU launch scripts of examples/ (which CI cannot run) pass only flags pretrain_gpt.py takes:
each script runs under bash with stand-ins for its launchers, which write down the command line
they were given, and the flags after pretrain_gpt.py are parsed and validated."""
import os
import stat
from pathlib import Path

from megatron.training.arguments import parse_args
from megatron.training.validate import validate_args

ROOT = Path(__file__).resolve().parents[3]


def _recorded_flags(tmp_path, script: str, env: dict):
    """Run `script` with srun, torchrun and scontrol replaced; the flags it gives pretrain_gpt.py."""
    bin_dir, record = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir()
    for name, body in (("srun", f'printf "%s\\0" "$@" > {record}'), ("torchrun", f'printf "%s\\0" "$@" > {record}'),
                       ("scontrol", "echo node-a")):
        tool = bin_dir / name
        tool.write_text(f"#!/usr/bin/env bash\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **env)
    assert os.spawnve(os.P_WAIT, "/bin/bash", ["bash", str(ROOT / script)], full_env) == 0
    argv = record.read_text().split("\0")[:-1]
    return argv[argv.index("pretrain_gpt.py") + 1:]


def test_one_node_gpu_script_flags_are_valid(tmp_path):
    flags = _recorded_flags(tmp_path, "examples/gpt_1node_gpu.sh", {"GPUS": "8"})
    validate_args(parse_args(flags), world_size=8)


def test_one_node_gpu_script_without_a_gpu_says_so(tmp_path):
    """Not torchrun's AssertionError for --nproc-per-node 0."""
    import subprocess

    proc = subprocess.run(["bash", str(ROOT / "examples/gpt_1node_gpu.sh")], env=dict(os.environ, GPUS="0"),
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "gpt_1node_gpu.sh: no CUDA device visible to torch (examples/quickstart.sh runs on CPU)\n"


def test_slurm_batch_script_flags_parse(tmp_path):
    """Parsed only: its data and tokenizer are the user's (validation reads them)."""
    env = {"SLURM_JOB_NODELIST": "node-a,node-b", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1",
           "SLURM_SUBMIT_DIR": str(ROOT), "DATA": "corpus_text_document", "TOKENIZER": "tokenizer"}
    args = parse_args(_recorded_flags(tmp_path, "examples/slurm/pretrain_gpt.sbatch", env))
    assert args.exit_duration_in_mins == 225  # the save comes before the 4-hour limit
