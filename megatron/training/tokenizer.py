"""Tokenizers, loaded from local files only (nothing is downloaded at run time).

NullTokenizer is megatron-core's. HuggingFaceTokenizer and GPT2BPETokenizer go through transformers
directly: megatron-core 0.16.1's GPT2 path hands the vocab file over as the merges file and then
asks the hub for 'gpt2', so it cannot run offline.
"""
from __future__ import annotations


class HFTextTokenizer:
    """The part of megatron-core's tokenizer interface that datasets and tools use."""

    def __init__(self, hf_tokenizer, description: str):
        self._tok = hf_tokenizer
        eod = hf_tokenizer.eos_token_id
        if eod is None:
            raise ValueError(f"{description}: the tokenizer defines no end-of-document (eos) token")
        self._eod = eod
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer": description}

    @property
    def vocab_size(self) -> int:
        return len(self._tok)  # includes added special tokens

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        if self._tok.pad_token_id is None:
            raise AttributeError("no pad token")
        return self._tok.pad_token_id

    def tokenize(self, text: str):
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids):
        return self._tok.decode(ids)


def build_tokenizer(args):
    if args.tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers import MegatronTokenizer

        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=args.vocab_size)
    import transformers

    if args.tokenizer_type == "GPT2BPETokenizer":
        tok = transformers.GPT2TokenizerFast(vocab_file=args.vocab_file, merges_file=args.merge_file)
        return HFTextTokenizer(tok, f"GPT2BPE({args.vocab_file}, {args.merge_file})")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer_model, local_files_only=True)
        return HFTextTokenizer(tok, f"HF({args.tokenizer_model})")
    raise ValueError(f"unknown tokenizer type {args.tokenizer_type}")
