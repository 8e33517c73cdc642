"""Llama-family weights between Hugging Face's names and this trainer's, and between one whole
state dict and the per-(tp, pp)-rank ones of a torch-format checkpoint. Pure tensor code.

Hugging Face (per layer i)                        this trainer (megatron-core's local spec)
  model.embed_tokens.weight [V, h]                  embedding.word_embeddings.weight [Vpad, h]
  model.layers.i.input_layernorm.weight             decoder.layers.i.input_layernorm.weight
  model.layers.i.self_attn.{q,k,v}_proj.weight      decoder.layers.i.self_attention.linear_qkv.weight
    (and .bias with Qwen2's QKV bias)                 [g x (q_g, k_g, v_g)] rows, group-major
  model.layers.i.self_attn.o_proj.weight            decoder.layers.i.self_attention.linear_proj.weight
  model.layers.i.post_attention_layernorm.weight    decoder.layers.i.pre_mlp_layernorm.weight
  model.layers.i.mlp.{gate,up}_proj.weight          decoder.layers.i.mlp.linear_fc1.weight [gate; up]
  model.layers.i.mlp.down_proj.weight               decoder.layers.i.mlp.linear_fc2.weight
  model.norm.weight                                 decoder.final_layernorm.weight
  lm_head.weight (absent when tied)                 output_layer.weight (last stage; with tied
                                                    embeddings only when pp > 1, as a copy)
Both rotate the halves of each head (x[j], x[j + d/2]) for RoPE, so no row permutation is needed.
Rows past the true vocabulary are zero: a padded token's logit is 0, and it is never a label.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from megatron.training.init import partition, unpartition

HF_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# (partition dim, stride) of every tensor-parallel weight, by its name's end; the rest are replicated
TP_SPLIT = {
    "word_embeddings.weight": (0, 1), "output_layer.weight": (0, 1),
    "linear_qkv.weight": (0, 1), "linear_qkv.bias": (0, 1),
    "linear_fc1.weight": (0, 2),  # [gate; up]: each rank keeps its slice of both
    "linear_proj.weight": (1, 1), "linear_fc2.weight": (1, 1),
}
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True)
class Shape:
    """What the weight layout depends on."""
    num_layers: int
    heads: int
    groups: int
    head_dim: int
    vocab: int  # the true vocabulary: Hugging Face's rows
    padded_vocab: int
    tied: bool


# ---- Hugging Face <-> whole model -----------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """q [heads*d, ...], k and v [groups*d, ...] -> [groups*(heads/groups + 2)*d, ...], group-major,
    which is how megatron-core splits its qkv output into per-group q, k, v."""
    # [n*d, ...] -> [g, n/g*d, ...] per projection, concatenated in each group
    parts = [t.reshape(s.groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, s: Shape) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, per = s.groups, s.head_dim, s.heads // s.groups
    grouped = qkv.reshape(g, (per + 2) * d, *qkv.shape[1:])  # [g, (per+2)*d, ...]
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t's rows cut or padded with zeros to `rows`."""
    t = t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _layer_from_hf(hf: Dict[str, torch.Tensor], i: int, s: Shape) -> Dict[str, torch.Tensor]:
    src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {dst + ours: hf[src + theirs] for theirs, ours in HF_LAYER.items()}
    attn = src + "self_attn."
    out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(*(hf[f"{attn}{x}_proj.weight"] for x in "qkv"), s)
    if attn + "q_proj.bias" in hf:
        out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(*(hf[f"{attn}{x}_proj.bias"] for x in "qkv"), s)
    out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
    return out


