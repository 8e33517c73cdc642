"""JSONL -> Megatron indexed dataset (.bin/.idx), tokenized with a local tokenizer.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

writes data/corpus_text_document.{bin,idx} (one file pair per --json-keys key), readable by
megatron-core's GPTDataset: pass `--data-path data/corpus_text_document` to pretrain_gpt.py.
Each key's value is a string or, as Megatron's, a list of strings: its elements are tokenized in
order and concatenated into one document (EOD once, at its end). Blank lines are skipped; a line
that is not a JSON object with every --json-keys key as such (with NullTokenizer: ids below
--vocab-size) stops the run with its line number, and nothing is left under the output names.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from contextlib import nullcontext

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# first: importing megatron.longseq silences megatron-core's import-time Apex / Transformer Engine
# warnings, so that a refusal on stderr stays one line
import megatron.longseq  # noqa: E402,F401
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.problems import flag  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from tools import cli  # noqa: E402

TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "HuggingFaceTokenizer": ("tokenizer_model",),
                   "NullTokenizer": ("vocab_size",)}


def parse_args(argv=None):
    p = cli.parser(__doc__, allow_abbrev=False)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True, type=output_prefix,
                   help="writes PREFIX_KEY_document.{bin,idx}; missing directories are made")
    p.add_argument("--json-keys", nargs="+", default=["text"], type=json_key,
                   help="the keys of each line to tokenize, a dataset each")
    p.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZER_FILES), help="how text becomes ids")
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local tokenizer directory")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=cli.positive_int,
                   help="NullTokenizer: text is whitespace-separated ids, each below this size")
    p.add_argument("--append-eod", action="store_true", help="end each non-empty document with the EOD id")
    p.add_argument("--workers", type=cli.positive_int, default=1, help="tokenizing processes")
    p.add_argument("--log-interval", type=cli.positive_int, default=10000, help="documents between progress lines")
    args = p.parse_args(argv)
    if not (os.path.isfile(args.input) and os.access(args.input, os.R_OK)):
        p.error(f"--input: cannot read {args.input}")
    missing = [flag(name) for name in TOKENIZER_FILES[args.tokenizer_type] if getattr(args, name) is None]
    if missing:
        p.error(f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")
    for name in ("vocab_file", "merge_file"):
        if args.tokenizer_type == "GPT2BPETokenizer" and not os.path.isfile(getattr(args, name)):
            p.error(f"{flag(name)}: no file {getattr(args, name)}")
    unusable = cli.make_directory(output_directory(args.output_prefix))  # last: a refusal leaves no directory
    if unusable:
        p.error(f"--output-prefix: {unusable}")
    return args


def json_key(text: str) -> str:
    """A key names a file, PREFIX_KEY_document.bin: a path separator in it would name a directory."""
    if "/" in text or os.sep in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a path separator; a key names the file "
                                         "PREFIX_KEY_document.bin")
    return text


def document_prefix(prefix: str, key: str) -> str:
    """The dataset of `key`: PREFIX_KEY_document.{bin,idx}."""
    return f"{prefix}_{key}_document"


def output_directory(prefix: str) -> str:
    """The directory the datasets go in: that of a dataset's own path, so that a prefix ending in a
    separator (data/) names data itself, as the files data/_KEY_document.* lie there."""
    return os.path.dirname(os.path.abspath(document_prefix(prefix, "KEY")))


def output_prefix(text: str) -> str:
    """cli.output_path, except that missing directories are made (the README's data/corpus): the
    nearest existing ancestor must be a directory."""
    ancestor = output_directory(text)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise argparse.ArgumentTypeError(f"{ancestor} is not a directory to write {text} in")
    return text


def load_tokenizer(args):
    """build_tokenizer's result, its failures (a missing or malformed file) one line."""
    try:
        return build_tokenizer(args)
    except Exception as err:  # the tokenizers library raises a bare Exception for a bad vocab.json
        where = args.tokenizer_model if args.tokenizer_type == "HuggingFaceTokenizer" else None
        if where is not None and not os.path.exists(where):  # not a directory, nor a cached hub name
            raise cli.ToolError(f"--tokenizer-model: no directory {where}") from err
        said = " ".join(str(err).split())  # transformers' message spans lines: one line, all of it
        raise cli.ToolError(f"cannot load the {args.tokenizer_type}: {said}") from err


class Encoder:
    """Per-process tokenizer (built once per worker). A line it cannot use is a cli.ToolError naming
    the file and line: pickled back from a worker, it still ends the run as one line."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, numbered):
        """({key: ids}, bytes) of line `number`, or None for a blank line."""
        number, line = numbered
        where = f"{self.args.input}:{number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise cli.ToolError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
        if not text.strip():
            # Megatron's json.loads would refuse a blank line; the likeliest is a stray newline at the
            # end of a file, which holds no document, so it is skipped rather than fatal
            return None
        try:
            doc = json.loads(text.rstrip("\r\n"))  # its columns then count in this line alone
        except json.JSONDecodeError as err:
            raise cli.ToolError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(doc, dict):
            raise cli.ToolError(f"{where}: not a JSON object")
        return {key: self.ids(doc, key, where) for key in self.args.json_keys}, len(line)

    def ids(self, doc: dict, key: str, where: str):
        """The document of `key`: a string's ids, or a list's strings' ids in order (Megatron's list of
        sentences, each tokenized on its own)."""
        if key not in doc:
            raise cli.ToolError(f"{where}: no key {key!r} (--json-keys)")
        value = doc[key]
        if isinstance(value, str):
            texts = [(value, f"{where}: {key!r}")]
        elif isinstance(value, list):
            texts = [(text, f"{where}: {key!r}[{i}]") for i, text in enumerate(value)]
        else:
            raise cli.ToolError(f"{where}: {key!r} is {type(value).__name__}, not a string or a list of strings")
        ids = [i for text, named in texts for i in self.text_ids(text, named)]
        if self.args.append_eod and ids:  # an empty text stays empty: no lone EOD, as Megatron
            ids.append(Encoder.tokenizer.eod)
        return ids

    def text_ids(self, text, named: str):
        if not isinstance(text, str):
            raise cli.ToolError(f"{named} is {type(text).__name__}, not a string")
        try:
            text.encode("utf-8")  # JSON can spell a lone surrogate ("\ud800"), which no tokenizer takes
        except UnicodeEncodeError as err:
            why = f"{err.reason} at character {err.start}"
            raise cli.ToolError(f"{named}: cannot be encoded as UTF-8 ({why})") from None
        if self.args.tokenizer_type == "NullTokenizer":
            return null_ids(text, self.args.vocab_size, named)
        return list(Encoder.tokenizer.tokenize(text))


def null_ids(text: str, vocab_size: int, where: str):
    """NullTokenizer has no text form: the text is the ids, each in [0, vocab_size) (vocab_size is
    the EOD id, and a larger id would be outside the model's embedding)."""
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        raise cli.ToolError(f"{where}: NullTokenizer text must be whitespace-separated integer ids") from None
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise cli.ToolError(f"{where}: id {bad} is outside --vocab-size {vocab_size} (ids 0..{vocab_size - 1})")
    return ids


class Outputs:
    """One indexed dataset per key, written under temporary names and renamed only when complete, so
    that a refused line leaves no half-written dataset under the final names."""

    def __init__(self, args, dtype):
        self.prefixes = {key: document_prefix(args.output_prefix, key) for key in args.json_keys}
        self.partial = f".partial-{os.getpid()}"
        self.builders = {key: IndexedDatasetBuilder(prefix + ".bin" + self.partial, dtype=dtype)
                         for key, prefix in self.prefixes.items()}

    def add(self, encoded, dtype):
        for key, ids in encoded.items():
            # every line is a document of every key (an empty one holds no sequence), so the
            # keys' datasets stay aligned by index, as Megatron's do. A list's elements make one
            # sequence, not one each as Megatron's .idx records them: GPTDataset shuffles sequences,
            # and would scatter a document's sentences with no EOD between them
            self.builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)] if ids else [])

    def finish(self):
        for key, prefix in self.prefixes.items():
            self.builders[key].finalize(prefix + ".idx" + self.partial)
            os.replace(prefix + ".bin" + self.partial, prefix + ".bin")  # the .bin first: an .idx means a whole pair
            os.replace(prefix + ".idx" + self.partial, prefix + ".idx")

    def discard(self):
        for key, prefix in self.prefixes.items():
            self.builders[key].data_file.close()
            for path in (prefix + ".bin" + self.partial, prefix + ".idx" + self.partial):
                if os.path.exists(path):
                    os.remove(path)


