"""Simulate pipeline schedules: timeline PNG, bubble ratio and peak activation per stage.

    # one configuration, against 1F1B, with a Figure-1 style timeline
    python tools/pipeline_simulator.py --pipeline-size 4 --micro-batches 8 --splits 4 --png seq1f1b.png
    # the paper's Table 1 configurations: bubble ratios of 1F1B, 1F1B-I, Seq1F1B and Seq1F1B-I
    python tools/pipeline_simulator.py --paper-table
    # packed documents: static uniform_comp segments vs each micro-batch's own
    python tools/pipeline_simulator.py --documents 4096 --seq-length 131072
    # a timeline recorded by pretrain_gpt.py --pipeline-timeline DIR (one file per rank)
    python tools/pipeline_simulator.py --from-run DIR --png real.png

Costs: a segment's forward costs its Eq. 8 FLOPs (Seq1F1B section 3.5; the model from --num-layers,
--hidden-size, --seq-length), its backward twice that; time is counted in forwards of one
micro-batch on the whole model (a stage's share of one is 1/P). Activation memory is proportional
to its tokens, in units of one micro-batch on one stage.
"""
from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.longseq.attention.documents import lognormal_starts  # noqa: E402
from megatron.longseq.pipeline.partition import (DocumentCost, PartitionError, document_partition,  # noqa: E402
                                                 partition, segment_costs, segment_flops)
from megatron.longseq.pipeline.plan import ScheduleError, all_schedules, check  # noqa: E402
from megatron.longseq.pipeline.simulate import Timeline, simulate  # noqa: E402
from tools import cli  # noqa: E402

# Seq1F1B Table 1: (name, layers, hidden, sequence lengths, PP, micro-batches)
PAPER = [
    ("2.7B", 32, 2560, (16384, 24576, 32768), 8, (32, 64)),
    ("7B", 32, 4096, (32768, 65536, 131072), 4, (16, 32)),
    ("13B", 40, 5120, (32768, 65536, 131072), 4, (16, 32)),
    ("30B", 64, 6144, (32768, 49152, 65536), 8, (32, 64)),
]


def params(layers: int, hidden: int, vocab: int = 50257) -> int:
    return 12 * layers * hidden * hidden + vocab * hidden


def run(p, m, k, v, seq, layers, hidden, strategy) -> Timeline:
    lengths = partition(seq, k, strategy, 1, params(layers, hidden), layers, hidden)
    flops = segment_flops(lengths, params(layers, hidden), layers, hidden)
    unit = sum(flops)  # one micro-batch's forward on the whole model
    return simulate(all_schedules(p, m, k, v), v, k,
                    forward_cost=lambda u: flops[u[1]] / unit / (p * v),
                    activation=lambda u: lengths[u[1]] / seq / v)


def packed(p, m, k, seq, layers, hidden, mean: float, seed: int = 0):
    """Micro-batches of log-normal documents (mean `mean`, sigma 1): the timelines of the static
    uniform_comp segments and of each micro-batch's own (document_partition), costed by Eq. 8
    within documents. Time unit: one micro-batch's forward on the whole model (the static
    segments' average, for both)."""
    g = torch.Generator().manual_seed(seed)
    model = (params(layers, hidden), layers, hidden)
    static = partition(seq, k, "uniform_comp", 1, *model)
    batches = [DocumentCost(lognormal_starts(seq, mean, 1.0, g)[None], *model) for _ in range(m)]
    plans = {"static": [static] * m, "per micro-batch": [document_partition(c.starts, k, *model, 1, max(static))
                                                          for c in batches]}
    unit = sum(sum(segment_costs(c, static)) for c in batches) / m  # one unit for both
    out = {}
    for name, lengths in plans.items():
        costs = [segment_costs(c, n) for c, n in zip(batches, lengths)]
        out[name] = simulate(all_schedules(p, m, k, 1), 1, k, forward_cost=lambda u: costs[u[0]][u[1]] / unit / p,
                             activation=lambda u: lengths[u[0]][u[1]] / seq)
    return out


