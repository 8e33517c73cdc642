"""LoongTrain section 4.5's cost model for 2D attention: rank (hp, ring, inner ring, placement).

For one attention layer on d_sp GPUs, S tokens, hidden D, H heads, H_kv KV heads (paper notation;
under tensor parallelism of size tp, H, H_kv and D are a tp rank's share):
  T_comp^fwd per micro-step = flops(block) / throughput      (4.5.2; the backward is 3x)
  Size(kv)   = max(H_kv, d_hp)/H x 2 tensors x S D/d_sp x bytes      (4.5.3)
  T_ring^fwd = A (w-1) + B,  A = max(T_comp, T_p2p_inner), B = max(T_comp, T_p2p_outer)
  AlltoAll   = sum over q, k, v, out of Size(i) (d_hp-1)/d_hp, forward and backward (4.5.4)
  T          = T_SeqAlltoAll + (T_ring^fwd + T_ring^bwd) x d_cp/w                  (4.5.4)
With packed documents T_comp is scaled by the slowest position's share of the causal work that
the documents leave (attention_fraction); the transfers are counted whole (see attention_fraction).
Which transfers cross nodes comes from the rank grid (placement decides who sits together);
concurrent inter-node flows of a node share its NICs. The backward ring carries KV and the fp32
dK/dV accumulators (3x the forward bytes), as our implementation does.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

from megatron.longseq.attention.documents import balanced_ring_tokens, causal_work
from megatron.longseq.attention.placement import split_heads
from megatron.longseq.parallel_state import PLACEMENTS, RankGrid


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    nics_per_node: int = 4
    intra_gbps: float = 300.0  # GB/s per GPU, one direction (NVLink)
    nic_gbps: float = 25.0  # GB/s per NIC, one direction (200 Gb/s InfiniBand)
    attention_tflops: float = 300.0  # sustained attention throughput per GPU


@dataclass(frozen=True)
class Workload:
    seq_length: int
    hidden: int
    heads: int
    kv_heads: int
    bytes_per_element: int = 2
    # packed documents (--reset-attention-mask): sample packs' document starts [S] each; empty
    # for plain causal attention
    documents: Tuple = ()
    # tensor-parallel size: a rank holds heads/tp query and kv_heads/tp KV heads, and the context
    # ranks of one tp position sit tp apart (the grid puts tp innermost)
    tp: int = 1

    def local_heads(self) -> Tuple[int, int]:
        """(query heads, KV heads) of one tensor-parallel rank."""
        return self.heads // self.tp, self.kv_heads // self.tp


def attention_fraction(work: Workload, ring: int) -> float:
    """The slowest ring position's attention work relative to plain causal attention's, on the
    workload's packed documents placed as the data loader places them (1.0 without documents).
    Blocks and pieces that meet no document are skipped, so compute shrinks. Communication is
    counted whole: a block travels only as far as its last reader (route.py), but under the
    balanced placement every position holds pieces of every document of 2R tokens or more, so one
    such document makes every block read -- only samples of shorter documents send less."""
    if not work.documents:
        return 1.0
    return _fraction(work.documents, ring)


@lru_cache(maxsize=None)
def _fraction(documents: Tuple, ring: int) -> float:
    total = 0.0
    for starts in documents:
        s = starts.numel()
        slowest = max(causal_work(starts, t) for t in balanced_ring_tokens(starts, ring))
        total += slowest * ring / (s * (s + 1) / 2)
    return total / len(documents)


@dataclass
class Plan:
    hp: int
    ring: int
    inner: int
    placement: str
    t_alltoall: float
    t_ring: float
    p2p_inner_crosses_nodes: bool
    p2p_outer_crosses_nodes: bool

    @property
    def total(self) -> float:
        return self.t_alltoall + self.t_ring


def _node(rank: int, cluster: Cluster) -> int:
    return rank // cluster.gpus_per_node


def _link_time(nbytes: float, pairs, cluster: Cluster) -> tuple:
    """Time of one step where every (sender, receiver) pair sends `nbytes`: intra-node pairs at
    NVLink speed, inter-node pairs sharing their node's NICs. The step waits for the slowest."""
    if not pairs:
        return 0.0, False
    crossing: dict = {}
    for a, b in pairs:
        if _node(a, cluster) != _node(b, cluster):
            crossing[_node(a, cluster)] = crossing.get(_node(a, cluster), 0) + 1
    if not crossing:
        return nbytes / (cluster.intra_gbps * 1e9), False
    flows = max(crossing.values())  # the busiest node's concurrent inter-node sends
    per_flow = cluster.nic_gbps * 1e9 * min(1.0, cluster.nics_per_node / flows)
    return nbytes / per_flow, True


