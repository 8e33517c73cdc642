"""pretrain_gpt.py with --sequence-parallel on CPU ranks, for the functional table: megatron-core's
sequence-parallel buffers pointed at host memory and validation letting the flag through
(tests/unit_tests/model_utils.sequence_parallel_on_host), so that gloo runs the same collectives.

    python tests/functional_tests/sequence_parallel_on_host.py <pretrain_gpt.py flags>    (per rank)
"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the tests package, from a run started in another directory
    from tests.unit_tests.model_utils import sequence_parallel_on_host

    sequence_parallel_on_host()
    sys.argv = [str(ROOT / "pretrain_gpt.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
