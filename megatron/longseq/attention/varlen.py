"""A packed-document ring block as variable-length kernel calls (cu_seqlens), not one call per piece.

Between packed documents a ring block has one or two pieces per document it meets (documents.py):
a 128K sample of 4K documents gives ~32 per block, and a kernel launch per piece leaves the GPU
idle between small calls (and, for cuDNN, builds a graph per shape). A kernel with a variable-
length entry takes many sequences in one call, each query range against its own key range. The
pieces are sorted into groups of one kind (causal squares, or full rectangles) whose query rows
do not overlap -- the diagonal block is one causal group; an off-diagonal block one full group,
plus one per extra key range a query run sees -- and each group is one call over its rows
gathered back to back. Where a group's rows are the whole block in order (the diagonal block at
micro-batch 1) the call takes views, no gather.

Results merge into the accumulators over the group's rows exactly as a piece's do (ring.merge's
formula), and the backward takes the final out/lse of those rows, so gradients are unchanged.
Rows are addressed by (sample, row) index pairs into [b, h, s, d] tensors, whose token-first view
[b, s, h, d] turns a gather into one advanced index: x.transpose(1, 2)[sample, row] -> [T, h, d].
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Tuple

import torch

from megatron.longseq.attention.documents import Piece
from megatron.longseq.attention.kernels import VARLEN_MAX_SEQS, AttentionKernel, Varlen

Tensor = torch.Tensor
Index = Tuple[Tensor, Tensor]  # (sample [T], row [T]) long: the rows of a group, in call order


@dataclass(frozen=True)
class Group:
    """One variable-length call: its query rows, its key rows and the sequences over them.
    `whole_q` / `whole_k`: the rows are every row of the block in order (views, no gather)."""

    q: Index
    k: Index
    seqs: Varlen
    whole_q: bool
    whole_k: bool


def uses_varlen(kernel: AttentionKernel, pieces: List[Piece]) -> bool:
    """A block of several pieces goes to the kernel's variable-length entry where it has one."""
    return kernel.varlen and len(pieces) > 1


# What one call of flash-attention 2's variable-length kernels (torch's and flash-attn's) can take:
# its backward keeps fp32 scratch of (rows + PAD x sequences) x heads x d, several times the rows'
# own size for many short documents; and its grid has one row per sequence, at most MAX_SEQS. A group
# is closed before its padding passes its rows by PAD_ROWS (256 MiB of scratch at 32 heads of 128).
PAD, PAD_ROWS, MAX_SEQS = 128, 16384, VARLEN_MAX_SEQS


def group_pieces(pieces: List[Piece], samples: int) -> List[List[Piece]]:
    """Pieces of one kind with disjoint query rows and disjoint key rows per group (so a group's
    results and gradients land on distinct rows), each group ordered by query row and within the
    kernels' limits. A piece for every sample (sample None) counts once per sample."""
    groups: List[_Open] = []
    each = [replace(p, sample=i) for p in pieces for i in (range(samples) if p.sample is None else [p.sample])]
    for p in sorted(each, key=lambda p: (p.sample, p.q0, p.k0)):
        home = next((g for g in groups if g.fits(p)), None)
        if home is None:
            home = _Open()
            groups.append(home)
        home.add(p)
    return [g.pieces for g in groups]


class _Open:
    """A group being filled: its pieces (by sample, then query row), their query rows, and per
    sample the end of the furthest key range (a piece past it needs no check against each member:
    the usual case, so grouping stays linear in the pieces)."""

    def __init__(self):
        self.pieces: List[Piece] = []
        self.rows = 0
        self.key_end = {}

    def fits(self, p: Piece) -> bool:
        last, n = self.pieces[-1], len(self.pieces) + 1
        if last.causal != p.causal or (last.sample, last.q1) > (p.sample, p.q0):
            return False
        if n > MAX_SEQS or PAD * n > self.rows + (p.q1 - p.q0) + PAD_ROWS:
            return False
        return p.k0 >= self.key_end.get(p.sample, p.k0) or keys_apart(self.pieces, p)

    def add(self, p: Piece) -> None:
        self.pieces.append(p)
        self.rows += p.q1 - p.q0
        self.key_end[p.sample] = max(self.key_end.get(p.sample, p.k1), p.k1)


