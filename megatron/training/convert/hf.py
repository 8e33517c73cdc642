"""A Llama-family model's description, read from and written to Hugging Face's config and this
trainer's arguments, and Hugging Face safetensors directories read and written.

Families: Llama 2/3 (`llama`), Mistral (`mistral`, without a sliding window) and Qwen2 (`qwen2`:
biases on q, k and v). Every one is RMSNorm + SwiGLU + RoPE with grouped-query attention; what
this trainer cannot reproduce exactly (sliding windows, other activations, dynamic or long RoPE,
llama3 frequency bands other than Megatron's fixed 1 and 4) is refused in one line.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

from megatron.longseq.attention.rope import RopeScaling, attention_factor
from megatron.training.convert.layout import Shape
from megatron.training.problems import flag

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURE = {family: arch for arch, family in FAMILIES.items()}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "vocab.json", "merges.txt")


class ConvertError(ValueError):
    """A checkpoint or flag this conversion cannot take; reported as one line before any work."""


@dataclass(frozen=True)
class Model:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    max_positions: int
    norm_epsilon: float
    rotary_base: float
    rotary_percent: float
    tied: bool
    qkv_bias: bool
    rope: RopeScaling = RopeScaling()

    def shape(self, padded_vocab: int) -> Shape:
        return Shape(self.num_layers, self.heads, self.groups, self.head_dim, self.vocab, padded_vocab, self.tied)


# ---- Hugging Face config -> Model -----------------------------------------------------------------
def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConvertError(message)


def _family(config) -> str:
    archs = getattr(config, "architectures", None) or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    _require(family is not None, f"unsupported architecture {archs or config.model_type}: this converter reads "
                                 f"{', '.join(FAMILIES)}")
    return family


def _check_layout(config) -> None:
    _require(config.hidden_act == "silu", f"hidden_act {config.hidden_act!r}: only SwiGLU (silu) is supported")
    _require(not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False),
             "attention_bias / mlp_bias: only Qwen2's q, k, v biases are supported")
    window = getattr(config, "sliding_window", None)
    sliding = getattr(config, "use_sliding_window", True) and window is not None
    _require(not sliding, f"sliding_window {window}: this trainer attends to the whole causal context")


def _rope_from_hf(params: dict) -> RopeScaling:
    kind = params.get("rope_type", "default")
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(interpolation=float(params["factor"]))
    if kind == "llama3":
        _require((params["low_freq_factor"], params["high_freq_factor"]) == (1.0, 4.0),
                 f"llama3 rope with low/high frequency factors {params['low_freq_factor']}/"
                 f"{params['high_freq_factor']}: Megatron's --use-rope-scaling fixes them at 1/4")
        return RopeScaling("llama3", float(params["factor"]), original_context=params["original_max_position_embeddings"])
    _require(kind == "yarn", f"rope_type {kind!r}: only default, linear, llama3 and yarn are supported")
    return _yarn_from_hf(params)


def _yarn_from_hf(params: dict) -> RopeScaling:
    _require(params.get("factor") is not None, "yarn rope without a factor")
    _require(params.get("truncate", True), "yarn rope with truncate=False: Megatron rounds the correction range")
    mscale, mscale_all_dim = _yarn_mscales(params, float(params["factor"]))
    s = RopeScaling("yarn", float(params["factor"]), original_context=params["original_max_position_embeddings"],
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=mscale, mscale_all_dim=mscale_all_dim)
    given = params.get("attention_factor")
    _require(given is None or abs(given - attention_factor(s)) < 1e-12,
             f"yarn attention_factor {given} differs from the one its factor and mscales give ({attention_factor(s)})")
    return s


def _yarn_mscales(params: dict, factor: float) -> tuple:
    """transformers' attention factor as Megatron's (--mscale, --mscale-all-dim), whose factor is always
    their ratio: its own pair when both are non-zero (transformers takes the ratio only then); else an
    explicit attention_factor a, as mscale (a - 1) / (0.1 ln f) over 0; else YaRN's 0.1 ln f + 1, 1 over 0."""
    mscale, mscale_all_dim, given = params.get("mscale"), params.get("mscale_all_dim"), params.get("attention_factor")
    if mscale and mscale_all_dim:
        return float(mscale), float(mscale_all_dim)
    if given is not None and factor > 1:
        return (float(given) - 1) / (0.1 * math.log(factor)), 0.0
    return 1.0, 0.0


