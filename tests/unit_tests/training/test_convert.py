"""Hugging Face Llama / Mistral / Qwen2 <-> this trainer (tools/checkpoint/convert.py), and RoPE
scaling, against transformers itself: tiny random models built locally, no download.

Tolerance: logits rel <= 1e-5 in fp32. Both sides compute the same sums in a different order
(fused qkv, SDPA vs eager attention), a few ulps per op over two layers: measured ~2e-7.
"""
from __future__ import annotations

import io
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from megatron.longseq.attention.rope import RopeScaling, attention_factor, inverse_frequencies
from megatron.training.convert.checkpoint import read_checkpoint
from megatron.training.convert.convert import main as convert
from megatron.training.convert.hf import model_from_hf, pretrain_flags
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ = 256, 32
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    # original contexts shorter than SEQ, so the stretched bands are the ones the test's tokens use
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def hf_model(family: str, rope: str, vocab: int = VOCAB, seed: int = 0, **overrides):
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=None,
                  tie_word_embeddings=family == "qwen2", rope_parameters=dict(ROPES[rope]),
                  architectures=[model_cls.__name__])
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():  # transformers zeroes biases and ones norms: make every weight count
            p.normal_(0.0, 0.1)
    return model


def save_hf(directory: Path, family: str, rope: str, **kw) -> str:
    hf_model(family, rope, **kw).save_pretrained(directory)
    return str(directory)


