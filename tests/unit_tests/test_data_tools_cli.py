"""tools/preprocess_data.py and tools/passkey_eval.py on bad input: one line and exit status 2
before any work, never a traceback or a silent NaN; --help with the whole description and every
default; passkey_eval scoring a multi-token key as the trainer does."""
import json
import os
import sys

import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tools import passkey_eval, preprocess_data

PROG = os.path.basename(sys.argv[0])  # argparse's prog in this process; cli.run's is "tool" when given argv


def refused(capsys, call, argv) -> str:
    """The one line a parse-time refusal prints (after argparse's usage), its exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        call(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Traceback" not in err
    return err.strip().splitlines()[-1]


def failed(capsys, main, argv) -> str:
    """The one line cli.run prints for a refusal found after parsing, its exit status 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    return err.strip()


@pytest.mark.parametrize("tool, last_words, default", [
    (preprocess_data, "and nothing is left under the output names.", "(default: 10000)"),
    (passkey_eval, "(chance: ln 10 = 2.30 per token).", "training's --passkey-length (default: 1)"),
])
def test_help_shows_the_whole_description_and_the_defaults(capsys, tool, last_words, default):
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert last_words in " ".join(out.split()) and default in out


# ---- tools/preprocess_data.py -------------------------------------------------------------------
def preprocess(tmp_path, lines, *extra, workers=1):
    """preprocess_data.main's status on a corpus of `lines` (NullTokenizer, --vocab-size 100)."""
    (tmp_path / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    return preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out" / "c"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                 "--workers", str(workers), *extra])


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("bad_line, message", [
    ('{"text": ', "3: not JSON (Expecting value at column 10)"),
    ('{"title": "1 2"}', "3: no key 'text' (--json-keys)"),
    ('{"text": "1 two"}', "3: 'text': NullTokenizer text must be whitespace-separated integer ids"),
    ('{"text": "7 500"}', "3: 'text': id 500 is outside --vocab-size 100 (ids 0..99)"),
    ('{"text": "7 100"}', "3: 'text': id 100 is outside --vocab-size 100 (ids 0..99)"),  # 100 is EOD
    ('{"text": "-1"}', "3: 'text': id -1 is outside --vocab-size 100 (ids 0..99)"),
    ('{"text": 5}', "3: 'text' is int, not a string or a list of strings"),
    ('{"text": ["1", 5]}', "3: 'text'[1] is int, not a string"),
    ('{"text": "\\ud800 1"}', "3: 'text': cannot be encoded as UTF-8 (surrogates not allowed at character 0)"),
    ('{"text": ["1", "2 \\udc00"]}',
     "3: 'text'[1]: cannot be encoded as UTF-8 (surrogates not allowed at character 2)"),
    ('[1, 2]', "3: not a JSON object"),
])
def test_a_bad_line_is_named_and_leaves_no_output(tmp_path, capsys, workers, bad_line, message):
    """Also from a worker process; the third line of 40, so the first documents were written already."""
    lines = ['{"text": "1 2 3"}', '{"text": "4"}', bad_line] + ['{"text": "5 6"}'] * 37
    assert failed(capsys, lambda argv: preprocess(tmp_path, lines, workers=workers), None) \
        == f"tool: error: {tmp_path / 'in.jsonl'}:{message}"
    assert os.listdir(tmp_path / "out") == []  # neither final names nor partial files


def test_a_refused_run_keeps_the_dataset_written_before(tmp_path, capsys):
    assert preprocess(tmp_path, ['{"text": "1 2"}']) == 0
    before = (tmp_path / "out" / "c_text_document.bin").read_bytes()
    assert preprocess(tmp_path, ['{"text": "3 4 5"}', '{"text": "x"}']) == 2
    assert sorted(os.listdir(tmp_path / "out")) == ["c_text_document.bin", "c_text_document.idx"]
    assert (tmp_path / "out" / "c_text_document.bin").read_bytes() == before
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_document"))  # held: its items are views of its mmap
    assert ds[0].tolist() == [1, 2]


def test_not_utf8_is_named_by_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "1"}\n{"text": "\xff"}\n')
    line = failed(capsys, preprocess_data.main, ["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                                 str(tmp_path / "c"), "--tokenizer-type", "NullTokenizer",
                                                 "--vocab-size", "100"])
    assert line == f"tool: error: {tmp_path / 'in.jsonl'}:2: not UTF-8 (invalid start byte at byte 10)"


