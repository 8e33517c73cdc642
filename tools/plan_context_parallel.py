r"""Rank 2D-attention layouts with LoongTrain's cost model (section 4.5) and print the table.

    python tools/plan_context_parallel.py --seq-length 131072 --hidden-size 4096 \
        --num-attention-heads 32 --num-query-groups 8 --context-parallel-size 64 \
        --gpus-per-node 8 --nics-per-node 4

Each row is a pretrain_gpt.py flag set: --context-parallel-size, --cp-comm-type a2a+p2p,
--hierarchical-context-parallel-sizes HP RING, --cp-inner-ring-size W, --cp-placement (with the
--tensor-model-parallel-size given here: it splits the heads and spaces the context ranks).
Times are one attention layer's forward + backward by the model, for comparing layouts.

Packed documents (--reset-attention-mask): --document-mean-length L draws sample packs of
log-normal document lengths; the layouts are then ranked on the work the documents leave, and
--document-balance prints how evenly each ring size's positions share it, this project's
placement against Megatron's chunks:

    python tools/plan_context_parallel.py --document-balance --seq-length 131072 \
        --document-mean-length 4096 --context-parallel-size 8 16
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.longseq.attention.cost_model import Cluster, Workload, attention_fraction, rank_plans  # noqa: E402
from megatron.longseq.attention.documents import (balanced_ring_tokens, lognormal_starts,  # noqa: E402
                                                   work_imbalance)
from megatron.longseq.attention.placement import ring_chunks  # noqa: E402
from tools import cli  # noqa: E402


def document_packs(args):
    """Sample packs of log-normal document lengths (empty without --document-mean-length)."""
    if args.document_mean_length is None:
        return ()
    g = torch.Generator().manual_seed(args.seed)
    return tuple(lognormal_starts(args.seq_length, args.document_mean_length, args.document_sigma, g)
                 for _ in range(args.document_samples))


def balance_table(packs, ring_sizes) -> str:
    """max / mean causal work per ring position, this project's placement vs Megatron's chunks."""
    lines = [f"{'ring':>5} {'ours mean':>10} {'ours worst':>11} {'megatron mean':>14} {'megatron worst':>15}"]
    for ring in ring_sizes:
        ours = [work_imbalance(s, balanced_ring_tokens(s, ring)) for s in packs]
        chunks = [work_imbalance(s, [ring_chunks(s.numel(), ring, j) for j in range(ring)]) for s in packs]
        lines.append(f"{ring:>5} {sum(ours) / len(ours):>10.4f} {max(ours):>11.4f} "
                     f"{sum(chunks) / len(chunks):>14.4f} {max(chunks):>15.4f}")
    return "\n".join(lines)


def _document_balance(p, args):
    if args.document_mean_length is None:
        p.error("--document-balance needs --document-mean-length")
    bad = [n for n in args.context_parallel_size if args.seq_length % (2 * n)]
    if bad:
        p.error(f"--seq-length {args.seq_length} is not divisible by 2 x ring size {bad[0]}")
    packs = document_packs(args)
    print(f"S={args.seq_length}, {len(packs)} packs of log-normal documents (mean {args.document_mean_length}, "
          f"sigma {args.document_sigma}, seed {args.seed}); max/mean attention work per ring position")
    print(balance_table(packs, args.context_parallel_size))


def arguments(argv):
    p = cli.parser(__doc__, allow_abbrev=False)
    p.add_argument("--seq-length", type=cli.positive_int, required=True, help="tokens per sample S")
    p.add_argument("--hidden-size", type=cli.positive_int, help="hidden size D (planning needs it)")
    p.add_argument("--num-attention-heads", type=cli.positive_int, help="query heads H (planning needs it)")
    p.add_argument("--num-query-groups", type=cli.positive_int, help="KV heads H_kv, dividing H (None: MHA)")
    p.add_argument("--tensor-model-parallel-size", type=cli.positive_int, default=1,
                   help="tp: each rank's share of the heads; the context ranks sit tp apart")
    p.add_argument("--context-parallel-size", type=cli.positive_int, nargs="+", required=True,
                   help="one size to plan; with --document-balance, every ring size to compare")
    p.add_argument("--gpus-per-node", type=cli.positive_int, default=8, help="GPUs per node")
    p.add_argument("--nics-per-node", type=cli.positive_int, default=4, help="network cards per node")
    p.add_argument("--intra-node-gbps", type=cli.positive_float, default=300.0, help="GB/s per GPU (NVLink)")
    p.add_argument("--nic-gbps", type=cli.positive_float, default=25.0, help="GB/s per NIC")
    p.add_argument("--attention-tflops", type=cli.positive_float, default=300.0, help="sustained per GPU")
    p.add_argument("--top", type=cli.positive_int, default=15, help="rows of the table")
    p.add_argument("--document-mean-length", type=cli.positive_float, help="packed documents of this mean length")
    p.add_argument("--document-sigma", type=cli.nonnegative_float, default=1.0,
                   help="log-normal shape of the lengths")
    p.add_argument("--document-samples", type=cli.positive_int, default=64, help="sample packs drawn")
    p.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    p.add_argument("--document-balance", action="store_true", help="print the placement balance table only")
    return p, p.parse_args(argv)


def _planning_refusal(args):
    """Why the flags name no layout to plan (None if they do), before any planning."""
    if args.hidden_size is None or args.num_attention_heads is None or len(args.context_parallel_size) != 1:
        return "planning needs --hidden-size, --num-attention-heads and one --context-parallel-size"
    heads, groups, cp = args.num_attention_heads, args.num_query_groups, args.context_parallel_size[0]
    if groups is not None and heads % groups:
        return f"--num-query-groups {groups} does not divide --num-attention-heads {heads}"
    if args.hidden_size % heads:  # the trainer's rule without --kv-channels: head size = hidden / heads
        return f"--num-attention-heads {heads} does not divide --hidden-size {args.hidden_size}"
    tp = args.tensor_model_parallel_size
    for name, count in (("--num-attention-heads", heads), ("--num-query-groups", groups or heads)):
        if count % tp:  # as the trainer: each tensor-parallel rank holds whole heads and groups
            return f"{name} {count} is not divisible by --tensor-model-parallel-size {tp}"
    granularity = 2 * cp if cp > 1 else 1  # the load-balanced ring's two chunks per position, as the trainer's
    if args.seq_length % granularity:
        return f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp}"
    return None


def main(argv=None):
    p, args = arguments(argv)
    if args.document_balance:
        return _document_balance(p, args)
    refusal = _planning_refusal(args)
    if refusal:
        p.error(refusal)
    args.context_parallel_size = args.context_parallel_size[0]
    kv_heads = args.num_attention_heads if args.num_query_groups is None else args.num_query_groups
    work = Workload(args.seq_length, args.hidden_size, args.num_attention_heads, kv_heads,
                    documents=document_packs(args), tp=args.tensor_model_parallel_size)
    cluster = Cluster(args.gpus_per_node, args.nics_per_node, args.intra_node_gbps, args.nic_gbps,
                      args.attention_tflops)
    plans = rank_plans(work, cluster, args.context_parallel_size)
    if not plans:  # head parallelism 1 always splits once the groups divide the heads: a safeguard
        raise cli.ToolError("no legal layout: the heads do not split over any head-parallel size")
    print(f"S={work.seq_length} D={work.hidden} H={work.heads} H_kv={work.kv_heads} d_sp={args.context_parallel_size} "
          f"tp={work.tp} | {cluster.gpus_per_node} GPUs x {cluster.nics_per_node} NICs per node")
    if work.documents:
        print(f"packed documents (mean {args.document_mean_length:g}): attention work left at ring "
              f"{args.context_parallel_size}: {attention_fraction(work, args.context_parallel_size):.3f} of causal")
    print(f"{'rank':>4} {'hp':>4} {'ring':>5} {'inner':>5} {'placement':>13} {'alltoall ms':>12} "
          f"{'ring ms':>9} {'total ms':>9}  inter-node p2p")
    for i, plan in enumerate(plans[: args.top], 1):
        crossing = (("inner", plan.p2p_inner_crosses_nodes), ("outer", plan.p2p_outer_crosses_nodes))
        cross = ",".join(n for n, c in crossing if c) or "-"
        print(f"{i:>4} {plan.hp:>4} {plan.ring:>5} {plan.inner:>5} {plan.placement:>13} "
              f"{plan.t_alltoall * 1e3:>12.2f} {plan.t_ring * 1e3:>9.2f} {plan.total * 1e3:>9.2f}  {cross}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