def run_convert(*argv) -> tuple:
    """(exit code, stdout, stderr) of the converter, run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = convert([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def to_ours(hf_dir, save_dir, tp=1, pp=1, *extra):
    rc, _, err = run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf_dir, "--save-dir", save_dir,
                             "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp, *extra)
    assert rc == 0, err
    return save_dir


# ---- RoPE frequencies -------------------------------------------------------------------------------
@pytest.mark.parametrize("params, ours", [
    (ROPES["linear"], RopeScaling(interpolation=2.0)),
    ({**ROPES["llama3"], "rope_theta": 500000.0, "original_max_position_embeddings": 8192}, RopeScaling("llama3", 8.0)),
    (ROPES["llama3"], RopeScaling("llama3", 8.0, original_context=16)),
    (ROPES["yarn"], RopeScaling("yarn", 4.0, original_context=16)),
    ({**ROPES["yarn"], "rope_theta": 1e6, "original_max_position_embeddings": 32768, "beta_fast": 16, "beta_slow": 2,
      "mscale": 0.8, "mscale_all_dim": 0.5},
     RopeScaling("yarn", 4.0, original_context=32768, beta_fast=16, beta_slow=2, mscale=0.8, mscale_all_dim=0.5)),
], ids=["linear", "llama3-8k", "llama3-16", "yarn", "yarn-mscale"])
def test_frequencies_match_transformers(params, ours):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64 * 1024,
                                      rope_parameters=dict(params))
    inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    mine = inverse_frequencies(params["rope_theta"], 16, ours)
    # transformers computes base^(2j/d) in fp32, we in fp64: one fp32 rounding apart
    torch.testing.assert_close(inv.double(), mine, rtol=1e-6, atol=0)
    assert factor == pytest.approx(attention_factor(ours), rel=1e-12)


# ---- logits against transformers -----------------------------------------------------------------
def our_model(m, tp=1, pp=1, cp=1, world=1):
    """Our GPT built from the flags the converter prints for Model `m`."""
    from megatron.longseq.random import seed_everything
    from megatron.training.model import build_gpt_model
    from megatron.training.validate import padded_vocab_size
    from tests.unit_tests.model_utils import tiny_args

    layout = f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} --context-parallel-size {cp}"
    args = tiny_args(" ".join(pretrain_flags(m, 128)) + f" --seq-length {SEQ} " + layout, world_size=world)
    args.padded_vocab_size = padded_vocab_size(m.vocab, 128, tp)
    pgs = grid_groups(tp=tp, pp=pp, cp=cp)
    seed_everything(1, pgs.index("tp"), torch.device("cpu"))
    return build_gpt_model(args, pgs, torch.device("cpu")).eval(), pgs


def load_rank(model, ckpt_dir: str, tp_rank: int, pp_rank: int, pp: int) -> None:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    obj = torch.load(os.path.join(ckpt_dir, "release", name, "model_optim_rng.pt"), weights_only=False)
    model.load_state_dict(obj["model"], strict=True)


def reference(hf_dir: str):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    with torch.no_grad():
        return tokens, model(tokens).logits


def assert_close_rel(ours, theirs, what):
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= TOL, f"{what}: logits differ from transformers' by rel {rel:.2e}"


CASES = [(f, r) for f in FAMILIES for r in ROPES]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every (family, rope) model saved by transformers, its logits on one batch, its description
    and its conversions at tp 1, tp 2 and pp 2."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family, rope in CASES:
        hf_dir = save_hf(root / f"{family}-{rope}", family, rope, seed=len(out))
        tokens, logits = reference(hf_dir)
        m = model_from_hf(transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True))
        out[(family, rope)] = {"model": m, "tokens": tokens, "logits": logits,
                               **{f"tp{tp}pp{pp}": to_ours(hf_dir, root / f"{family}-{rope}-tp{tp}pp{pp}", tp, pp)
                                  for tp, pp in ((1, 1), (2, 1), (1, 2))}}
    return out


def test_logits_match_transformers_tp1(converted):
    init_single_rank_world()
    for (family, rope), dirs in converted.items():
        model, _ = our_model(dirs["model"])
        load_rank(model, dirs["tp1pp1"], 0, 0, 1)
        tokens, theirs = dirs["tokens"], dirs["logits"]
        with torch.no_grad():
            ours = model(tokens, torch.arange(SEQ).expand(2, -1), None)
        assert_close_rel(ours[..., :VOCAB], theirs, f"{family}/{rope}")


LAYOUTS = ("tp2", "pp2", "cp2")


def layout_cases(layout: str):
    """Every rope type once per layout, the family rotating with the layout, so that every family
    meets every layout and every rope type (the whole product runs at tp 1)."""
    shift = LAYOUTS.index(layout)
    families = list(FAMILIES)
    return [(families[(i + shift) % len(families)], rope) for i, rope in enumerate(ROPES)]


def _check_layout(converted, layout):
    for family, rope in layout_cases(layout):
        dirs = converted[(family, rope)]
        tokens, theirs = dirs["tokens"], dirs["logits"]
        {"tp2": _tp2, "pp2": _pp2, "cp2": _cp2}[layout](dirs, tokens, theirs, f"{layout} {family}/{rope}")


def _tp2(dirs, tokens, theirs, what):
    model, pgs = our_model(dirs["model"], tp=2, world=2)
    r = pgs.index("tp")
    load_rank(model, dirs["tp2pp1"], r, 0, 1)
    with torch.no_grad():
        ours = model(tokens, torch.arange(SEQ).expand(2, -1), None)  # [b, s, V/2]: this rank's vocab slice
    half = ours.shape[-1]
    assert_close_rel(ours, theirs[..., r * half : (r + 1) * half], what)


def _pp2(dirs, tokens, theirs, what):
    import torch.distributed as dist

    model, pgs = our_model(dirs["model"], pp=2, world=2)
    stage = pgs.index("pp")
    load_rank(model, dirs["tp1pp2"], 0, stage, 2)
    positions = torch.arange(SEQ).expand(2, -1)
    with torch.no_grad():
        if stage == 0:
            dist.send(model(tokens, positions, None).contiguous(), 1)  # hidden [s, b, h]
            return
        hidden = torch.empty(SEQ, 2, 64)
        dist.recv(hidden, 0)
        model.set_input_tensor(hidden)
        assert_close_rel(model(tokens, positions, None)[..., :VOCAB], theirs, what)


def _cp2(dirs, tokens, theirs, what):
    from megatron.longseq.attention.core import AttentionInputs
    from megatron.longseq.attention.placement import local_token_indices

    model, pgs = our_model(dirs["model"], cp=2, world=2)
    load_rank(model, dirs["tp1pp1"], 0, 0, 1)
    mine = local_token_indices(SEQ, 1, 2, 0, pgs.index("cp"))  # this rank's tokens, zigzag
    positions = mine.expand(2, -1)
    with torch.no_grad():
        ours = model(tokens[:, mine], positions, None, packed_seq_params=AttentionInputs(position_ids=positions))
    assert_close_rel(ours[..., :VOCAB], theirs[:, mine], what)


def _check_layouts(converted):
    for layout in LAYOUTS:  # one world for the three: each grid is built in turn
        _check_layout(converted, layout)


def test_logits_match_transformers_at_tp2_pp2_cp2(converted):
    needed = {case: converted[case] for layout in LAYOUTS for case in layout_cases(layout)}
    run_ranks(_check_layouts, 2, needed)


# ---- round trips -------------------------------------------------------------------------------------
def _files(directory: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for name in sorted(os.listdir(directory)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, name)).items()}


def assert_bitwise(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family, vocab, dtype", [("llama", 250, torch.bfloat16), ("qwen2", VOCAB, torch.float32)])
def test_hf_ours_hf_is_bitwise(tmp_path, family, vocab, dtype):
    """Through tp 2 x pp 2 and back, with a padded vocabulary (250 -> 256) and bf16 weights."""
    hf_dir = tmp_path / "hf"
    hf_model(family, "yarn", vocab=vocab).to(dtype).save_pretrained(hf_dir)
    to_ours(hf_dir, tmp_path / "ours", 2, 2)
    rc, _, err = run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "ours",
                             "--save-dir", tmp_path / "back")
    assert rc == 0, err
    assert_bitwise(_files(hf_dir), _files(tmp_path / "back"))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back", local_files_only=True)
    assert config.architectures == [FAMILIES[family][1]] and config.vocab_size == vocab
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0


def _whole(ckpt_dir) -> dict:
    return read_checkpoint(str(ckpt_dir))[1]


def test_ours_hf_ours_is_bitwise_at_another_layout(tmp_path):
    hf_dir = save_hf(tmp_path / "hf", "mistral", "llama3")
    first = to_ours(hf_dir, tmp_path / "tp2", 2, 1)
    run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", first, "--save-dir", tmp_path / "hf2")
    second = to_ours(tmp_path / "hf2", tmp_path / "pp2", 1, 2)
    assert_bitwise(_whole(first), _whole(second))
    rc, _, err = run_convert("--loader", "megatron", "--saver", "megatron", "--load-dir", second,
                             "--save-dir", tmp_path / "tp2pp2", "--target-tensor-parallel-size", 2,
                             "--target-pipeline-parallel-size", 2)
    assert rc == 0, err
    assert_bitwise(_whole(first), _whole(tmp_path / "tp2pp2"))


# ---- bad input: one line, nothing written ---------------------------------------------------------
def _bad_inputs(tmp_path):
    good = save_hf(tmp_path / "good", "llama", "default")
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    window = save_hf(tmp_path / "window", "mistral", "default", sliding_window=16)
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "config.json").write_text("{not json")
    hf = ["--loader", "hf", "--saver", "megatron", "--load-dir"]
    return {
        "missing": (hf + [tmp_path / "nowhere"], "no such directory"),
        "not a model": (hf + [tmp_path], "no config.json"),
        "unreadable": (hf + [unreadable], "unreadable config.json"),
        "architecture": (hf + [gpt2], "unsupported architecture"),
        "sliding window": (hf + [window], "sliding_window 16"),
        "hidden size": (hf + [good, "--hidden-size", 128], "--hidden-size 128 contradicts the checkpoint, which has 64"),
        "heads": (hf + [good, "--num-attention-heads", 8], "--num-attention-heads 8 contradicts"),
        "vocab": (hf + [good, "--vocab-size", 1000], "--vocab-size 1000 contradicts"),
        "tp": (hf + [good, "--target-tensor-parallel-size", 4], "does not divide the query groups (2)"),
        "no checkpoint": (["--loader", "megatron", "--saver", "hf", "--load-dir", good], "no checkpoint"),
    }


def test_bad_input_is_one_line_before_any_work(tmp_path):
    for what, (argv, message) in _bad_inputs(tmp_path).items():
        out = tmp_path / "out"
        rc, stdout, stderr = run_convert(*argv, "--save-dir", out)
        assert rc == 2 and stdout == "", what
        assert len(stderr.strip().splitlines()) == 1 and message in stderr, f"{what}: {stderr!r}"
        assert not out.exists(), f"{what}: wrote {out}"
    shutil.rmtree(tmp_path / "good")


# ---- training from a converted checkpoint -------------------------------------------------------
def _hf_passkey_loss(hf_dir: str, seq: int, key: int, samples: int, vocab: int, seed: int,
                     depth: float = 0.25) -> float:
    """transformers' loss on the first `samples` passkey samples: the mean over the answer tokens."""
    from megatron.training.passkey import PasskeyDataset

    data = PasskeyDataset(samples, seq, vocab, key, seed=seed, depth=depth)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    losses = []
    with torch.no_grad():
        for i in range(samples):
            sample = data[i]
            logits = model(sample["tokens"][None]).logits[0]
            ce = torch.nn.functional.cross_entropy(logits, sample["labels"], reduction="none")
            losses.append((ce * sample["loss_mask"]).sum() / sample["loss_mask"].sum())
    return float(torch.stack(losses).mean())


