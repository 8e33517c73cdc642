"""Sample order, tokenizers, JSONL -> indexed dataset -> GPTDataset."""
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.longseq.attention.placement import DOCUMENT_STARTS, RankTokens, TokenPlacement, segmented_token_indices
from megatron.training.data import PretrainingSampler, build_datasets
from megatron.training.tokenizer import build_tokenizer
from tools import preprocess_data


def test_dp_ranks_split_each_step_and_resume_continues_the_stream():
    mbs, dp, total = 2, 3, 40
    samplers = [PretrainingSampler(total, 0, mbs, r, dp) for r in range(dp)]
    steps = list(zip(*samplers))
    for i, step in enumerate(steps):  # step i covers samples [6i, 6i+6), rank r takes slice r
        assert [idx for batch in step for idx in batch] == list(range(6 * i, 6 * i + 6))
    resumed = list(PretrainingSampler(total, 12, mbs, 1, dp))
    assert resumed == [s[1] for s in steps[2:]]
    assert len(PretrainingSampler(total, 12, mbs, 0, dp)) == len(resumed)
    with pytest.raises(ValueError, match="exceed"):
        PretrainingSampler(10, 12, mbs, 0, dp)


WORDS = "the quick brown fox jumps over a lazy dog while long sequences need ring attention".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus, a byte-level BPE (vocab.json + merges.txt) and the same as an HF directory."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(200)]
    with open(root / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "title": d[:20]}) + "\n")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(root))
    (root / "hf").mkdir()
    bpe.save(str(root / "hf" / "tokenizer.json"))
    (root / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return root, docs


def tok_args(root, kind):
    return SimpleNamespace(tokenizer_type=kind, vocab_file=str(root / "vocab.json"), merge_file=str(root / "merges.txt"),
                           tokenizer_model=str(root / "hf"), vocab_size=50)


def test_tokenizers_round_trip_and_agree(corpus):
    root, docs = corpus
    gpt2 = build_tokenizer(tok_args(root, "GPT2BPETokenizer"))
    hf = build_tokenizer(tok_args(root, "HuggingFaceTokenizer"))
    assert gpt2.vocab_size == hf.vocab_size == 300
    assert gpt2.eod == hf.eod == 0  # the first special token
    for doc in docs[:20]:
        ids = gpt2.tokenize(doc)
        assert ids == hf.tokenize(doc)
        assert gpt2.detokenize(ids) == doc
    null = build_tokenizer(tok_args(root, "NullTokenizer"))
    assert (null.vocab_size, null.eod) == (51, 50)  # Megatron: EOD is the id after the vocabulary


def test_hf_documents_start_with_the_tokenizers_own_special_tokens(corpus, tmp_path):
    """As Megatron-LM's HuggingFaceTokenizer (and HF generation): a tokenizer that puts <s> in front
    of a text puts it in front of each preprocessed document."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    root, docs = corpus
    tok = Tokenizer.from_file(str(root / "hf" / "tokenizer.json"))
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    (tmp_path / "hf").mkdir()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<s>"}))
    with open(tmp_path / "in.jsonl", "w") as f:
        f.write(json.dumps({"text": docs[0]}) + "\n")
    preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "c"),
                          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "hf"),
                          "--append-eod"])
    dataset = IndexedDataset(str(tmp_path / "c_text_document"))  # held: its __del__ unmaps what [0] views
    written = dataset[0].tolist()
    plain = build_tokenizer(tok_args(root, "GPT2BPETokenizer")).tokenize(docs[0])
    assert written == [bos] + plain + [0]


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_what_gpt_dataset_reads(corpus, tmp_path, workers):
    root, docs = corpus
    prefix = tmp_path / "out" / "c"
    preprocess_data.main(["--input", str(root / "corpus.jsonl"), "--output-prefix", str(prefix),
                          "--json-keys", "text", "title", "--tokenizer-type", "GPT2BPETokenizer",
                          "--vocab-file", str(root / "vocab.json"), "--merge-file", str(root / "merges.txt"),
                          "--append-eod", "--workers", str(workers)])
    tok = build_tokenizer(tok_args(root, "GPT2BPETokenizer"))
    for key, source in (("text", docs), ("title", [d[:20] for d in docs])):
        ds = IndexedDataset(f"{prefix}_{key}_document")
        assert len(ds) == len(source)
        for i in (0, 7, len(source) - 1):
            ids = ds[i].tolist()
            assert ids[-1] == tok.eod and tok.detokenize(ids[:-1]) == source[i]
    args = SimpleNamespace(seed=1, seq_length=16, data_path=[f"{prefix}_text_document"], split="90,5,5",
                           data_cache_path=str(tmp_path / "cache"), reset_position_ids=True,
                           reset_attention_mask=True, eod_mask_loss=True, mock_data=False,
                           mmap_bin_files=workers == 1)  # --no-mmap-bin-files (plain reads) passes the same checks
    train, valid, test = build_datasets(args, tok, [10, 4, 4])
    assert train.config.mmap_bin_files == args.mmap_bin_files
    sample = train[0]
    assert sample["tokens"].shape == (16,) and "attention_mask" not in sample  # never a dense [S, S] mask
    tokens, mask = sample["tokens"].numpy(), sample["loss_mask"].numpy()
    assert (tokens == tok.eod).any() and np.all(mask[tokens == tok.eod] == 0)  # --eod-mask-loss: no prediction from EOD
    # the documents travel as their starts: a new one after every EOD; positions restart there
    ranked = RankTokens(train, TokenPlacement([16], 1, 2, 0, 1), tok.eod)[0]
    starts = ranked[DOCUMENT_STARTS]
    assert starts[0] and torch.equal(starts[1:], sample["tokens"][:-1] == tok.eod)
    assert torch.equal(sample["position_ids"][starts], torch.zeros(int(starts.sum()), dtype=torch.long))
    want = segmented_token_indices([16], 1, 2, 0, 1, starts)
    assert torch.equal(ranked["tokens"], sample["tokens"][want]) and len(want) == 8
    # --eval-iters 0: the splits no evaluation reads are not built, not even the test split that
    # Megatron's default weights leave without a document here (megatron-core would never finish it)
    args.split = "969,30,1"
    train, valid, test = build_datasets(args, tok, [10, 0, 0])
    assert valid is None and test is None and len(train) >= 10


@pytest.mark.parametrize("kind, missing", [("GPT2BPETokenizer", "--vocab-file and --merge-file"),
                                           ("HuggingFaceTokenizer", "--tokenizer-model"),
                                           ("NullTokenizer", "--vocab-size")])
def test_preprocess_names_the_tokenizer_files_it_lacks(tmp_path, capsys, kind, missing):
    (tmp_path / "in.jsonl").write_text('{"text": "1 2"}')
    with pytest.raises(SystemExit):
        preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
                              "--tokenizer-type", kind])
    assert capsys.readouterr().err.strip().endswith(f"--tokenizer-type {kind} needs {missing}")


def test_null_tokenizer_corpus_of_ids(tmp_path):
    (tmp_path / "ids.jsonl").write_text("\n".join(json.dumps({"text": " ".join(map(str, range(i, i + 5)))})
                                                  for i in range(3)))
    preprocess_data.main(["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "ids"),
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"])
    ds = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert ds[1].tolist() == [1, 2, 3, 4, 5, 100]


@pytest.mark.parametrize("eod", [True, False])
def test_an_empty_text_is_an_empty_document_of_every_key(tmp_path, eod):
    """No lone EOD (a spurious EOD EOD pair in the packed stream), and with several keys every
    line is one document of each, so their datasets stay aligned by index."""
    lines = [{"text": "1 2 3", "title": "7"}, {"text": "", "title": "8"}, {"text": "4 5", "title": "9"}]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    preprocess_data.main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "d"),
                          "--json-keys", "text", "title", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
                         + (["--append-eod"] if eod else []))
    text, title = (IndexedDataset(str(tmp_path / f"d_{key}_document")) for key in ("text", "title"))
    end = [100] if eod else []
    assert [text[i].tolist() for i in range(len(text))] == [[1, 2, 3] + end, [4, 5] + end]
    assert text.document_indices.tolist() == [0, 1, 1, 2] and len(title.document_indices) == 4


def test_passkey_samples_hide_the_key_early_and_ask_for_it_last():
    from megatron.training.passkey import FILLER_START, KEY_IDS, KEY_START, QUERY, PasskeyDataset

    ds = PasskeyDataset(num_samples=50, seq_length=128, vocab_size=100, key_length=2, seed=3)
    keys = set()
    for i in range(50):
        s = ds[i]
        seq = torch.cat([s["tokens"], s["labels"][-1:]])
        at = int((seq == KEY_START).nonzero()[0])
        assert at < 128 // 4 and seq[-3] == QUERY
        key = seq[at + 1 : at + 3]
        assert all(int(t) in KEY_IDS for t in key) and seq[-2:].tolist() == key.tolist()
        filler = [t for j, t in enumerate(seq.tolist()) if j not in (at, at + 1, at + 2, 126, 127, 128)]
        assert min(filler) >= FILLER_START  # key ids never appear as filler
        assert s["loss_mask"].tolist() == [0.0] * 126 + [1.0, 1.0]  # only the answer counts
        assert s["labels"][-2:].tolist() == key.tolist()
        keys.add(tuple(key.tolist()))
    assert len(keys) > 30  # keys vary
    assert torch.equal(ds[7]["tokens"], PasskeyDataset(50, 128, 100, 2, seed=3)[7]["tokens"])  # pure function



def test_a_passkey_has_at_least_one_token():
    from megatron.training.passkey import PasskeyDataset

    for n in (0, -1):
        with pytest.raises(ValueError, match=f"a passkey needs at least one token, got a key length of {n}"):
            PasskeyDataset(4, 64, 100, key_length=n)


def test_passkey_depth_one_puts_the_key_anywhere_before_the_query():
    from megatron.training.passkey import KEY_START, PasskeyDataset

    seq, n = 64, 3
    ds = PasskeyDataset(num_samples=400, seq_length=seq, vocab_size=100, key_length=n, seed=1, depth=1.0)
    at = [int((ds[i]["tokens"] == KEY_START).nonzero()[0]) for i in range(400)]
    assert min(at) == 0 and max(at) == seq - 2 * n - 1  # the last key token ends right before QUERY
    quarter = PasskeyDataset(num_samples=5, seq_length=seq, vocab_size=100, key_length=n, seed=1)
    assert quarter.key_positions() == seq // 4  # the default draws what it always drew
    with pytest.raises(ValueError, match=r"passkey depth must be in \(0, 1\], got 0"):
        PasskeyDataset(5, seq, 100, n, depth=0)


class _Packed(torch.utils.data.Dataset):
    """Samples of 512 tokens packed with documents of random lengths (EOD = 0 closes each)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(1, 100, (512,), generator=g)
        tokens[torch.rand(512, generator=g) < 1 / 80] = 0
        return {"tokens": tokens, "labels": tokens.roll(-1), "loss_mask": torch.ones(512),
                "position_ids": torch.arange(512)}


@pytest.mark.parametrize("workers", [0, 1])
def test_packed_micro_batches_choose_their_own_segments(workers):
    """uniform_comp with packed documents: the loader partitions each micro-batch by its documents
    (in its workers too) and places every sample by those segments, as the attention expects."""
    from megatron.longseq.attention.placement import SEGMENT_LENGTHS
    from megatron.training.data import build_loader, segment_partitioner
    from tests.unit_tests.model_utils import tiny_args

    args = tiny_args("--seq-length 512 --max-position-embeddings 512 --reset-attention-mask --pipe-sp-splits 2 "
                     f"--pipe-sp-strategy uniform_comp --context-parallel-size 2 --num-workers {workers}", world_size=2)
    cap = max(args.segment_lengths)  # the static partition's longest, made for one document
    assert cap > 256
    partitioner = segment_partitioner(args)
    seen = set()
    for ring_index in range(2):
        pgs = SimpleNamespace(size=lambda axis: {"cp": 2, "ring": 2, "hp": 1, "dp": 1}[axis],
                              index=lambda axis: {"ring": ring_index}.get(axis, 0))
        loader = build_loader(_Packed(), 0, args, pgs, eod=0)
        for m, batch in enumerate(loader):
            lengths = batch[SEGMENT_LENGTHS].tolist()
            starts = batch[DOCUMENT_STARTS]
            assert lengths == partitioner(starts) and max(lengths) <= cap
            seen.add(tuple(lengths))
            for b in range(2):
                sample = _Packed()[2 * m + b]
                want = segmented_token_indices(lengths, 1, 2, 0, ring_index, starts[b])
                assert torch.equal(batch["tokens"][b], sample["tokens"][want])
                assert torch.equal(batch["position_ids"][b], want)
    assert len(seen) > 1  # the documents did move the segments


def test_without_context_parallelism_packed_segments_may_have_any_length():
    """cp 1: segment boundaries fall on any token (granularity 1), odd lengths included; the
    samples pass unchanged. The placement asked for an even length and crashed the first batch."""
    from megatron.longseq.attention.placement import SEGMENT_LENGTHS
    from megatron.training.data import build_loader
    from tests.unit_tests.model_utils import tiny_args

    args = tiny_args("--seq-length 512 --max-position-embeddings 512 --reset-attention-mask --pipe-sp-splits 2 "
                     "--pipe-sp-strategy uniform_comp")
    pgs = SimpleNamespace(size=lambda axis: 1, index=lambda axis: 0)
    lengths = []
    for m, batch in enumerate(build_loader(_Packed(), 0, args, pgs, eod=0)):
        lengths += batch[SEGMENT_LENGTHS].tolist()
        for b in range(2):
            assert torch.equal(batch["tokens"][b], _Packed()[2 * m + b]["tokens"])
    assert any(n % 2 for n in lengths), lengths  # what crashed

@pytest.mark.parametrize("packed", [False, True])
def test_a_weighted_blend_of_corpora_reaches_the_batch(corpus, tmp_path, packed):
    """--data-path 0.3 A 0.7 B: megatron-core's blend adds the sample's source (`dataset_id`, a
    scalar) to each sample; the batch holds the per-token tensors only, whole or placed by documents."""
    from megatron.training.data import build_loader
    from tests.unit_tests.dist_utils import init_single_rank_world
    from tests.unit_tests.model_utils import tiny_args

    init_single_rank_world()  # megatron-core's blend builder asks for the rank
    root, _ = corpus
    prefixes = []
    for name in ("a", "b"):
        preprocess_data.main(["--input", str(root / "corpus.jsonl"), "--output-prefix", str(tmp_path / name),
                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "vocab.json"),
                              "--merge-file", str(root / "merges.txt"), "--append-eod"])
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    tok = build_tokenizer(tok_args(root, "GPT2BPETokenizer"))
    args = tiny_args("--seq-length 16" + (" --reset-attention-mask --reset-position-ids" if packed else ""))
    args.data_path, args.split, args.data_cache_path = ["0.3", prefixes[0], "0.7", prefixes[1]], "100,0,0", None
    args.mock_data = False
    train, _, _ = build_datasets(args, tok, [8, 0, 0])
    assert "dataset_id" in train[0]  # what the blend adds
    pgs = SimpleNamespace(size=lambda axis: 1, index=lambda axis: 0)
    batch = next(build_loader(train, 0, args, pgs, tok.eod))
    per_token = {"tokens", "labels", "loss_mask", "position_ids"}
    assert set(batch) == per_token | ({DOCUMENT_STARTS} if packed else set())
    assert all(batch[k].shape == (args.micro_batch_size, 16) for k in per_token)