def keys_apart(members: List[Piece], p: Piece) -> bool:
    """Whether p's key rows meet no member's (of its sample)."""
    return all(m.sample != p.sample or m.k1 <= p.k0 or p.k1 <= m.k0 for m in members)


def _side(members: List[Piece], lo: str, hi: str) -> Tuple[Index, Tensor, int]:
    """One side (q or k) of a group, on the host: its (sample, row) index, cu_seqlens int32
    [n + 1] and the longest range."""
    lengths = torch.tensor([getattr(p, hi) - getattr(p, lo) for p in members])
    sample = torch.tensor([p.sample for p in members]).repeat_interleave(lengths)
    row = torch.cat([torch.arange(getattr(p, lo), getattr(p, hi)) for p in members])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    return (sample, row), cu, int(lengths.max())


def _whole(index: Index, samples: int, rows: int) -> bool:
    """Whether the index is every row of every sample, in order."""
    every = torch.arange(samples * rows)
    return index[0].numel() == every.numel() and torch.equal(index[0] * rows + index[1], every)


def _host_plan(members: List[Piece], samples: int, sq: int, sk: int) -> tuple:
    """A group's call on the host: (its index and cu_seqlens tensors, the rest of its Group)."""
    q, cu_q, max_q = _side(members, "q0", "q1")
    k, cu_k, max_k = _side(members, "k0", "k1")
    rest = (max_q, max_k, q[0].numel(), k[0].numel(), members[0].causal, _whole(q, samples, sq), _whole(k, samples, sk))
    return [*q, *k, cu_q.long(), cu_k.long()], rest


def _to_device(tensors: List[Tensor], device) -> List[Tensor]:
    """int64 host tensors on `device`, in one copy: a plan is made inside the first layer's ring
    loop, where a copy per tensor from pageable memory would each wait for the compute stream. On
    CUDA the copy leaves from pinned memory and does not block."""
    flat = torch.cat(tensors)
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    return list(flat.split([t.numel() for t in tensors]))


def make_groups(members: List[List[Piece]], samples: int, sq: int, sk: int, device) -> List[Group]:
    """The block's calls, moved to the device together (the plan serves every layer)."""
    hosts = [_host_plan(m, samples, sq, sk) for m in members]
    moved = _to_device([t for tensors, _ in hosts for t in tensors], torch.device(device))
    groups = []
    for i, (_, (max_q, max_k, total_q, total_k, causal, whole_q, whole_k)) in enumerate(hosts):
        q_sample, q_row, k_sample, k_row, cu_q, cu_k = moved[6 * i : 6 * i + 6]
        seqs = Varlen(cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, total_q, total_k, causal)
        groups.append(Group((q_sample, q_row), (k_sample, k_row), seqs, whole_q, whole_k))
    return groups


def plan(pieces, samples: int, sq: int, sk: int, device) -> List[Group]:
    """The block's groups, kept on the pieces' list (documents.Pieces) for the next layer."""
    key = (samples, sq, sk, str(device))
    kept = getattr(pieces, "plans", None)
    if kept is not None and key in kept:
        return kept[key]
    groups = make_groups(group_pieces(pieces, samples), samples, sq, sk, device)
    if kept is not None:
        kept[key] = groups
    return groups


# ---- rows in and out ---------------------------------------------------------------------------------

def gather(x: Tensor, index: Index, whole: bool = False) -> Tensor:
    """x [b, h, s, d] -> the group's rows [T, h, d] (a view where they are every row of a one-sample
    block: [1, h, s, d] -> [s, h, d])."""
    tokens_first = x.transpose(1, 2)  # [b, s, h, d] view
    if whole:
        return tokens_first.reshape(-1, x.shape[1], x.shape[3])  # [b*s, h, d]: a view at b == 1
    return tokens_first[index]


def gather_lse(lse: Tensor, index: Index, whole: bool = False) -> Tensor:
    """lse [b, h, s] -> the group's rows [h, T], contiguous (varlen kernels read it so)."""
    if whole:
        return lse.transpose(0, 1).reshape(lse.shape[1], -1).contiguous()  # [h, b*s]: a view at b == 1
    return lse.transpose(1, 2)[index].t().contiguous()  # [b, s, h][index] -> [T, h] -> [h, T]


