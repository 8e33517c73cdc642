"""Passkey retrieval of Hugging Face models at several lengths: the before / after table of a
context extension.

    python tools/passkey_eval.py --vocab-size 256 --lengths 512 1024 2048 4096 \\
        --model "trained at 512" hf-512/ --model "extended to 4K" hf-4k/ \\
        --model "trained at 512, RoPE base x4, no training" hf-512/ base:40000

Each model is loaded by transformers (float32, CPU) from a directory tools/checkpoint/convert.py
wrote, so the numbers are those of the exported model. A third item changes its RoPE at load
time, without training: `base:THETA` sets the base, `linear:FACTOR` interpolates positions.

The samples are --passkey-data's (megatron/training/passkey.py) with a seed training did not use.
A sample is retrieved when the most likely next token after QUERY, over the whole vocabulary, is
the key; the answer loss is the cross-entropy of the key there (chance: ln 10 = 2.30).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.training.passkey import CHANCE_LOSS, PasskeyDataset  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", action="append", required=True, metavar="LABEL DIR [ROPE]",
                   help="a row: its label, an exported model directory, and optionally base:THETA or linear:FACTOR")
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="sequence lengths (columns)")
    p.add_argument("--vocab-size", type=int, required=True, help="training's --vocab-size (the filler ids)")
    p.add_argument("--depth", type=float, default=0.25, help="training's --passkey-depth")
    p.add_argument("--samples", type=int, default=64, help="samples per length")
    p.add_argument("--batch", type=int, default=8, help="samples per forward pass")
    p.add_argument("--seed", type=int, default=2 ** 20, help="the samples' seed (training used --seed + 0/1000/2000)")
    args = p.parse_args(argv)
    for row in args.model:
        if len(row) not in (2, 3):
            p.error(f"--model takes LABEL DIR [ROPE], got {len(row)} items: {row}")
        if not os.path.isdir(row[1]):
            p.error(f"--model {row[0]!r}: no directory {row[1]}")
        if len(row) == 3 and not re.fullmatch(r"(base|linear):[0-9.eE+]+", row[2]):
            p.error(f"--model {row[0]!r}: the RoPE change is base:THETA or linear:FACTOR, got {row[2]!r}")
    return args


def rope_change(params: dict, change: str) -> dict:
    """transformers' rope parameters after `change`: base:THETA keeps the scaling and sets the
    base; linear:FACTOR keeps the base and replaces any scaling by position interpolation."""
    kind, value = change.split(":")
    if kind == "base":
        return dict(params, rope_theta=float(value))
    return {"rope_type": "linear", "factor": float(value), "rope_theta": params["rope_theta"]}


def load(directory: str, change: Optional[str] = None):
    """The model transformers builds from `directory`, its RoPE changed by `change` if given."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    if change:
        config.rope_parameters = rope_change(config.rope_parameters, change)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32)
    return model.eval()


def score(model, data: PasskeyDataset, batch: int) -> Tuple[float, float]:
    """(fraction retrieved, mean answer loss) over `data`, one key token per sample."""
    hits, loss = 0, 0.0
    for start in range(0, len(data), batch):
        samples = [data[i] for i in range(start, min(start + batch, len(data)))]
        tokens = torch.stack([s["tokens"] for s in samples])  # [b, s]
        keys = torch.stack([s["labels"][-1] for s in samples])  # [b]: the token after QUERY
        with torch.no_grad():
            logits = model(input_ids=tokens).logits[:, -1].float()  # [b, vocab]: the prediction after QUERY
        hits += int((logits.argmax(-1) == keys).sum())
        loss += float(torch.nn.functional.cross_entropy(logits, keys, reduction="sum"))
    return hits / len(data), loss / len(data)


def table(rows: List[Tuple[str, List[Tuple[float, float]]]], lengths: List[int]) -> str:
    """Markdown: a row per model, a column per length, cells "retrieved % (answer loss)"."""
    head = "| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    body = ["| " + label + " | " + " | ".join(f"{100 * acc:.0f}% ({loss:.2f})" for acc, loss in cells) + " |"
            for label, cells in rows]
    return "\n".join([head, rule] + body)


def main(argv=None) -> int:
    args = parse(argv)
    rows = []
    for label, directory, *change in args.model:
        model = load(directory, *change)
        cells = [score(model, PasskeyDataset(args.samples, n, args.vocab_size, seed=args.seed, depth=args.depth), args.batch)
                 for n in args.lengths]
        rows.append((label, cells))
        print(f"{label}: " + ", ".join(f"{n}: {100 * a:.0f}% / {l:.3f}" for n, (a, l) in zip(args.lengths, cells)),
              flush=True)
    print(f"\nretrieved (answer loss, nats; chance {CHANCE_LOSS:.2f}), {args.samples} samples per length\n")
    print(table(rows, args.lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