def test_each_split_reads_its_own_corpus(tmp_path):
    """--train-data-path A --valid-data-path B: training samples come from A only, validation
    samples from B only (megatron-core's blend_per_split), and a split given no corpus, or one no
    evaluation reads, is not built."""
    from megatron.core.tokenizers import MegatronTokenizer
    from tests.unit_tests.dist_utils import init_single_rank_world
    from tests.unit_tests.model_utils import tiny_args

    init_single_rank_world()  # megatron-core's builder asks for the rank
    rng = random.Random(0)
    prefixes = {}
    for name, (lo, hi) in {"a": (1, 50), "b": (50, 99)}.items():  # disjoint token ids: the source shows
        lines = [json.dumps({"text": " ".join(str(rng.randrange(lo, hi)) for _ in range(rng.randint(3, 30)))})
                 for _ in range(40)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines))
        preprocess_data.main(["--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name),
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"])
        prefixes[name] = str(tmp_path / f"{name}_text_document")
    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=100)
    args = tiny_args("--seq-length 16")
    args.mock_data, args.split, args.data_cache_path = False, None, None
    args.train_data_path, args.valid_data_path = [prefixes["a"]], [prefixes["b"]]

    def ids(dataset):
        tokens = torch.cat([torch.as_tensor(dataset[i]["tokens"]) for i in range(len(dataset))])
        return set(tokens.tolist()) - {100}  # less the EOD

    train, valid, test = build_datasets(args, tok, [8, 4, 4])
    assert len(train) >= 8 and len(valid) >= 4 and test is None  # whole epochs: at least what was asked
    assert max(ids(train)) < 50 <= min(ids(valid))
    assert build_datasets(args, tok, [8, 0, 0])[1] is None  # --eval-iters 0: B is not read
    # A's training samples are those of --data-path A --split 100,0,0, in the same order
    args.train_data_path, args.valid_data_path, args.data_path, args.split = None, None, [prefixes["a"]], "100,0,0"
    whole = build_datasets(args, tok, [8, 0, 0])[0]
    assert all(torch.equal(torch.as_tensor(whole[i]["tokens"]), torch.as_tensor(train[i]["tokens"])) for i in range(8))