def encode_all(args, encoder, outputs, dtype) -> int:
    """Documents written. Lines are read as bytes and numbered here, so that any refusal (a worker's
    included) names its line."""
    start, docs, nbytes = time.time(), 0, 0
    # leaving a Pool's block terminates its workers, also when a line was refused
    pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer) if args.workers > 1 else nullcontext()
    with open(args.input, "rb") as fin, pool:
        lines = enumerate(fin, start=1)
        results = map(encoder.encode, lines) if args.workers == 1 else pool.imap(encoder.encode, lines, chunksize=32)
        for result in results:
            if result is None:
                continue
            encoded, size = result
            outputs.add(encoded, dtype)
            docs, nbytes = docs + 1, nbytes + size
            if docs % args.log_interval == 0:
                mb = nbytes / 1024 / 1024
                print(f"processed {docs} documents ({mb / (time.time() - start):.2f} MB/s)", flush=True)
    return docs


def preprocess(argv=None) -> int:
    args = parse_args(argv)
    encoder = Encoder(args)
    Encoder.tokenizer = load_tokenizer(args)  # here, not only in the workers: a pool whose initializer fails hangs
    vocab_size = Encoder.tokenizer.vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    outputs = Outputs(args, dtype)
    try:
        docs = encode_all(args, encoder, outputs, dtype)
    except BaseException:
        outputs.discard()
        raise
    outputs.finish()
    for prefix in outputs.prefixes.values():
        print(f"wrote {prefix}.bin/.idx ({docs} documents, vocab {vocab_size}, {np.dtype(dtype).name})")
    return 0


def main(argv=None) -> int:
    return cli.run(preprocess, argv)


if __name__ == "__main__":
    sys.exit(main())