def _whole_head_rotary(percent: float, family: str) -> float:
    _require(percent == 1.0, f"partial rotary ({percent} of the head): {ARCHITECTURE[family]} in transformers "
                             "rotates the whole head, so the model would not be the same")
    return percent


def model_from_hf(config) -> Model:
    """The Model a transformers config describes (ConvertError for what cannot be reproduced)."""
    family = _family(config)
    _check_layout(config)
    params = config.rope_parameters
    _require(float(params["rope_theta"]).is_integer(),
             f"rope_theta {params['rope_theta']}: Megatron's --rotary-base takes a whole number")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Model(family=family, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                 ffn_hidden_size=config.intermediate_size, heads=config.num_attention_heads,
                 groups=config.num_key_value_heads or config.num_attention_heads, head_dim=head_dim,
                 vocab=config.vocab_size, max_positions=config.max_position_embeddings,
                 norm_epsilon=config.rms_norm_eps, rotary_base=float(params["rope_theta"]),
                 rotary_percent=_whole_head_rotary(float(params.get("partial_rotary_factor", 1.0)), family),
                 tied=bool(config.tie_word_embeddings), qkv_bias=family == "qwen2", rope=_rope_from_hf(params))


# ---- Model -> Hugging Face config -----------------------------------------------------------------
def _rope_to_hf(m: Model) -> dict:
    s, params = m.rope, {"rope_theta": m.rotary_base}
    if s.kind == "llama3":
        params.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                      high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.context())
    elif s.kind == "yarn":
        params.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.context(),
                      beta_fast=s.beta_fast, beta_slow=s.beta_slow)
        if s.mscale and s.mscale_all_dim:  # transformers takes their ratio, as Megatron
            params.update(mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)
        else:  # transformers would ignore a lone mscale: the factor itself
            params["attention_factor"] = attention_factor(s)
    else:
        params["rope_type"] = "default"
    if s.interpolation != 1.0:
        _require(s.kind == "rope", "linear interpolation on top of llama3 or yarn has no Hugging Face rope type")
        params.update(rope_type="linear", factor=s.interpolation)
    return params