def _ring_pairs(groups: List[List[int]]):
    return [(g[i], g[(i + 1) % len(g)]) for g in groups if len(g) > 1 for i in range(len(g))]


def evaluate(work: Workload, cluster: Cluster, hp: int, ring: int, inner: int, placement: str) -> Plan:
    d_sp = hp * ring
    grid = RankGrid(world_size=d_sp * work.tp, tp=work.tp, cp=d_sp, hp=hp, inner_ring=inner, placement=placement)
    q_heads, kv_heads = work.local_heads()
    split = split_heads(q_heads, kv_heads, hp)  # raises for illegal head splits
    kv_heads_after = max(kv_heads, hp) if split.kv_repeat > 1 else kv_heads
    tokens = work.seq_length / d_sp  # per rank, before the all-to-all
    head_dim = work.hidden / work.heads
    # computation per micro-step: the balanced causal block is half of (S/d_cp)^2 on the slowest
    # rank's heads (an uneven MHA split gives some ranks one head more), 4 FLOPs per (query, key,
    # channel) for QK^T and PV
    heads = max(split.q_counts)
    block = 0.5 * (work.seq_length / ring) ** 2 * heads * head_dim * 4 * attention_fraction(work, ring)
    t_fwd = block / (cluster.attention_tflops * 1e12)
    t_bwd = 3 * t_fwd
    kv_a2a = tokens * kv_heads_after * head_dim * work.bytes_per_element  # K or V of a rank
    kv_bytes = 2 * kv_a2a
    t_in, in_cross = _link_time(kv_bytes, _ring_pairs(grid.ring_groups("inner")), cluster)
    t_out, out_cross = _link_time(kv_bytes, _ring_pairs(grid.ring_groups("outer")), cluster)
    outer_steps = ring // inner
    step_b_fwd = max(t_fwd, t_out) if outer_steps > 1 else t_fwd
    step_b_bwd = max(t_bwd, 3 * t_out) if outer_steps > 1 else t_bwd
    inner_fwd, inner_bwd = max(t_fwd, t_in) * (inner - 1), max(t_bwd, 3 * t_in) * (inner - 1)
    # A (w - 1) + B per outer step (section 4.5.3); the forward's last outer step sends nothing on
    fwd = (inner_fwd + step_b_fwd) * (outer_steps - 1) + inner_fwd + t_fwd
    t_ring = fwd + (inner_bwd + step_b_bwd) * outer_steps
    t_a2a = 0.0
    if hp > 1:
        q_bytes = tokens * q_heads * head_dim * work.bytes_per_element
        volume = (2 * q_bytes + 2 * kv_a2a) * (hp - 1) / hp
        hp_groups = grid.groups_along(("hp",))
        intra = all(len({_node(r, cluster) for r in g}) == 1 for g in hp_groups)
        per_gpu_bw = cluster.intra_gbps if intra else cluster.nic_gbps * cluster.nics_per_node / cluster.gpus_per_node
        t_a2a = 2 * volume / (per_gpu_bw * 1e9)  # forward and backward
    return Plan(hp, ring, inner, placement, t_a2a, t_ring, in_cross, out_cross)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_plans(work: Workload, cluster: Cluster, d_sp: int, inner_rings: Optional[List[int]] = None) -> List[Plan]:
    """Every legal (hp, ring, inner ring, placement) for d_sp GPUs, fastest first."""
    plans = []
    for hp in _divisors(d_sp):
        ring = d_sp // hp
        try:
            split_heads(*work.local_heads(), hp)
        except ValueError:
            continue
        for inner in (inner_rings or _divisors(ring)):
            if ring % inner:
                continue
            for placement in PLACEMENTS:
                plans.append(evaluate(work, cluster, hp, ring, inner, placement))
    return sorted(plans, key=lambda p: p.total)
