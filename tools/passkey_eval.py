"""Passkey retrieval of Hugging Face models at several lengths: the before / after table of a
context extension.

    python tools/passkey_eval.py --vocab-size 256 --lengths 512 1024 2048 4096 \\
        --model "trained at 512" hf-512/ --model "extended to 4K" hf-4k/ \\
        --model "trained at 512, RoPE base x4, no training" hf-512/ base:40000

Each model is loaded by transformers (float32, CPU) from a directory tools/checkpoint/convert.py
wrote, so the numbers are those of the exported model. A third item changes its RoPE at load
time, without training: `base:THETA` sets the base, `linear:FACTOR` interpolates positions.

The samples are --passkey-data's (megatron/training/passkey.py) with a seed training did not use;
give training's --vocab-size, --passkey-length and --passkey-depth. A sample is retrieved when each
key token is the most likely next token, over the whole vocabulary, given the true tokens before it
(QUERY and the key so far); the answer loss is the mean cross-entropy of the key tokens (chance:
ln 10 = 2.30 per token). It is taken over the exported vocabulary: the trainer's validation loss
on the same samples also spreads probability over the padded rows the export cuts off, so it sits
above this one by up to log(1 + padded mass / exported mass).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.training.passkey import CHANCE_LOSS, PasskeyDataset  # noqa: E402
from tools import cli  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--model", nargs="+", action="append", required=True, metavar="LABEL DIR [ROPE]",
                   help="a row: its label, an exported model directory, and optionally base:THETA or linear:FACTOR")
    p.add_argument("--lengths", type=cli.positive_int, nargs="+", required=True, help="sequence lengths (columns)")
    p.add_argument("--vocab-size", type=cli.positive_int, required=True,
                   help="training's --vocab-size (the filler ids)")
    p.add_argument("--passkey-length", type=cli.positive_int, default=1, help="training's --passkey-length")
    p.add_argument("--depth", type=float, default=0.25, help="training's --passkey-depth")
    p.add_argument("--samples", type=cli.positive_int, default=64, help="samples per length")
    p.add_argument("--batch", type=cli.positive_int, default=8, help="samples per forward pass")
    p.add_argument("--seed", type=cli.nonnegative_int, default=2 ** 20,  # numpy's generator takes no negative seed
                   help="the samples' seed (training used --seed + 0/1000/2000)")
    args = p.parse_args(argv)
    for n in args.lengths:  # the samples' own checks, before any model is loaded
        try:
            samples_at(args, n)
        except ValueError as err:
            p.error(str(err))
    for row in args.model:
        check_model(p, row, args.vocab_size)
    return args


def samples_at(args, length: int) -> PasskeyDataset:
    return PasskeyDataset(args.samples, length, args.vocab_size, args.passkey_length, seed=args.seed,
                          depth=args.depth)


def check_model(p: argparse.ArgumentParser, row: List[str], vocab_size: int) -> None:
    """A --model row names an export whose vocabulary holds the filler ids and, given a RoPE change,
    a RoPE to change: refused here rather than as a traceback after the models before it ran."""
    if len(row) not in (2, 3):
        p.error(f"--model takes LABEL DIR [ROPE], got {len(row)} items: {row}")
    label, directory = row[:2]
    if not os.path.isdir(directory):
        p.error(f"--model {label!r}: no directory {directory}")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        p.error(f"--model {label!r}: no config.json in {directory}; give a directory written by "
                "tools/checkpoint/convert.py --saver hf")
    if len(row) == 3:
        try:
            rope_value(row[2])
        except ValueError as err:
            p.error(f"--model {label!r}: {err}")
    config = read_config(p, label, directory)
    if vocab_size > config.vocab_size:
        p.error(f"--model {label!r}: --vocab-size {vocab_size} is larger than the model's vocabulary "
                f"({config.vocab_size}): the filler ids would be outside it")
    if type(config) not in transformers_causal_lms():
        p.error(f"--model {label!r}: {directory} holds a {config.model_type} model, not a causal language model")
    if len(row) == 3 and not getattr(config, "rope_parameters", None):
        p.error(f"--model {label!r}: the model has no RoPE parameters to change")
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")):
        if not readable_weights(os.path.join(directory, name)):
            p.error(f"--model {label!r}: {os.path.join(directory, name)} is not a readable safetensors file")


def readable_weights(path: str) -> bool:
    """The file's header reads (a cut or corrupt export fails here, before any model runs)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception:  # noqa: BLE001 -- safetensors raises its own SafetensorError, an Exception
        return False
    return True