def hf_config(m: Model, dtype: torch.dtype, base: Optional[dict] = None):
    """A transformers config for `m`; fields of `base` (the config the model came from) that do not
    describe the model (token ids, say) are kept."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[m.family]
    fields = dict(base or {})
    for key in ("rope_scaling", "rope_theta", "transformers_version", "torch_dtype", "layer_types"):
        fields.pop(key, None)  # replaced by rope_parameters and dtype below
    fields.update(architectures=[ARCHITECTURE[m.family]], vocab_size=m.vocab, hidden_size=m.hidden_size,
                  intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.heads, num_key_value_heads=m.groups, head_dim=m.head_dim,
                  max_position_embeddings=m.max_positions, rms_norm_eps=m.norm_epsilon, hidden_act="silu",
                  tie_word_embeddings=m.tied, rope_parameters=_rope_to_hf(m), dtype=dtype,
                  sliding_window=None, use_sliding_window=False)
    return cls(**fields)


# ---- Model <-> this trainer's arguments ----------------------------------------------------------
def _rope_args(s: RopeScaling) -> dict:
    return dict(rotary_seq_len_interpolation_factor=s.interpolation if s.interpolation != 1.0 else None,
                use_rope_scaling=s.kind == "llama3", rope_scaling_factor=s.factor if s.kind == "llama3" else 8.0,
                rope_type="yarn" if s.kind == "yarn" else None, rotary_scaling_factor=s.factor if s.kind == "yarn" else 1.0,
                original_max_position_embeddings=s.original_context, beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)


def trainer_args(m: Model, tp: int, pp: int, padded_vocab: int) -> dict:
    """The arguments a checkpoint records (checkpointing.MUST_MATCH and DESCRIBED), and the model's
    vocabulary, so that --use-checkpoint-args builds the model from the checkpoint alone."""
    return dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.heads,
                group_query_attention=m.groups != m.heads, num_query_groups=m.groups,
                ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim,
                padded_vocab_size=padded_vocab, vocab_size=m.vocab, position_embedding_type="rope",
                normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, untie_embeddings_and_output_weights=not m.tied,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, add_qkv_bias=m.qkv_bias,
                true_vocab_size=m.vocab, norm_epsilon=m.norm_epsilon, rotary_base=m.rotary_base,
                rotary_percent=m.rotary_percent, rotary_interleaved=False, max_position_embeddings=m.max_positions,
                qk_layernorm=False, apply_layernorm_1p=False, **_rope_args(m.rope))


def _check_trainer_layout(saved: dict) -> None:
    want = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                rotary_interleaved=False, qk_layernorm=False, apply_layernorm_1p=False)
    for key, value in want.items():
        _require(saved.get(key, value) == value,
                 f"checkpoint has {key}={saved.get(key)}: a Llama-family export needs {key}={value}")


# the rope arguments' defaults, for checkpoints that record only some of them
_ROPE_DEFAULTS = dict(rotary_seq_len_interpolation_factor=None, use_rope_scaling=False, rope_scaling_factor=8.0,
                      rope_type=None, rotary_scaling_factor=1.0, original_max_position_embeddings=None,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)


def _rope_from_args(a: dict) -> RopeScaling:
    from megatron.training.model import rope_scaling  # the one reading of the flags

    return rope_scaling(SimpleNamespace(**{**_ROPE_DEFAULTS, **{k: a[k] for k in _ROPE_DEFAULTS if k in a}}))


def model_from_args(saved: dict, family: str, vocab: Optional[int]) -> Model:
    """The Model a checkpoint of this trainer records (`vocab`: its true vocabulary, if known)."""
    _check_trainer_layout(saved)
    # Qwen2 always has q/k/v biases and the others never: a mismatch would drop them or invent zeros
    biased = bool(saved.get("add_qkv_bias"))
    _require(biased == (family == "qwen2"), f"--hf-family {family}: the checkpoint {'has' if biased else 'lacks'} "
                                            f"q/k/v biases, which {ARCHITECTURE[family]} "
                                            f"{'cannot hold' if biased else 'needs'}")
    _require("norm_epsilon" in saved, "the checkpoint does not record norm_epsilon and the rope settings "
                                      "(saved by an older version): it cannot be described for export")
    return Model(family=family, num_layers=saved["num_layers"], hidden_size=saved["hidden_size"],
                 ffn_hidden_size=saved["ffn_hidden_size"], heads=saved["num_attention_heads"],
                 groups=saved["num_query_groups"], head_dim=saved["kv_channels"],
                 vocab=vocab or saved.get("true_vocab_size") or saved["padded_vocab_size"],
                 max_positions=saved["max_position_embeddings"], norm_epsilon=saved["norm_epsilon"],
                 rotary_base=float(saved["rotary_base"]),
                 rotary_percent=_whole_head_rotary(saved["rotary_percent"], family),
                 tied=not saved["untie_embeddings_and_output_weights"], qkv_bias=biased,
                 rope=_rope_from_args(saved))


def pretrain_flags(m: Model, divisible_by: int) -> List[str]:
    """The pretrain_gpt.py model flags that build this model."""
    flags = [f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden_size}", f"--ffn-hidden-size {m.ffn_hidden_size}",
             f"--num-attention-heads {m.heads}", f"--kv-channels {m.head_dim}",
             f"--max-position-embeddings {m.max_positions}", "--position-embedding-type rope",
             f"--rotary-base {int(m.rotary_base)}", "--normalization RMSNorm", f"--norm-epsilon {m.norm_epsilon!r}",
             "--swiglu", "--disable-bias-linear", f"--vocab-size {m.vocab}",
             f"--make-vocab-size-divisible-by {divisible_by}"]
    if m.groups != m.heads:
        flags.append(f"--group-query-attention --num-query-groups {m.groups}")
    if not m.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if m.qkv_bias:
        flags.append("--add-qkv-bias")
    return flags + _rope_flags(m.rope)


def _rope_flags(s: RopeScaling) -> List[str]:
    # floats as repr: the shortest text that parses back to the same number (":g" keeps 6 digits)
    flags = [] if s.interpolation == 1.0 else [f"--rotary-seq-len-interpolation-factor {s.interpolation!r}"]
    if s.kind == "llama3":
        flags.append(f"--use-rope-scaling --rope-scaling-factor {s.factor!r}")
    if s.kind == "yarn":
        flags.append(f"--rope-type yarn --rotary-scaling-factor {s.factor!r} --beta-fast {s.beta_fast!r} "
                     f"--beta-slow {s.beta_slow!r} --mscale {s.mscale!r} --mscale-all-dim {s.mscale_all_dim!r}")
    if s.kind != "rope":
        flags.append(f"--original-max-position-embeddings {s.context()}")
    return flags


def check_flags(m: Model, given: Dict[str, Optional[int]]) -> None:
    """Model flags given to the converter must agree with the checkpoint."""
    have = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.heads,
                num_query_groups=m.groups, ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim, vocab_size=m.vocab)
    for key, value in given.items():
        _require(value is None or value == have[key],
                 f"{flag(key)} {value} contradicts the checkpoint, which has {have[key]}")


# ---- safetensors directories ---------------------------------------------------------------------
def read_hf_config(path: str):
    """The transformers config of a local Hugging Face model directory."""
    import transformers

    _require(os.path.isdir(path), f"--load-dir {path}: no such directory")
    _require(os.path.isfile(os.path.join(path, "config.json")), f"--load-dir {path}: no config.json (not a Hugging Face model)")
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ConvertError(f"--load-dir {path}: unreadable config.json ({str(err).splitlines()[0]})") from None


def read_hf_weights(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for name in _weight_files(path):
        try:
            state.update(load_file(os.path.join(path, name)))
        except Exception as err:  # safetensors' own error type (a truncated file) is no OSError
            raise ConvertError(f"--load-dir {path}: cannot read {name} ({str(err).splitlines()[0]})") from None
    return state


def _weight_files(path: str) -> List[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in files if not os.path.isfile(os.path.join(path, n))]
        _require(not missing, f"--load-dir {path}: the index names {', '.join(missing)}, which is not there")
        return files
    _require(os.path.isfile(os.path.join(path, "model.safetensors")),
             f"--load-dir {path}: no model.safetensors or model.safetensors.index.json (only safetensors are read)")
    return ["model.safetensors"]


def hf_shapes(m: Model) -> Dict[str, tuple]:
    """Every tensor a Hugging Face checkpoint of `m` holds, with its shape."""
    h, q, kv, f = m.hidden_size, m.heads * m.head_dim, m.groups * m.head_dim, m.ffn_hidden_size
    shapes = {"model.embed_tokens.weight": (m.vocab, h), "model.norm.weight": (h,)}
    if not m.tied:
        shapes["lm_head.weight"] = (m.vocab, h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    if m.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    for i in range(m.num_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_weights(state: Dict[str, torch.Tensor], m: Model) -> None:
    """The safetensors hold exactly the tensors config.json describes, each of its shape (RoPE's
    inverse frequencies, which some older checkpoints store, are recomputed and ignored)."""
    want = hf_shapes(m)
    missing = [n for n in want if n not in state]
    extra = [n for n in state if n not in want and not n.endswith("rotary_emb.inv_freq")]
    wrong = [f"{n} is {list(state[n].shape)}, not {list(s)}" for n, s in want.items()
             if n in state and tuple(state[n].shape) != s]
    for problems, what in ((missing, "lack"), (extra, "hold tensors config.json does not describe:"),
                           (wrong, "disagree with config.json:")):
        _require(not problems, f"the safetensors {what} {', '.join(problems[:3])}"
                               f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}")


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # Hugging Face's shard-size units


def shard_size_bytes(text: str) -> int:
    """'5GB' -> 5 * 10**9, as Hugging Face reads --max-shard-size, checked before any work."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]B)\s*", text, re.IGNORECASE)
    _require(match is not None and float(match[1]) > 0,
             f"--max-shard-size {text!r}: expected a size like 5GB or 500MB")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def write_hf_dir(path: str, config, state: Dict[str, torch.Tensor], max_shard_size: int = 5 * 10**9) -> None:
    """config.json and safetensors shards (with their index when more than one)."""
    from huggingface_hub import save_torch_state_dict

    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    # safetensors refuses a tensor that shares its storage (split q/k/v, gate/up): each its own
    owned = {k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in state.items()}
    save_torch_state_dict(owned, path, max_shard_size=max_shard_size)