def paper_table() -> str:
    rows = ["Bubble ratio (idle share of each stage's time, 0-1) simulated for Table 1's settings: Seq1F1B "
            "with k = 4 segments, interleaving with v = 2 chunks, backward = 2 x forward, Eq. 8 costs, no link "
            "latency (the paper prints no such table; its Tables 2-5 measure other micro-batch counts).",
            "| model | seq | PP | micro-batches | 1F1B | 1F1B-I | Seq1F1B w/o cwp | Seq1F1B | Seq1F1B-I |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, layers, hidden, seqs, p, mbs in PAPER:
        for seq in seqs:
            for m in mbs:
                b = [run(p, m, 1, 1, seq, layers, hidden, "average").bubble_ratio,
                     run(p, m, 1, 2, seq, layers, hidden, "average").bubble_ratio,
                     run(p, m, 4, 1, seq, layers, hidden, "average").bubble_ratio,
                     run(p, m, 4, 1, seq, layers, hidden, "uniform_comp").bubble_ratio,
                     run(p, m, 4, 2, seq, layers, hidden, "uniform_comp").bubble_ratio]
                rows.append(f"| {name} | {seq // 1024}K | {p} | {m} | " + " | ".join(f"{x:.3f}" for x in b) + " |")
    return "\n".join(rows)


def plot(events, p, path, title, time_unit):
    """events: (rank, label, start, end, is_forward, micro_batch); time_unit names the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 0.6 * p + 1.2))
    colors = plt.get_cmap("tab20").colors
    t0 = min(e[2] for e in events)
    for rank, label, start, end, forward, mb in events:
        color = colors[(2 * mb) % 20] if forward else colors[(2 * mb + 1) % 20]
        ax.broken_barh([(start - t0, end - start)], (p - 1 - rank - 0.4, 0.8), facecolors=color,
                       edgecolor="black", linewidth=0.3)
        if end - start > 0:
            ax.text((start + end) / 2 - t0, p - 1 - rank, label, ha="center", va="center", fontsize=5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - i}" for i in range(p)])
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(facecolor=colors[0], edgecolor="black", label="forward (a colour per micro-batch)"),
                       Patch(facecolor=colors[1], edgecolor="black", label="backward (its lighter shade)")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, title="box label: micro-batch.segment",
              title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def simulated_events(t: Timeline):
    return [(e.rank, f"{e.op.unit[0]}.{e.op.unit[1]}", e.start, e.end, e.op.kind == "F", e.op.unit[0])
            for e in t.events]


def recorded_events(directory):
    """pretrain_gpt.py --pipeline-timeline DIR writes rank_<r>.json: {stage, stages, events:
    [[op, start, end], ...]}. Returns (events, stage count); files of runs with other stage counts
    in the same directory are refused, not mixed in."""
    events, counts = [], {}
    for path in sorted(glob.glob(os.path.join(directory, "rank_*.json"))):
        try:
            with open(path) as f:
                blob = json.load(f)
            stage, counts[os.path.basename(path)] = blob["stage"], blob["stages"]
            for op, start, end in blob["events"]:
                kind, rest = op[0], op[1:].split(":")[1]
                mb, seg = (int(x) for x in rest.split("."))
                events.append((stage, f"{mb}.{seg}", start, end, kind == "F", mb))
        except (ValueError, KeyError, TypeError, IndexError) as err:  # JSON's errors are ValueErrors
            raise cli.ToolError(f"--from-run {path}: not a recorded timeline ({type(err).__name__}: {err})") from None
    if len(set(counts.values())) > 1:
        runs = ", ".join(f"{name}: {n} stages" for name, n in counts.items())
        raise cli.ToolError(f"--from-run {directory}: files of runs with different stage counts ({runs}): "
                            "record into an empty directory")
    return events, next(iter(counts.values()), 0)


def arguments(argv):
    ap = cli.parser(__doc__)
    ap.add_argument("--pipeline-size", type=cli.positive_int, default=4, help="pipeline stages P")
    ap.add_argument("--micro-batches", type=cli.positive_int, default=8, help="micro-batches m per iteration")
    ap.add_argument("--splits", type=cli.positive_int, default=4, help="Seq1F1B sequence segments k")
    ap.add_argument("--chunks", type=cli.positive_int, default=1, help="model chunks per stage v (interleaving)")
    ap.add_argument("--strategy", choices=["average", "uniform_comp"], default="uniform_comp",
                    help="how the sequence is cut into segments")
    ap.add_argument("--num-layers", type=cli.positive_int, default=32, help="layers of the costed model")
    ap.add_argument("--hidden-size", type=cli.positive_int, default=4096, help="hidden size of the costed model")
    ap.add_argument("--seq-length", type=cli.positive_int, default=32768, help="tokens per micro-batch")
    ap.add_argument("--documents", type=cli.positive_float, metavar="MEAN",
                    help="packed samples of log-normal documents of this mean length: static vs per-micro-batch "
                         "uniform_comp segments (Seq1F1B, no interleaving)")
    ap.add_argument("--png", type=cli.image_path, help="write the timeline here")
    ap.add_argument("--paper-table", action="store_true", help="print the Table 1 bubble ratios and stop")
    ap.add_argument("--from-run", help="directory of a recorded timeline")
    args = ap.parse_args(argv)
    refusal = ignored(ap, args) or refused(args)
    if refusal:
        ap.error(refusal)
    return ap, args


# What each mode reads besides its own flag: any other flag given would be silently ignored
# (--documents refuses --chunks and --png itself, with its reason)
MODE_READS = {"paper_table": (), "from_run": ("png",),
              "documents": ("pipeline_size", "micro_batches", "splits", "seq_length", "num_layers", "hidden_size",
                            "chunks", "png")}


def ignored(ap, args):
    """A flag the chosen mode would not read, named (None if every flag given is read)."""
    for mode, reads in MODE_READS.items():
        if getattr(args, mode) not in (None, False):
            unread = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                      if name != mode and name not in reads and value != ap.get_default(name)]
            if unread:
                return f"--{mode.replace('_', '-')} does not read {', '.join(unread)}: leave it out"
    return None


def refused(args):
    """Why the sizes cannot be simulated (None if they can): said before any work, in the tool's
    own flag names where the library would name the trainer's."""
    p, m, k, v = args.pipeline_size, args.micro_batches, args.splits, args.chunks
    if k > args.seq_length:
        return f"--splits {k} does not fit --seq-length {args.seq_length}: at most one segment per token"
    if args.documents is not None and v != 1:
        return f"--documents runs without interleaving: leave out --chunks {v}"
    if args.documents is not None and args.png:
        return "--documents prints a table and draws no timeline: leave out --png"
    if v > 1 and p == 1:  # pretrain_gpt.py refuses it (as Megatron does): no rows for a layout that cannot run
        return f"an interleaved schedule (--chunks {v}) needs --pipeline-size > 1"
    # the table compares against the baseline of one segment: it has to run too
    for splits, what in ((k, ""), (1, f"the baseline 1F1B{'-I' if v > 1 else ''} (--splits 1): ")):
        try:
            check(p, m, splits, v)
        except ScheduleError as err:
            return f"{what}{err}"
    return None


def from_run(ap, args):
    try:
        events, p = recorded_events(args.from_run)
    except cli.ToolError as err:
        ap.error(str(err))
    if not events:
        ap.error(f"--from-run {args.from_run}: no rank_*.json timeline there (record one with "
                 "pretrain_gpt.py --pipeline-timeline DIR)")
    busy = sum(e[3] - e[2] for e in events)
    span = max(e[3] for e in events) - min(e[2] for e in events)
    print(f"recorded run: {p} stages, {len(events)} operations, bubble ratio {1 - busy / (p * span):.3f}")
    if args.png:
        plot(events, p, args.png, f"recorded timeline ({args.from_run})", "s, wall clock")


def documents(args):
    p, m, k = args.pipeline_size, args.micro_batches, args.splits
    print(f"P={p} m={m} k={k} seq={args.seq_length} L={args.num_layers} h={args.hidden_size}, "
          f"log-normal documents of mean {args.documents:g} tokens")
    print(f"{'uniform_comp':>16} {'time':>8} {'bubble':>8}  (time: micro-batch forwards on the whole model)")
    for label, t in packed(p, m, k, args.seq_length, args.num_layers, args.hidden_size, args.documents).items():
        print(f"{label:>16} {t.makespan:>8.3f} {t.bubble_ratio:>8.3f}")


def main(argv=None):
    ap, args = arguments(argv)
    if args.paper_table:
        print(paper_table())
        return
    if args.from_run:
        return from_run(ap, args)
    if args.documents is not None:
        return documents(args)
    p, m, k, v = args.pipeline_size, args.micro_batches, args.splits, args.chunks
    base = run(p, m, 1, v, args.seq_length, args.num_layers, args.hidden_size, "average")
    seq = run(p, m, k, v, args.seq_length, args.num_layers, args.hidden_size, args.strategy)
    name = "Seq1F1B" + ("-I" if v > 1 else "")
    print(f"P={p} m={m} v={v} seq={args.seq_length} L={args.num_layers} h={args.hidden_size}")
    print(f"{'schedule':>16} {'bubble':>8}  peak activation per stage (micro-batches)")
    for label, t in ((("1F1B" + ("-I" if v > 1 else "")), base), (f"{name} k={k}", seq)):
        print(f"{label:>16} {t.bubble_ratio:>8.3f}  " + " ".join(f"{a:.2f}" for a in t.peak_activation))
    if args.png:
        plot(simulated_events(seq), p, args.png, f"{name}: P={p}, m={m}, k={k}, v={v} ({args.strategy})",
             "one micro-batch's forward on the whole model")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    sys.exit(cli.run(main, errors=(ScheduleError, PartitionError)))