def test_blank_lines_are_skipped_and_the_largest_id_is_kept(tmp_path, capsys):
    assert preprocess(tmp_path, ["", '{"text": "1 99"}', "  ", '{"text": "4"}', ""], "--append-eod") == 0
    assert "(2 documents, vocab 101, uint16)" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 99, 100], [4, 100]]


def test_a_list_of_strings_is_one_document_of_its_elements(tmp_path, capsys):
    """Megatron's list of sentences: in order, concatenated, EOD once at the end; aligned with the
    other keys' documents, an empty list an empty document."""
    lines = ['{"text": ["1 2", "", "3"], "t": "9"}', '{"text": [], "t": "8"}', '{"text": ["4"], "t": "7"}']
    assert preprocess(tmp_path, lines, "--append-eod", "--json-keys", "text", "t") == 0
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 100], [4, 100]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]  # the empty list holds no sequence, as an empty text
    assert ds.sequence_lengths.tolist() == [4, 2]  # one sequence: GPTDataset keeps the document together
    assert IndexedDataset(str(tmp_path / "out" / "c_t_document")).document_indices.tolist() == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE's vocab.json and merges.txt (trained here, on two sentences)."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("bpe")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["a sentence.", "another one."], vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save_model(str(root))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "vocab.json"),
            "--merge-file", str(root / "merges.txt")]


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_text_with_a_lone_surrogate_is_named_by_line(tmp_path, capsys, bpe, workers):
    """JSON can spell half a UTF-16 pair; the tokenizers library would raise a TypeError on it."""
    (tmp_path / "in.jsonl").write_text('{"text": ["a sentence.", "another one."]}\n{"text": "\\ud800 lone"}\n')
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out" / "c"), *bpe,
            "--workers", str(workers), "--append-eod"]
    assert failed(capsys, preprocess_data.main, argv) == f"tool: error: {tmp_path / 'in.jsonl'}:2: 'text': cannot " \
                                                        "be encoded as UTF-8 (surrogates not allowed at character 0)"
    assert os.listdir(tmp_path / "out") == []
    (tmp_path / "in.jsonl").write_text('{"text": ["a sentence.", "another one."]}\n')
    assert preprocess_data.main(argv) == 0
    from megatron.training.tokenizer import build_tokenizer

    tok = build_tokenizer(preprocess_data.parse_args(argv))
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_document"))
    assert ds[0].tolist() == tok.tokenize("a sentence.") + tok.tokenize("another one.") + [tok.eod]


def test_an_output_prefix_ending_in_a_separator_names_the_directory(tmp_path, capsys):
    argv = _null_argv(tmp_path, "--output-prefix", str(tmp_path / "new") + os.sep)
    assert preprocess_data.main(argv) == 0
    assert sorted(os.listdir(tmp_path / "new")) == ["_text_document.bin", "_text_document.idx"]
    argv = _null_argv(tmp_path, "--output-prefix", str(tmp_path / "in.jsonl") + os.sep)
    assert refused(capsys, preprocess_data.main, argv) \
        == f"{PROG}: error: argument --output-prefix: {tmp_path / 'in.jsonl'} is not a directory to write " \
           f"{tmp_path / 'in.jsonl'}{os.sep} in"


def _null_argv(tmp_path, *extra):
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n')
    return ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "c"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *extra]


