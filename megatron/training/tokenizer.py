"""Tokenizers, loaded from local files only (nothing is downloaded at run time).

- NullTokenizer: megatron-core's (ids are the text; vocab_size + 1 with the EOD id last).
- GPT2BPETokenizer: GPT-2's byte-level BPE from vocab.json + merges.txt, run by the `tokenizers`
  library. (megatron-core 0.16.1's GPT2 path passes the vocab file as the merges file and asks the
  hub for 'gpt2', so it cannot run offline.)
- HuggingFaceTokenizer: a local tokenizer directory through transformers' AutoTokenizer; a text
  gets the special tokens the tokenizer adds itself (a beginning-of-sequence token, say).
"""
from __future__ import annotations

GPT2_EOD = "<|endoftext|>"


class TextTokenizer:
    """The part of megatron-core's tokenizer interface that datasets and tools use."""

    def __init__(self, vocab_size: int, eod: int, description: str, pad=None):
        if eod is None:
            raise ValueError(f"{description}: the tokenizer defines no end-of-document token")
        self._vocab_size, self._eod, self._pad = vocab_size, eod, pad
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer": description}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        if self._pad is None:
            raise AttributeError("no pad token")  # GPTDataset then uses its own pad id
        return self._pad


class GPT2BPETokenizer(TextTokenizer):
    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        self._tok = ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        super().__init__(self._tok.get_vocab_size(with_added_tokens=True), self._tok.token_to_id(GPT2_EOD),
                         f"GPT2BPE({vocab_file}, {merge_file})")

    def tokenize(self, text: str):
        return self._tok.encode(text).ids

    def detokenize(self, ids):
        return self._tok.decode(list(ids))


class HuggingFaceTokenizer(TextTokenizer):
    def __init__(self, path: str):
        import transformers

        self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        super().__init__(len(self._tok), self._tok.eos_token_id, f"HF({path})", pad=self._tok.pad_token_id)

    def tokenize(self, text: str):
        # with the tokenizer's own special tokens, as Megatron-LM's HuggingFaceTokenizer: Llama's
        # beginning-of-sequence token starts each document, as HF generation feeds the model
        return self._tok(text).input_ids

    def detokenize(self, ids):
        return self._tok.decode(list(ids))


_BUILT = {}  # one load per process: validation loads it first (see validate._vocab_args)


def build_tokenizer(args):
    """The tokenizer the flags name, loaded once per process for the same files."""
    key = tuple(getattr(args, name, None) for name in
                ("tokenizer_type", "vocab_size", "vocab_file", "merge_file", "tokenizer_model"))
    if key not in _BUILT:
        _BUILT[key] = _load(args)
    return _BUILT[key]


def _load(args):
    if args.tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers import MegatronTokenizer

        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=args.vocab_size)
    if args.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    raise ValueError(f"unknown tokenizer type {args.tokenizer_type}")
