"""The converter's edges: the flags it prints parse back to the same numbers, every inconsistent
or damaged input is one line before anything is written, Megatron-LM's Transformer Engine names
are read, and what a padded vocabulary does to the loss."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.convert.hf import ConvertError, model_from_args, model_from_hf, pretrain_flags
from tests.unit_tests.dist_utils import init_single_rank_world
from tests.unit_tests.training.test_convert import (
    SEQ, _files, assert_bitwise, assert_close_rel, load_rank, our_model, run_convert, save_hf, to_ours)

transformers = pytest.importorskip("transformers")


def _llama_config(**fields):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    return transformers.LlamaConfig(**{**base, **fields})


@pytest.mark.parametrize("theta", [1e6, 5e6, 3580165449.0])
def test_printed_flags_parse_back_to_the_same_numbers(theta):
    """Qwen2, Mistral and long-context Llamas have thetas of 1e6 and more, which ':g' printed as
    '1e+06' (refused by --rotary-base's int); ':g' also rounded epsilons and mscales to 6 digits."""
    eps, mscale = 1.2345678e-5, 0.7071067811865476
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": mscale, "mscale_all_dim": mscale}
    m = model_from_hf(_llama_config(rms_norm_eps=eps, rope_parameters=rope))
    args = parse_args(" ".join(pretrain_flags(m, 128)).split() + ["--seq-length", "32", "--micro-batch-size", "1"])
    assert (args.rotary_base, args.norm_epsilon, args.mscale, args.mscale_all_dim) == (int(theta), eps, mscale, mscale)


@pytest.mark.parametrize("mscales", [{}, {"mscale_all_dim": 0.707}, {"mscale": 0, "mscale_all_dim": 0.707},
                                     {"mscale": 0.707}, {"mscale": 0.8, "mscale_all_dim": 0.5},
                                     {"attention_factor": 1.3}, {"mscale": 2.0, "attention_factor": 1.3}])
def test_yarn_attention_factor_survives_import_flags_and_export(mscales):
    """transformers takes the ratio of the two mscales only when both are non-zero (else 0.1 ln f + 1,
    or an explicit attention_factor); megatron-core always takes it. Filling a missing mscale with 1
    made the ratio count (x1.43 on every score at factor 16): import, the printed flags and export
    must all give transformers' factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from megatron.longseq.attention.rope import attention_factor
    from megatron.training.convert.hf import hf_config
    from megatron.training.model import rope_scaling

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 16,
            **mscales}
    config = _llama_config(max_position_embeddings=256, rope_parameters=rope)
    expected = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[1]
    m = model_from_hf(config)
    flags = parse_args(" ".join(pretrain_flags(m, 128)).split() + ["--seq-length", "32", "--micro-batch-size", "1"])
    exported = hf_config(m, torch.float32)
    for factor in (attention_factor(m.rope), attention_factor(rope_scaling(flags)),
                   ROPE_INIT_FUNCTIONS["yarn"](exported, "cpu")[1]):
        assert factor == pytest.approx(expected, rel=1e-12)


def test_partial_rotary_is_refused_both_ways(tmp_path):
    """Llama, Mistral and Qwen2 in transformers rotate the whole head whatever partial_rotary_factor
    says (plain RoPE runs as another model, a scaled one crashes): no conversion either way."""
    with pytest.raises(ConvertError, match=r"partial rotary \(0.5 of the head\): LlamaForCausalLM in transformers"):
        model_from_hf(_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}))
    saved = vars(parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                            "--max-position-embeddings 32 --micro-batch-size 1 --position-embedding-type rope "
                            "--rotary-percent 0.5 --normalization RMSNorm --swiglu --disable-bias-linear "
                            "--vocab-size 256 --tokenizer-type NullTokenizer".split()))
    with pytest.raises(ConvertError, match=r"partial rotary \(0.5 of the head\): LlamaForCausalLM"):
        model_from_args({**saved, "num_query_groups": 4, "padded_vocab_size": 256}, "llama", None)


def test_a_fractional_theta_is_refused():
    with pytest.raises(ConvertError, match="rope_theta 10000.5"):
        model_from_hf(_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.5}))


# ---- damaged or inconsistent input: one line, nothing written ------------------------------------
def _edited(tmp_path, name: str, edit) -> str:
    """A copy of a good model whose tensors pass through `edit(state)`."""
    from safetensors.torch import load_file, save_file

    path = save_hf(tmp_path / name, "llama", "default")
    state = load_file(os.path.join(path, "model.safetensors"))
    edit(state)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


K_PROJ, Q_BIAS = "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.bias"


def _damaged_inputs(tmp_path):
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(save_hf(tmp_path / "whole", "llama", "default")).save_pretrained(
        sharded, max_shard_size="40KB")
    shards = sorted(p for p in os.listdir(sharded) if p.endswith(".safetensors"))
    os.remove(sharded / shards[0])
    truncated = save_hf(tmp_path / "truncated", "llama", "default")
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    wider = save_hf(tmp_path / "wider", "llama", "default")
    config = json.loads((tmp_path / "wider" / "config.json").read_text())
    (tmp_path / "wider" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    hf = ["--loader", "hf", "--saver", "megatron", "--load-dir"]
    return {
        "shard gone": (hf + [sharded], f"the index names {shards[0]}, which is not there"),
        "truncated": (hf + [truncated], "cannot read model.safetensors"),
        "first layer's k": (hf + [_edited(tmp_path, "no_k", lambda s: s.pop(K_PROJ))], f"the safetensors lack {K_PROJ}"),
        "a bias llama has not": (hf + [_edited(tmp_path, "bias", lambda s: s.update({Q_BIAS: torch.zeros(64)}))],
                                 f"hold tensors config.json does not describe: {Q_BIAS}"),
        "config wider than weights": (hf + [wider], "model.layers.0.mlp.gate_proj.weight is [96, 64], not [128, 64]"),
        "shard size": (hf + [truncated, "--max-shard-size", "5 gigs"], "--max-shard-size '5 gigs'"),
    }


def test_damaged_input_is_one_line_before_any_work(tmp_path):
    for what, (argv, message) in _damaged_inputs(tmp_path).items():
        out = tmp_path / "out"
        rc, stdout, stderr = run_convert(*argv, "--save-dir", out)
        assert rc == 2 and stdout == "", f"{what}: {stderr}"
        assert len(stderr.strip().splitlines()) == 1 and message in stderr, f"{what}: {stderr!r}"
        assert not out.exists(), f"{what}: wrote {out}"


def _refused(*argv) -> str:
    rc, stdout, stderr = run_convert(*argv)
    assert rc == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
    return stderr


def test_exports_that_would_lose_or_invent_weights_are_refused(tmp_path):
    """Qwen2's q/k/v biases have no place in a Llama or Mistral config (transformers ignores them)
    and a Llama has none to give a Qwen2; a vocabulary larger than the embedding has no rows."""
    qwen = to_ours(save_hf(tmp_path / "qwen", "qwen2", "default"), tmp_path / "qwen-ours")
    llama = to_ours(save_hf(tmp_path / "llama", "llama", "default"), tmp_path / "llama-ours")
    export = ["--loader", "megatron", "--saver", "hf", "--save-dir", tmp_path / "out", "--load-dir"]
    assert "has q/k/v biases, which LlamaForCausalLM cannot hold" in _refused(*export, qwen, "--hf-family", "llama")
    assert "lacks q/k/v biases, which Qwen2ForCausalLM needs" in _refused(*export, llama, "--hf-family", "qwen2")
    assert "--true-vocab-size 100000: the checkpoint's embedding has 256 rows" in _refused(
        *export, llama, "--true-vocab-size", 100000)
    assert "--true-vocab-size 0: the checkpoint's embedding has 256 rows" in _refused(  # not "unset"
        *export, llama, "--true-vocab-size", 0)
    assert not (tmp_path / "out").exists()


def test_a_conversion_into_its_own_source_is_refused(tmp_path):
    ours = to_ours(save_hf(tmp_path / "hf", "llama", "default"), tmp_path / "ours", 1, 1)
    before = _files(ours)
    stderr = _refused("--loader", "megatron", "--saver", "megatron", "--load-dir", ours, "--save-dir", ours,
                      "--target-tensor-parallel-size", 2)
    assert "--save-dir is --load-dir" in stderr
    assert_bitwise(before, _files(ours))



def test_an_export_replaces_its_directory_whole(tmp_path, monkeypatch):
    """A re-export with bigger shards leaves no stale shard of the first; a crash while writing
    leaves the earlier export as it was; a directory that is no model is refused, untouched."""
    ours = to_ours(save_hf(tmp_path / "hf", "llama", "default"), tmp_path / "ours")
    out = tmp_path / "out"
    export = ["--loader", "megatron", "--saver", "hf", "--load-dir", ours, "--save-dir", out]
    assert run_convert(*export, "--max-shard-size", "100KB")[0] == 0
    assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1
    assert run_convert(*export)[0] == 0
    names = sorted(os.listdir(out))
    assert [n for n in names if n.endswith(".safetensors")] == ["model.safetensors"], names
    assert "model.safetensors.index.json" not in names
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2
    before = _files(out)

    def half_written(state, path, **kw):  # a shard cut short, then the process dies
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise ZeroDivisionError

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "save_torch_state_dict", half_written)
    with pytest.raises(ZeroDivisionError):
        run_convert(*export)
    assert_bitwise(before, _files(out))
    assert sorted(os.listdir(out)) == names

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    stderr = _refused(*export[:-1], other)
    assert "exists and is not a Hugging Face model directory" in stderr
    assert os.listdir(other) == ["keep.txt"]

# ---- Megatron-LM's names ---------------------------------------------------------------------------
def test_a_checkpoint_with_transformer_engine_names_exports(tmp_path):
    """Megatron-LM on GPU builds Transformer Engine layers: the norms live in the fused linear
    modules (linear_qkv.layer_norm_weight) and every module keeps an _extra_state. Written so, the
    checkpoint exports to the same Hugging Face weights."""
    hf_dir = save_hf(tmp_path / "hf", "mistral", "default")
    ours = to_ours(hf_dir, tmp_path / "ours", 2, 1)
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = os.path.join(ours, "release", rank, "model_optim_rng.pt")
        obj = torch.load(path, weights_only=False)
        obj["model"] = {_te_name(k): v for k, v in obj["model"].items()}
        obj["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
        torch.save(obj, path)
    rc, _, err = run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", ours,
                             "--save-dir", tmp_path / "back")
    assert rc == 0, err
    assert_bitwise(_files(hf_dir), _files(tmp_path / "back"))


def _te_name(key: str) -> str:
    return key.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight").replace(
        "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")


# ---- a padded vocabulary -----------------------------------------------------------------------------
def test_padded_rows_give_logit_zero_and_the_loss_counts_them_as_megatrons_does(tmp_path):
    """Rows past the true vocabulary (250 -> 256) are zero, so a padded token's logit is 0. The
    trainer's cross entropy, like Megatron's, runs over the padded vocabulary: per token it exceeds
    Hugging Face's by log(1 + pad / Z), Z the sum of exp(logits) over the true vocabulary (tiny for
    a trained model, whose top logits dominate Z; documented in README)."""
    init_single_rank_world()
    vocab = 250
    hf_dir = save_hf(tmp_path / "hf", "llama", "default", vocab=vocab)
    m = model_from_hf(transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True))
    model, _ = our_model(m)
    load_rank(model, to_ours(hf_dir, tmp_path / "ours"), 0, 0, 1)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    theirs = hf(tokens).logits.detach()
    with torch.no_grad():
        ours = model(tokens, torch.arange(SEQ).expand(2, -1), None)
    assert_close_rel(ours[..., :vocab], theirs, "padded llama")
    assert torch.equal(ours[..., vocab:], torch.zeros_like(ours[..., vocab:]))
    labels = tokens.roll(-1, 1)
    gap = torch.log1p((ours.shape[-1] - vocab) / theirs.double().exp().sum(-1))
    ce_ours = torch.nn.functional.cross_entropy(ours.flatten(0, 1).double(), labels.flatten(), reduction="none")
    ce_hf = torch.nn.functional.cross_entropy(theirs.flatten(0, 1).double(), labels.flatten(), reduction="none")
    torch.testing.assert_close(ce_ours, ce_hf + gap.flatten(), rtol=0, atol=1e-5)
    assert math.isclose(float(gap.mean()), math.log(256 / 250), rel_tol=0.05)  # a random model: logits near 0
