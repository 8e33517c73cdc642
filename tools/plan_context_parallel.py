"""Rank 2D-attention layouts with LoongTrain's cost model (section 4.5) and print the table.

    python tools/plan_context_parallel.py --seq-length 131072 --hidden-size 4096 \
        --num-attention-heads 32 --num-query-groups 8 --context-parallel-size 64 \
        --gpus-per-node 8 --nics-per-node 4

Each row is a pretrain_gpt.py flag set: --context-parallel-size, --cp-comm-type a2a+p2p,
--hierarchical-context-parallel-sizes HP RING, --cp-inner-ring-size W, --cp-placement.
Times are one attention layer's forward + backward by the model, for comparing layouts.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.longseq.attention.cost_model import Cluster, Workload, rank_plans  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--num-query-groups", type=int, help="KV heads (default: MHA)")
    p.add_argument("--context-parallel-size", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nics-per-node", type=int, default=4)
    p.add_argument("--intra-node-gbps", type=float, default=300.0, help="GB/s per GPU (NVLink)")
    p.add_argument("--nic-gbps", type=float, default=25.0, help="GB/s per NIC")
    p.add_argument("--attention-tflops", type=float, default=300.0, help="sustained per GPU")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    work = Workload(args.seq_length, args.hidden_size, args.num_attention_heads,
                    args.num_query_groups or args.num_attention_heads)
    cluster = Cluster(args.gpus_per_node, args.nics_per_node, args.intra_node_gbps, args.nic_gbps,
                      args.attention_tflops)
    plans = rank_plans(work, cluster, args.context_parallel_size)
    if not plans:
        p.error("no legal layout: the heads do not split over any head-parallel size")
    print(f"S={work.seq_length} D={work.hidden} H={work.heads} H_kv={work.kv_heads} d_sp={args.context_parallel_size} "
          f"| {cluster.gpus_per_node} GPUs x {cluster.nics_per_node} NICs per node")
    print(f"{'rank':>4} {'hp':>4} {'ring':>5} {'inner':>5} {'placement':>13} {'alltoall ms':>12} "
          f"{'ring ms':>9} {'total ms':>9}  inter-node p2p")
    for i, plan in enumerate(plans[: args.top], 1):
        cross = ",".join(n for n, c in (("inner", plan.p2p_inner_crosses_nodes), ("outer", plan.p2p_outer_crosses_nodes)) if c) or "-"
        print(f"{i:>4} {plan.hp:>4} {plan.ring:>5} {plan.inner:>5} {plan.placement:>13} "
              f"{plan.t_alltoall * 1e3:>12.2f} {plan.t_ring * 1e3:>9.2f} {plan.total * 1e3:>9.2f}  {cross}")


if __name__ == "__main__":
    main()
