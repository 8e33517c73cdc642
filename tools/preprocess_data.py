"""JSONL -> Megatron indexed dataset (.bin/.idx), tokenized with a local tokenizer.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 4

writes data/corpus_text_document.{bin,idx} (one file pair per --json-keys key), readable by
megatron-core's GPTDataset: pass `--data-path data/corpus_text_document` to pretrain_gpt.py.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from megatron.training.problems import flag  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", required=True,
                   choices=["NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"])
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: text is whitespace-separated ids")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=10000)
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"--input: cannot read {args.input}")
    needs = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "HuggingFaceTokenizer": ("tokenizer_model",),
             "NullTokenizer": ("vocab_size",)}[args.tokenizer_type]
    missing = [flag(name) for name in needs if getattr(args, name) is None]
    if missing:
        p.error(f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")
    return args


class Encoder:
    """Per-process tokenizer (built once per worker)."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, line: str):
        doc = json.loads(line)
        out = {}
        for key in self.args.json_keys:
            text = doc[key]
            if self.args.tokenizer_type == "NullTokenizer":
                ids = [int(t) for t in text.split()]  # NullTokenizer has no text form
            else:
                ids = list(Encoder.tokenizer.tokenize(text))
            if self.args.append_eod and ids:  # an empty text stays empty: no lone EOD, as Megatron
                ids.append(Encoder.tokenizer.eod)
            out[key] = ids
        return out, len(line)


def main(argv=None):
    args = parse_args(argv)
    encoder = Encoder(args)
    encoder.initializer()
    vocab_size = Encoder.tokenizer.vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    builders, paths = {}, {}
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        paths[key] = prefix
        builders[key] = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    start, docs, nbytes = time.time(), 0, 0
    with open(args.input, encoding="utf-8") as fin:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode, fin, chunksize=32)
        else:
            results = map(encoder.encode, fin)
        for encoded, size in results:
            docs, nbytes = docs + 1, nbytes + size
            for key, ids in encoded.items():
                # every line is a document of every key (an empty one holds no sequence), so the
                # keys' datasets stay aligned by index, as Megatron's do
                builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)] if ids else [])
            if docs % args.log_interval == 0:
                mb = nbytes / 1024 / 1024
                print(f"processed {docs} documents ({mb / (time.time() - start):.2f} MB/s)", flush=True)
    for key, builder in builders.items():
        builder.finalize(paths[key] + ".idx")
        print(f"wrote {paths[key]}.bin/.idx ({docs} documents, vocab {vocab_size}, {np.dtype(dtype).name})")


if __name__ == "__main__":
    main()