def _converted_at_tp2(tmp_path, family: str, rope: str):
    """(HF directory, the pretrain_gpt.py flags the converter printed for its tp-2 checkpoint)."""
    hf_dir = save_hf(tmp_path / "hf", family, rope)
    rc, out, err = run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf_dir, "--save-dir",
                               tmp_path / "ours", "--target-tensor-parallel-size", 2)
    assert rc == 0, err
    return hf_dir, out.strip().splitlines()[-1].split()  # the flags as printed


def _pretrain(nproc: int, flags):
    import subprocess
    import sys

    from tests.functional_tests.run import ROOT
    from tests.unit_tests.dist_utils import child_env, free_port

    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                          "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py")] + flags
                         + ["--distributed-backend", "gloo"],  # CPU ranks also where a GPU is visible
                         capture_output=True, text=True, env=child_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _assert_exports_to(ckpt_dir, hf_dir, tmp_path):
    rc, _, err = run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", ckpt_dir,
                             "--save-dir", tmp_path / "back")
    assert rc == 0, err
    assert_bitwise(_files(hf_dir), _files(tmp_path / "back"))


def test_training_from_a_converted_checkpoint_starts_at_the_hf_loss(tmp_path):
    """pretrain_gpt.py at tp 2 x cp 2 (ring), --finetune from the converted model: iteration 1's
    loss (before any update) is transformers' loss on the same samples. The run saves torch_dist;
    with --lr 0 its weights are the converted ones, and their export is the original bitwise."""
    from tests.functional_tests.run import LINE

    hf_dir, printed = _converted_at_tp2(tmp_path, "qwen2", "yarn")
    seq, key, seed = 64, 4, 1234
    out = _pretrain(4, printed + (
        f"--context-parallel-size 2 --finetune --passkey-data --passkey-length {key} "
        f"--seq-length {seq} --micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 0 "
        f"--save {tmp_path / 'trained'} --ckpt-format torch_dist --auto-detect-ckpt-format "
        f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} --hidden-dropout 0 "
        f"--attention-dropout 0 --log-interval 1 --eval-iters 0 --num-workers 0 --seed {seed}").split())
    assert "loaded checkpoint" in out and "at iteration 0" in out
    first = float(LINE.search(out).group(2))
    theirs = _hf_passkey_loss(hf_dir, seq, key, 2, VOCAB - 1, seed)
    # the log prints 7 significant digits; the model agrees to ~1e-7 (TOL above)
    assert first == pytest.approx(theirs, rel=TOL), (first, theirs)
    _assert_exports_to(tmp_path / "trained", hf_dir, tmp_path)