@pytest.mark.parametrize("extra, message", [
    (["--vocab-size", "-5"], "argument --vocab-size: must be positive, got -5"),
    (["--log-interval", "0"], "argument --log-interval: must be positive, got 0"),
    (["--workers", "0"], "argument --workers: must be positive, got 0"),
    (["--output-prefix", "/proc/x/b"], "--output-prefix: cannot make the directory /proc/x: No such file or directory"),
    (["--json-keys", "text", "a/b"],
     "argument --json-keys: 'a/b' holds a path separator; a key names the file PREFIX_KEY_document.bin"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, extra, message):
    assert refused(capsys, preprocess_data.main, _null_argv(tmp_path, *extra)) == f"{PROG}: error: {message}"


def test_an_output_prefix_under_a_file_is_refused(tmp_path, capsys):
    argv = _null_argv(tmp_path, "--output-prefix", str(tmp_path / "in.jsonl" / "b"))
    assert refused(capsys, preprocess_data.main, argv) \
        == f"{PROG}: error: argument --output-prefix: {tmp_path / 'in.jsonl'} is not a directory to write " \
           f"{tmp_path / 'in.jsonl' / 'b'} in"
    argv = _null_argv(tmp_path, "--output-prefix", str(tmp_path / "new" / "dirs" / "c"))
    assert preprocess_data.main(argv) == 0  # missing directories are made, as the README's data/corpus
    assert (tmp_path / "new" / "dirs" / "c_text_document.idx").is_file()


def test_missing_or_broken_tokenizer_files_are_one_line(tmp_path, capsys):
    base = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "c")]
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    gpt2 = base + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "v.json"),
                   "--merge-file", str(tmp_path / "m.txt")]
    assert refused(capsys, preprocess_data.main, gpt2) == f"{PROG}: error: --vocab-file: no file {tmp_path / 'v.json'}"
    (tmp_path / "v.json").write_text("xx")
    (tmp_path / "m.txt").write_text("xx")
    assert failed(capsys, preprocess_data.main, gpt2) == \
        "tool: error: cannot load the GPT2BPETokenizer: Error while initializing BPE: expected value at line 1 column 1"
    hf = base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    assert failed(capsys, preprocess_data.main, hf + [str(tmp_path / "none")]) \
        == f"tool: error: --tokenizer-model: no directory {tmp_path / 'none'}"
    (tmp_path / "empty").mkdir()
    assert failed(capsys, preprocess_data.main, hf + [str(tmp_path / "empty")]) \
        .startswith("tool: error: cannot load the HuggingFaceTokenizer: ")
    assert sorted(os.listdir(tmp_path)) == ["empty", "in.jsonl", "m.txt", "v.json"]  # nothing written


