"""Extract the command lines of Megatron-LM's GPT functional tests (training configs only) into
`gpt_training_flags.json`: test name -> flag list, as Megatron's launcher would pass them.

    python tests/functional_tests/megatron_configs/extract.py /path/to/Megatron-LM

Only flags and values are kept (no scripts, no metrics). A config with MODE inference or rl is
not a training run and is left out. A value `true` is a bare flag; `false` drops the flag (as
Megatron's launcher does); a list is several values; ${VARS} stay as written (the test replaces them).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).with_name("gpt_training_flags.json")
CASES = "tests/functional_tests/test_cases/gpt"


def flags_of(model_args: dict) -> list:
    out = []
    for flag, value in model_args.items():
        if value is False:
            continue
        out.append(flag)
        if value is True:
            continue
        out += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return out


def main(repo: str) -> None:
    root = Path(repo)
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    configs = {}
    for path in sorted((root / CASES).glob("*/model_config.yaml")):
        blob = yaml.safe_load(path.read_text())
        if blob.get("MODE", "pretraining") != "pretraining" or not blob.get("MODEL_ARGS"):
            continue
        configs[path.parent.name] = flags_of(blob["MODEL_ARGS"])
    OUT.write_text(json.dumps({"source": f"NVIDIA/Megatron-LM@{commit}:{CASES}/*/model_config.yaml",
                               "configs": configs}, indent=1) + "\n")
    print(f"{len(configs)} training configs -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