def test_pretrain_converts_a_converted_checkpoint_to_torch_dist(tmp_path):
    """Megatron's way to torch_dist: pretrain_gpt.py --ckpt-convert-format torch_dist loads the
    released torch checkpoint at tp 2, saves it under --ckpt-convert-save and exits before any
    data or training; that checkpoint exports to the original model bitwise. The model's flags
    and its layout come from the checkpoint (--use-checkpoint-args), not from the printed line."""
    hf_dir, _ = _converted_at_tp2(tmp_path, "llama", "llama3")
    read = f"--use-checkpoint-args --use-mp-args-from-checkpoint-args --load {tmp_path / 'ours'} --ckpt-format torch"
    out = _pretrain(2, read.split() + (
        f"--ckpt-convert-format torch_dist --ckpt-convert-save {tmp_path / 'dist'} --mock-data --seq-length {SEQ} "
        f"--micro-batch-size 1 --train-iters 1 --lr 1e-4 --tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} "
        f"--num-workers 0").split())
    assert "to torch_dist under" in out and "building train" not in out
    _assert_exports_to(tmp_path / "dist" / "torch_dist", hf_dir, tmp_path)  # Megatron's DIR/<format>


# ---- tools/passkey_eval.py: the context-extension example's table -------------------------------
def test_passkey_eval_scores_the_exported_model(tmp_path):
    """Its answer loss is the training loss of the same samples, its hits the argmax's, and a
    RoPE change given at load time is the model saved with that RoPE."""
    from megatron.training.passkey import PasskeyDataset
    from tools import passkey_eval

    plain, linear = save_hf(tmp_path / "plain", "llama", "default"), save_hf(tmp_path / "linear", "llama", "linear")
    seq, samples, seed = 48, 6, 5
    data = PasskeyDataset(samples, seq, VOCAB, seed=seed, depth=1.0)
    acc, loss = passkey_eval.score(passkey_eval.load(plain), data, batch=4)  # two batches, the second short
    assert loss == pytest.approx(_hf_passkey_loss(plain, seq, 1, samples, VOCAB, seed, depth=1.0), rel=TOL)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    with torch.no_grad():
        best = [int(model(data[i]["tokens"][None]).logits[0, -1].argmax()) for i in range(samples)]
    assert acc == sum(b == int(data[i]["labels"][-1]) for i, b in enumerate(best)) / samples
    based = save_hf(tmp_path / "based", "llama", "default", rope_parameters={"rope_type": "default", "rope_theta": 4e4})
    tokens = data[0]["tokens"][None]
    with torch.no_grad():
        for changed, saved in ((passkey_eval.load(plain, f"linear:{ROPES['linear']['factor']}"), linear),
                               (passkey_eval.load(plain, "base:40000"), based)):
            assert torch.equal(changed(tokens).logits, passkey_eval.load(saved)(tokens).logits)


