"""Command-line checks of the data: where it comes from (mock, passkey, one corpus cut by --split,
or one corpus per split), that every corpus can be read and gives each split documents, the
tokenizer's files, and the output directories; before any work."""
from __future__ import annotations

import os
from typing import Optional

from megatron.training.arguments import ArgsError
from megatron.training.problems import flag, guard, require


# Megatron's per-split corpora, in megatron-core's split order (train, valid, test)
SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")


def data_args(args):
    per_split = any(getattr(args, name) for name in SPLIT_PATHS)
    require(int(args.mock_data) + int(args.passkey_data) + int(bool(args.data_path)) + int(per_split) == 1,
            "give exactly one of --mock-data, --passkey-data, --data-path and --train/valid/test-data-path")
    if args.passkey_data:
        require(args.tokenizer_type == "NullTokenizer", "--passkey-data needs --tokenizer-type NullTokenizer")
        require((args.vocab_size or 0) > 30, f"--passkey-data needs --vocab-size > 30, got {args.vocab_size}")
        require(args.passkey_length >= 1, f"--passkey-length must be >= 1, got {args.passkey_length}")
        require(args.seq_length >= 8 * (args.passkey_length + 2),
                f"--seq-length {args.seq_length} is too short for --passkey-length {args.passkey_length}")
        require(0 < args.passkey_depth <= 1, f"--passkey-depth must be in (0, 1], got {args.passkey_depth}")
    if per_split:
        _per_split_args(args)
    elif args.split is None:
        args.split = "969, 30, 1"  # Megatron's default train/valid/test split
    if args.data_path and _readable_data(args.data_path):
        _check_splits(args)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        if require(args.tokenizer_model is not None and os.path.isdir(args.tokenizer_model),
                   f"--tokenizer-model must be a local directory for HuggingFaceTokenizer, got "
                   f"{args.tokenizer_model} (nothing is downloaded at run time)"):
            require(any(os.path.isfile(os.path.join(args.tokenizer_model, f)) for f in HF_TOKENIZER_FILES),
                    f"--tokenizer-model {args.tokenizer_model} holds no tokenizer ({', '.join(HF_TOKENIZER_FILES)})")
    if args.tokenizer_type == "GPT2BPETokenizer":
        for name in ("vocab_file", "merge_file"):
            path = getattr(args, name)
            require(path is not None and os.path.isfile(path),
                    f"GPT2BPETokenizer needs {flag(name)} pointing at a local file, got {path}")
    require(args.num_workers >= 0, "--num-workers must be >= 0")
    unwritable = [f"{flag(n)} {getattr(args, n)}" for n in ("save", "tensorboard_dir", "data_cache_path")
                  if getattr(args, n, None) and not _writable(getattr(args, n))]
    require(not unwritable, f"cannot create or write {', '.join(unwritable)}")


def _per_split_args(args):
    """Each split reads its own corpus whole: --split has nothing to cut (megatron-core refuses
    the pair), and a split without a corpus is not built (no validation or test pass)."""
    require(args.split is None, f"--split {args.split!r} cuts --data-path, but each split has its own corpus "
                                "with --train/valid/test-data-path: drop --split")
    require(bool(args.train_data_path) or args.skip_train, "--valid/test-data-path need --train-data-path "
                                                           "(or --skip-train)")
    for name in SPLIT_PATHS:
        data_path = getattr(args, name)
        if data_path and _readable_data(data_path, flag(name)):
            for prefix in data_prefixes(data_path, flag(name)):
                # an empty corpus would make megatron-core add empty epochs forever
                require(_documents(prefix, flag(name)) != 0, f"{flag(name)}: {prefix} holds no documents")


def _readable_data(data_path, option="--data-path") -> bool:
    """Every prefix's .bin and .idx can be read (each one that cannot is reported)."""
    paths = [prefix + ext for prefix in data_prefixes(data_path, option) for ext in (".bin", ".idx")]
    return all([require(os.path.isfile(p) and os.access(p, os.R_OK), f"{option}: cannot read {p}")
                for p in paths])  # a list, not a generator: every path is checked


def _documents(prefix, option) -> Optional[int]:
    """The documents in one indexed dataset, None (reported) when it is not one."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if os.path.getsize(prefix + ".bin") == 0:  # no tokens (all texts empty): megatron-core cannot map it
        return 0
    try:
        return IndexedDataset(prefix).document_indices.shape[0] - 1
    except (AssertionError, OSError, ValueError) as err:  # megatron-core asserts on a bad header
        require(False, f"{option}: {prefix}.idx/.bin is not an indexed dataset ({err})")
        return None


# the files transformers' AutoTokenizer builds a tokenizer from (one is enough)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def _writable(path: str) -> bool:
    """Whether a directory can be made at `path` (or is there) and written: its nearest existing
    ancestor is a writable directory. Found now, not at the first save after hours of training."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _check_splits(args):
    """megatron-core's GPTDataset loops forever on a split that received no documents (it keeps
    adding empty epochs); find that here, with megatron-core's own split arithmetic."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split,
    )
    try:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    except (AssertionError, ValueError):
        raise ArgsError(f"--split {args.split!r}: expected up to three non-negative weights like '969,30,1'") from None
    needed = {0: "train", 1: "validation", 2: "test"} if args.eval_iters > 0 else {0: "train"}
    for prefix in data_prefixes(args.data_path):
        num_docs = _documents(prefix, "--data-path")
        if num_docs is None:
            continue
        for i, name in needed.items():
            if matrix[i] is None:
                require(i > 0, f"--split {args.split!r} gives the train split no weight")
                continue
            docs = int(round(matrix[i][1] * num_docs)) - int(round(matrix[i][0] * num_docs))
            require(docs > 0, f"--split {args.split!r}: the {name} split of {prefix} gets no documents "
                              f"({num_docs} in all): give it more weight or pass --eval-iters 0")


def data_prefixes(data_path, option="--data-path"):
    """Megatron's --data-path is either 'prefix ...' or 'weight prefix weight prefix ...'."""
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path)
    guard(len(data_path) % 2 == 0, f"{option} with weights needs pairs 'weight prefix', got {data_path}")
    return list(data_path[1::2])