# ---- tools/passkey_eval.py ----------------------------------------------------------------------
VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama export with a 64-id vocabulary (no download)."""
    from tests.unit_tests.training.test_convert import save_hf

    return save_hf(tmp_path_factory.mktemp("hf") / "llama", "llama", "default", vocab=VOCAB)


def eval_argv(model_dir, *extra, model=None):
    return ["--vocab-size", str(VOCAB), "--lengths", "32", "--samples", "3", "--batch", "2",
            *(model or ["--model", "m", model_dir]), *extra]


@pytest.mark.parametrize("extra, message", [
    (["--samples", "0"], "argument --samples: must be positive, got 0"),
    (["--batch", "0"], "argument --batch: must be positive, got 0"),
    (["--seed", "-1"], "argument --seed: must be non-negative, got -1"),
    (["--passkey-length", "0"], "argument --passkey-length: must be positive, got 0"),
    (["--lengths", "16"], "a sequence length of 16 is too short for a key of 1 tokens (at least 24 needed)"),
    (["--lengths", "32", "--passkey-length", "3"],
     "a sequence length of 32 is too short for a key of 3 tokens (at least 40 needed)"),
    (["--depth", "0"], "passkey depth must be in (0, 1], got 0.0"),
    (["--depth", "nan"], "passkey depth must be in (0, 1], got nan"),
    (["--vocab-size", "30"], "passkey data needs a vocabulary size > 30, got 30"),
    (["--vocab-size", str(VOCAB + 1)],
     f"--model 'm': --vocab-size {VOCAB + 1} is larger than the model's vocabulary ({VOCAB}): "
     "the filler ids would be outside it"),
])
def test_passkey_eval_bad_numbers_are_one_line(model_dir, capsys, extra, message):
    assert refused(capsys, passkey_eval.main, eval_argv(model_dir, *extra)) == f"{PROG}: error: {message}"


@pytest.mark.parametrize("change", ["linear:1.2.3", "linear:0", "linear:-2", "base:inf", "linear:nan", "linear:",
                                    "base:1e999", "scale:2"])
def test_passkey_eval_refuses_a_rope_change_that_is_not_a_positive_number(model_dir, capsys, change):
    line = refused(capsys, passkey_eval.main, eval_argv(model_dir, model=["--model", "m", model_dir, change]))
    assert line == f"{PROG}: error: --model 'm': the RoPE change is base:THETA or linear:FACTOR, got {change!r}; " \
                   "THETA and FACTOR are positive numbers"


def test_passkey_eval_wants_an_hf_export(model_dir, tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")  # a Megatron checkpoint
    for directory in (tmp_path / "ckpt", tmp_path):
        line = refused(capsys, passkey_eval.main, eval_argv(model_dir, model=["--model", "m", str(directory)]))
        assert line == f"{PROG}: error: --model 'm': no config.json in {directory}; give a directory written by " \
                       "tools/checkpoint/convert.py --saver hf"
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text(open(os.path.join(model_dir, "config.json")).read())
    line = failed(capsys, passkey_eval.main, eval_argv(model_dir, model=["--model", "w", str(tmp_path / "weightless")]))
    assert line.startswith(f"tool: error: --model 'w': cannot load {tmp_path / 'weightless'}: ")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    line = refused(capsys, passkey_eval.main, eval_argv(model_dir, model=["--model", "o", str(tmp_path / "odd")]))
    assert line.startswith(f"{PROG}: error: --model 'o': cannot read {tmp_path / 'odd' / 'config.json'}: ")
    import transformers

    transformers.T5Config(vocab_size=VOCAB).save_pretrained(tmp_path / "t5")  # an encoder-decoder: refused up front
    line = refused(capsys, passkey_eval.main, eval_argv(model_dir, model=["--model", "m", model_dir,
                                                                          "--model", "t", str(tmp_path / "t5")]))
    assert line == f"{PROG}: error: --model 't': {tmp_path / 't5'} holds a t5 model, not a causal language model"


def test_passkey_accuracy_is_never_rounded_up_to_a_perfect_score():
    assert [passkey_eval.percent(a) for a in (255 / 256, 1.0, 0.29, 1 / 256, 0.0)] == ["99%", "100%", "29%", "0%", "0%"]
    assert passkey_eval.table([("m", [(255 / 256, 0.1)])], [64]).splitlines()[-1] == "| m | 99% (0.10) |"


class _Oracle(torch.nn.Module):
    """Predicts every next token of `data`'s samples right (logit 10 on it), except the key tokens
    listed in `wrong` ({sample: key position}), where it predicts key id 19 or 18 instead. Asked,
    as transformers' causal LMs are, for the last `logits_to_keep` positions only: the eval must not
    build [b, s, vocab] logits."""

    def __init__(self, data, wrong):
        super().__init__()
        self.next = {tuple(data[i]["tokens"].tolist()): (i, data[i]["labels"]) for i in range(len(data))}
        self.wrong, self.n = wrong, data.key_length

    def forward(self, input_ids, logits_to_keep):
        assert logits_to_keep == self.n
        rows = []
        for tokens in input_ids:
            i, labels = self.next[tuple(tokens.tolist())]
            guess = labels.clone()
            if i in self.wrong:
                at = len(labels) - self.n + self.wrong[i]
                guess[at] = 19 if guess[at] != 19 else 18
            rows.append(10.0 * torch.nn.functional.one_hot(guess[-logits_to_keep:], VOCAB).float())
        return type("Out", (), {"logits": torch.stack(rows)})


def test_a_multi_token_key_is_retrieved_only_when_every_token_is(capsys):
    """Teacher forcing: each key token is judged given the true ones before it, so one wrong token,
    first or last, loses the sample."""
    from megatron.training.passkey import PasskeyDataset

    data = PasskeyDataset(5, 48, VOCAB, key_length=3, seed=7, depth=1.0)
    acc, loss = passkey_eval.score(_Oracle(data, {1: 0, 3: 2}), data, batch=2)
    assert acc == 3 / 5
    right = float(torch.log1p((VOCAB - 1) * torch.exp(torch.tensor(-10.0))))  # CE of a right guess at logit 10
    wrong = right + 10.0
    assert loss == pytest.approx((3 * right + 2 * (2 * right + wrong) / 3) / 5, rel=1e-5)  # per-sample means


def test_a_multi_token_answer_loss_is_the_trainers(model_dir, capsys):
    """The trainer's validation loss on the same samples: the masked mean of transformers' per-token
    losses (the helper test_convert checks against pretrain_gpt.py's logged loss, key of 4)."""
    from megatron.training.passkey import PasskeyDataset
    from tests.unit_tests.training.test_convert import _hf_passkey_loss

    seq, n, samples, seed = 48, 3, 5, 11
    data = PasskeyDataset(samples, seq, VOCAB, key_length=n, seed=seed, depth=1.0)
    _, loss = passkey_eval.score(passkey_eval.load(model_dir), data, batch=2)
    assert loss == pytest.approx(_hf_passkey_loss(model_dir, seq, n, samples, VOCAB, seed, depth=1.0), rel=1e-5)
    assert passkey_eval.main(eval_argv(model_dir, "--passkey-length", "2", "--lengths", "32", "48")) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == "|---|---:|---:|" and lines[-1].startswith("| m | ") and "nan" not in lines[-1]