def from_hf(hf: Dict[str, torch.Tensor], s: Shape) -> Dict[str, torch.Tensor]:
    """Hugging Face's state dict -> the whole model under this trainer's names (vocab padded)."""
    out = {"embedding.word_embeddings.weight": pad_rows(hf["model.embed_tokens.weight"], s.padded_vocab),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    for i in range(s.num_layers):
        out.update(_layer_from_hf(hf, i, s))
    if not s.tied:
        out["output_layer.weight"] = pad_rows(hf["lm_head.weight"], s.padded_vocab)
    return out


def _layer_to_hf(ours: Dict[str, torch.Tensor], i: int, s: Shape) -> Dict[str, torch.Tensor]:
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {dst + theirs: ours[src + mine] for theirs, mine in HF_LAYER.items()}
    for suffix in ("weight", "bias"):
        fused = ours.get(f"{src}self_attention.linear_qkv.{suffix}")
        if fused is not None:
            for x, t in zip("qkv", split_qkv(fused, s)):
                out[f"{dst}self_attn.{x}_proj.{suffix}"] = t
    gate, up = ours[src + "mlp.linear_fc1.weight"].chunk(2)
    out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    return out


def to_hf(ours: Dict[str, torch.Tensor], s: Shape) -> Dict[str, torch.Tensor]:
    """The inverse of from_hf (padding rows dropped)."""
    out = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"][: s.vocab].contiguous(),
           "model.norm.weight": ours["decoder.final_layernorm.weight"]}
    for i in range(s.num_layers):
        out.update(_layer_to_hf(ours, i, s))
    if not s.tied:
        out["lm_head.weight"] = ours["output_layer.weight"][: s.vocab].contiguous()
    return out


# ---- whole model <-> (tp, pp) ranks ---------------------------------------------------------------
def stage_bounds(num_layers: int, pp: int) -> List[Tuple[int, int]]:
    """[first, last) global layers of every stage: an even split."""
    per = num_layers // pp
    return [(p * per, (p + 1) * per) for p in range(pp)]


def _split_of(name: str):
    return next((split for end, split in TP_SPLIT.items() if name.endswith(end)), None)


def _stage_names(whole: Dict[str, torch.Tensor], s: Shape, stage: int, pp: int) -> Dict[str, str]:
    """{local name on this stage: global name}."""
    first, last = stage_bounds(s.num_layers, pp)[stage]
    names = {}
    for name in whole:
        if name.startswith("decoder.layers."):
            i = int(name.split(".")[2])
            if first <= i < last:
                names[name.replace(f"decoder.layers.{i}.", f"decoder.layers.{i - first}.", 1)] = name
        elif name.startswith("embedding."):
            if stage == 0:
                names[name] = name
        elif stage == pp - 1:  # final norm, output layer
            names[name] = name
    if s.tied and pp > 1 and stage == pp - 1:
        names["output_layer.weight"] = "embedding.word_embeddings.weight"  # the last stage's copy
    return names


def _extra_states(local: Dict[str, torch.Tensor], s: Shape, stage: int, pp: int) -> None:
    """megatron-core's linears record an (empty) extra state; a strict load wants its key."""
    first, last = stage_bounds(s.num_layers, pp)[stage]
    for i in range(last - first):
        for linear in LINEARS:
            local[f"decoder.layers.{i}.{linear}._extra_state"] = None
    if stage == pp - 1:
        local["output_layer._extra_state"] = None


def shard(whole: Dict[str, torch.Tensor], s: Shape, tp: int, pp: int) -> Dict[Tuple[int, int], dict]:
    """{(tp rank, pp rank): that rank's state dict, under its local names}."""
    out = {}
    for stage in range(pp):
        names = _stage_names(whole, s, stage, pp)
        for rank in range(tp):
            local = {}
            for name, gname in names.items():
                split = _split_of(name)
                full = whole[gname]
                local[name] = full if split is None or tp == 1 else partition(full, *split, rank, tp).clone()
            _extra_states(local, s, stage, pp)
            out[(rank, stage)] = local
    return out


def _stage_layers(local: Dict[str, torch.Tensor]) -> int:
    return len({n.split(".")[2] for n in local if n.startswith("decoder.layers.")})


def unshard(ranks: Dict[Tuple[int, int], dict], tp: int, pp: int, tied: bool) -> Dict[str, torch.Tensor]:
    """The inverse of shard: the whole model from every rank's state dict (stages may be uneven:
    each stage's layer offset is the count of the layers before it)."""
    whole, offset = {}, 0
    for stage in range(pp):
        first = ranks[(0, stage)]
        for name, value in first.items():
            if not torch.is_tensor(value) or (tied and name == "output_layer.weight"):
                continue  # extra states; a tied output layer is the embedding's copy
            split = _split_of(name)
            slices = [ranks[(r, stage)][name] for r in range(tp)]
            whole[_global(name, offset)] = value if split is None or tp == 1 else unpartition(slices, *split)
        offset += _stage_layers(first)
    return whole


def _global(name: str, offset: int) -> str:
    if not name.startswith("decoder.layers."):
        return name
    parts = name.split(".")
    parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)