def _add_rows(x: Tensor, index: Index, rows: Tensor, whole: bool = False) -> None:
    """x [b, h, s, d] += rows [T, h, d] at the index (distinct rows: a group's), in place."""
    tokens_first = x.transpose(1, 2)  # [b, s, h, d] view
    if whole:  # every row in order: one add, no gather or scatter
        tokens_first.add_(rows.view(tokens_first.shape))
    else:
        tokens_first[index] = tokens_first[index] + rows


# ---- forward ------------------------------------------------------------------------------------------

def _call(q, kv, g: Group, kernel: AttentionKernel, scale):
    k, v = kv
    return kernel.forward_varlen(gather(q, g.q, g.whole_q), gather(k, g.k, g.whole_k), gather(v, g.k, g.whole_k),
                                 g.seqs, scale)


def first_block(q, kv, groups: List[Group], kernel: AttentionKernel, scale):
    """(out, lse) of a diagonal block whose groups cover every query row once."""
    b, h, s, d = q.shape
    if len(groups) == 1 and groups[0].whole_q:
        out_rows, lse_rows = _call(q, kv, groups[0], kernel, scale)
        out = out_rows.view(b, s, h, d).transpose(1, 2)  # [b*s, h, d] -> [b, h, s, d], laid out by token
        return out, lse_rows.view(h, b, s).transpose(0, 1).contiguous()  # [h, b*s] -> [b, h, s]
    out, lse = torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)
    for g in groups:
        out_rows, lse_rows = _call(q, kv, g, kernel, scale)
        out.transpose(1, 2)[g.q] = out_rows
        lse.transpose(1, 2)[g.q] = lse_rows.t()
    return out, lse


def block_forward(q, kv, groups: List[Group], kernel: AttentionKernel, scale, out, lse):
    """Merge every group of the block into the accumulators (fp32 from here on)."""
    out = out if out.dtype == torch.float32 else out.float()
    for g in groups:
        out_rows, lse_rows = _call(q, kv, g, kernel, scale)
        _merge_rows(out, lse, g.q, out_rows, lse_rows)
    return out, lse


def _merge_rows(out, lse, index: Index, block_out: Tensor, block_lse: Tensor) -> None:
    """ring.merge over a group's rows: with d = block lse - lse, the new lse is lse + softplus(d)
    and the rows merged so far keep the weight sigmoid(-d). block_out [T, h, d], block_lse [h, T].
    One out-sized temporary, the gathered rows (updated in place: a bf16 block is cast on the fly)."""
    o_view, l_view = out.transpose(1, 2), lse.transpose(1, 2)  # [b, s, h, d], [b, s, h]
    l_rows = l_view[index]  # [T, h]
    d = block_lse.t() - l_rows
    l_view[index] = l_rows + torch.nn.functional.softplus(d)
    o_rows = o_view[index]  # [T, h, d], a copy
    o_rows.sub_(block_out).mul_(d.neg_().sigmoid_().unsqueeze(-1)).add_(block_out)
    o_view[index] = o_rows


# ---- backward -----------------------------------------------------------------------------------------

def block_backward(q, kv, dout, out, lse, groups: List[Group], kernel: AttentionKernel, scale, dq):
    """Add the block's dq into `dq` (fp32, in place); return each group's (group, dK rows, dV rows)
    for add_grads."""
    k, v = kv
    grads = []
    for g in groups:
        dq_g, dk_g, dv_g = kernel.backward_varlen(
            gather(dout, g.q, g.whole_q), gather(q, g.q, g.whole_q), gather(k, g.k, g.whole_k),
            gather(v, g.k, g.whole_k), gather(out, g.q, g.whole_q), gather_lse(lse, g.q, g.whole_q), g.seqs, scale)
        _add_rows(dq, g.q, dq_g, g.whole_q)
        grads.append((g, dk_g, dv_g))
    return grads


def add_grads(acc: Tensor, g: Group, dk: Tensor, dv: Tensor) -> None:
    """acc [2, b, g, s, d] (fp32) += a group's dK/dV rows [T, g, d] on its key rows."""
    _add_rows(acc[0], g.k, dk, g.whole_k)
    _add_rows(acc[1], g.k, dv, g.whole_k)