def transformers_causal_lms():
    """The configurations AutoModelForCausalLM can build a model from."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING


def read_config(p: argparse.ArgumentParser, label: str, directory: str):
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as err:  # a config.json transformers cannot read
        p.error(f"--model {label!r}: cannot read {os.path.join(directory, 'config.json')}: "
                f"{str(err).splitlines()[0]}")


def rope_value(change: str) -> Tuple[str, float]:
    """(kind, value) of base:THETA or linear:FACTOR; a ValueError unless the value is a positive
    finite number (a zero factor would divide positions by zero: NaN scores, not an error)."""
    kind, _, text = change.partition(":")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if kind not in ("base", "linear") or not (math.isfinite(value) and value > 0):
        raise ValueError(f"the RoPE change is base:THETA or linear:FACTOR, got {change!r}; "
                         "THETA and FACTOR are positive numbers")
    return kind, value


def rope_change(params: dict, change: str) -> dict:
    """transformers' rope parameters after `change`: base:THETA keeps the scaling and sets the
    base; linear:FACTOR keeps the base and replaces any scaling by position interpolation."""
    kind, value = rope_value(change)
    if kind == "base":
        return dict(params, rope_theta=value)
    return {"rope_type": "linear", "factor": value, "rope_theta": params["rope_theta"]}


def load(directory: str, change: Optional[str] = None):
    """The model transformers builds from `directory`, its RoPE changed by `change` if given."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    if change:
        config.rope_parameters = rope_change(config.rope_parameters, change)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32)
    return model.eval()


def score(model, data: PasskeyDataset, batch: int) -> Tuple[float, float]:
    """(fraction retrieved, mean answer loss) over `data`. The answer is the last key_length labels,
    the ones the trainer's loss_mask holds; each is predicted from the true tokens before it (the
    query and the key so far), so a sample is retrieved when every key token is the argmax at its
    position, and its loss is the mean over its key tokens, as the trainer's masked mean."""
    n = data.key_length
    hits, loss = 0, 0.0
    for start in range(0, len(data), batch):
        samples = [data[i] for i in range(start, min(start + batch, len(data)))]
        tokens = torch.stack([s["tokens"] for s in samples])  # [b, s]
        keys = torch.stack([s["labels"][-n:] for s in samples])  # [b, n]: the key after QUERY
        with torch.no_grad():
            # [b, n, vocab]: the predictions of the key alone (not [b, s, vocab]: 2 GB per 4K-token
            # sample at a 128K vocabulary)
            logits = model(input_ids=tokens, logits_to_keep=n).logits.float()
        hits += int((logits.argmax(-1) == keys).all(-1).sum())
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), keys.flatten(), reduction="none")
        loss += float(ce.view(-1, n).mean(-1).sum())
    return hits / len(data), loss / len(data)


def percent(accuracy: float) -> str:
    """Whole percent rounded down: 255 of 256 retrieved is 99%, never 100%."""
    return f"{math.floor(100 * accuracy + 1e-9):.0f}%"  # 1e-9: 0.29 * 100 is 28.999999999999996


def table(rows: List[Tuple[str, List[Tuple[float, float]]]], lengths: List[int]) -> str:
    """Markdown: a row per model, a column per length, cells "retrieved % (answer loss)"."""
    head = "| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    body = ["| " + label + " | " + " | ".join(f"{percent(acc)} ({loss:.2f})" for acc, loss in cells) + " |"
            for label, cells in rows]
    return "\n".join([head, rule] + body)


def evaluate(argv=None) -> int:
    args = parse(argv)
    rows = []
    for label, directory, *change in args.model:
        model = load_row(label, directory, *change)
        cells = [score(model, samples_at(args, n), args.batch) for n in args.lengths]
        rows.append((label, cells))
        print(f"{label}: " + ", ".join(f"{n}: {percent(a)} / {l:.3f}" for n, (a, l) in zip(args.lengths, cells)),
              flush=True)
    print(f"\nretrieved (answer loss, nats per key token; chance {CHANCE_LOSS:.2f}), "
          f"{args.samples} samples per length\n")
    print(table(rows, args.lengths))
    return 0


def load_row(label: str, directory: str, change: Optional[str] = None):
    try:
        return load(directory, change)
    except OSError as err:  # a config.json without its weights, or weights transformers cannot read
        raise cli.ToolError(f"--model {label!r}: cannot load {directory}: {str(err).splitlines()[0]}") from err


def main(argv=None) -> int:
    return cli.run(evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