def test_passkey_eval_table_and_bad_input(tmp_path, capsys):
    from tools import passkey_eval

    hf_dir = save_hf(tmp_path / "hf", "qwen2", "default")
    assert passkey_eval.main(["--vocab-size", str(VOCAB), "--lengths", "32", "64", "--samples", "2",
                              "--model", "short", hf_dir, "--model", "stretched", hf_dir, "linear:2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4] == "| model | 32 tokens | 64 tokens |" and lines[-3] == "|---|---:|---:|"
    assert lines[-2].startswith("| short | ") and lines[-1].startswith("| stretched | ")
    cut = tmp_path / "cut"  # an export whose weights file was cut short (a full disk, an interrupted copy)
    cut.mkdir()
    (cut / "config.json").write_text((Path(hf_dir) / "config.json").read_text())
    (cut / "model.safetensors").write_bytes((Path(hf_dir) / "model.safetensors").read_bytes()[:1000])
    for argv, message in ((["--model", "x"], "--model takes LABEL DIR [ROPE], got 1 items"),
                          (["--model", "x", str(tmp_path / "none")], f"no directory {tmp_path / 'none'}"),
                          (["--model", "x", hf_dir, "8"], "the RoPE change is base:THETA or linear:FACTOR, got '8'"),
                          (["--model", "ok", hf_dir, "--model", "x", str(cut)],
                           f"--model 'x': {cut / 'model.safetensors'} is not a readable safetensors file")):
        with pytest.raises(SystemExit):
            passkey_eval.main(["--vocab-size", str(VOCAB), "--lengths", "32"] + argv)
        assert message in capsys.readouterr().err
