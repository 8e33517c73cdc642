"""The functional-test table: flag combinations, how many ranks, and which golden curve they must
reproduce. A case whose `golden` is its own name defines that curve (single rank); every other case
must land on a curve defined by a single-rank case.

Golden files (tests/functional_tests/golden/<name>.json) use Megatron-LM's format and metric set:
  {"lm loss": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {"1": ..., ...}},
   "num-zeros": ..., "mem-allocated-bytes": ..., "mem-max-allocated-bytes": ...,
   "iteration-time": {"start_step": 1, ..., "values": {"1": "nan", "2": ...}}}
read from the run's tensorboard scalars and rounded to 5 decimals, as Megatron's harness does.
Regenerate them with `python -m tests.functional_tests.run --generate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

TRAIN_ITERS = 30

# A tiny GPT: enough layers and steps for the loss to move by ~10% (so a wrong gradient shows),
# small enough for four gloo ranks on two cores. gloo also on a GPU machine: the golden curves are
# CPU runs, and there nccl would put every rank on the one GPU.
COMMON = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {TRAIN_ITERS} --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 3 "
    "--weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --seed 1234 "
    "--log-interval 1 --eval-iters 0 --num-workers 0 --distributed-backend gloo"
).split()

LLAMA = ("--group-query-attention --num-query-groups 2 --position-embedding-type rope --swiglu "
         "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear").split()

LAYERS_4 = "--num-layers 4".split()
DOCUMENTS = "--reset-position-ids --reset-attention-mask --eod-mask-loss".split()
SEQ_512 = "--position-embedding-type rope --seq-length 512 --max-position-embeddings 512".split()


@dataclass
class Case:
    name: str
    nproc: int
    flags: List[str] = field(default_factory=list)
    golden: str = ""  # defaults to the case's own name
    data: bool = False  # train on the indexed corpus made by the test fixture instead of mock data

    @property
    def golden_name(self) -> str:
        return self.golden or self.name


CASES = [
    Case("gpt_base", 1),
    Case("gpt_base_tp2", 2, ["--tensor-model-parallel-size", "2"], "gpt_base"),
    Case("gpt_base_dp2", 2, [], "gpt_base"),
    Case("gpt_base_dp2_distopt_overlap", 2,
         "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 20000".split(),
         "gpt_base"),
    Case("gpt_base_dp4_distopt_2_instances", 4, "--use-distributed-optimizer --num-distributed-optimizer-instances 2 "
         "--overlap-grad-reduce --ddp-bucket-size 20000".split(), "gpt_base"),
    Case("gpt_base_dp2_per_token_loss", 2, ["--calculate-per-token-loss"], "gpt_base"),
    Case("gpt_base_recompute_full_uniform", 1,
         "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2".split(), "gpt_base"),
    Case("gpt_llama", 1, LLAMA),
    Case("gpt_llama_tp2_dp2_distopt", 4,
         LLAMA + "--tensor-model-parallel-size 2 --use-distributed-optimizer".split(), "gpt_llama"),
    Case("gpt_llama_bf16", 1, LLAMA + ["--bf16"]),
    # fp16 at a static loss scale: with dynamic scaling the step that overflows depends on each
    # rank's micro-batches, so layouts could not share a curve
    Case("gpt_llama_fp16", 1, LLAMA + "--fp16 --loss-scale 4096".split()),
    Case("gpt_llama_fp16_pp2_dp2_distopt", 4, LLAMA + (
        "--fp16 --loss-scale 4096 --pipeline-model-parallel-size 2 --use-distributed-optimizer").split(),
         "gpt_llama_fp16"),
    # Context parallelism: Ulysses, Double-Ring and 2D attention, with TP and with Selective
    # Checkpoint++, on the single-rank curves (the plain ring: gpt_llama_pp2_cp2_seq1f1b_k2 and
    # gpt_documents_cp2_ring).
    Case("gpt_llama_cp4_2d_context_first_selective_checkpoint_pp", 4, LLAMA + (
        "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 "
        "--cp-placement context-first --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --selective-checkpoint-pp").split(), "gpt_llama"),
    Case("gpt_llama_cp4_double_ring", 4, LLAMA + (
        "--context-parallel-size 4 --cp-comm-type p2p --cp-inner-ring-size 2").split(), "gpt_llama"),
    Case("gpt_llama_tp2_cp2_ulysses_kv_replicated", 4, LLAMA + (
        "--tensor-model-parallel-size 2 --context-parallel-size 2 --cp-comm-type a2a").split(), "gpt_llama"),
    # Pipelines: 1F1B and Seq1F1B, interleaved, with TP and CP, on the single-rank curves.
    Case("gpt_base_pp2_1f1b", 2, "--pipeline-model-parallel-size 2".split(), "gpt_base"),
    Case("gpt_base_pp2_seq1f1b_k4", 2, "--pipeline-model-parallel-size 2 --pipe-sp-splits 4".split(), "gpt_base"),
    # 2 layers + the embedding and the loss counted as layers: 4 chunks of one, 2 per stage
    Case("gpt_llama_pp2_vp2_seq1f1b_k2_uniform_comp", 2, LLAMA + (
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --pipe-sp-splits 2 "
        "--pipe-sp-strategy uniform_comp").split(), "gpt_llama"),
    Case("gpt_llama_pp2_tp2_seq1f1b_k2", 4, LLAMA + (
        "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --pipe-sp-splits 2").split(), "gpt_llama"),
    Case("gpt_llama_pp2_cp2_seq1f1b_k2", 4, LLAMA + (
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --pipe-sp-splits 2").split(), "gpt_llama"),
    # Sequence parallelism (a GPU flag; its CPU run points megatron-core's buffers at host memory,
    # sequence_parallel_on_host.py) through a Seq1F1B pipeline.
    Case("gpt_llama_tp2_pp2_seq1f1b_k2_sequence_parallel", 4, LLAMA + (
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
        "--pipe-sp-splits 2").split(), "gpt_llama"),
    # The output layer and the loss 100 tokens at a time (of 256 per micro-batch), vocabulary-parallel
    # on the last pipeline stage.
    Case("gpt_llama_tp2_pp2_cross_entropy_chunks", 4, LLAMA + (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --cross-entropy-chunk-tokens 100").split(),
         "gpt_llama"),
    # MEMO: token-wise swap/recompute, alone, with context parallelism and with a Seq1F1B pipeline.
    # Four layers: the model's last two keep their activations, so MEMO manages the first two (the
    # pipelined case manages stage 0's layer).
    Case("gpt_llama_4_layers", 1, LLAMA + LAYERS_4),
    Case("gpt_llama_memo_alpha_half", 1, LLAMA + LAYERS_4 + (
        "--memo --memo-swap-fraction 0.5 --memo-planner cpsat").split(), "gpt_llama_4_layers"),
    Case("gpt_llama_cp2_ulysses_memo_auto", 2, LLAMA + LAYERS_4 + (
        "--context-parallel-size 2 --cp-comm-type a2a --memo --memo-planner greedy").split(), "gpt_llama_4_layers"),
    Case("gpt_llama_pp2_seq1f1b_k2_memo_quarter", 2, LLAMA + (
        "--pipeline-model-parallel-size 2 --pipe-sp-splits 2 --memo --memo-swap-fraction 0.25 "
        "--memo-planner greedy").split(), "gpt_llama"),
    Case("gpt_dropout", 1, "--hidden-dropout 0.1 --attention-dropout 0.1".split()),
    Case("gpt_dropout_recompute", 1, "--hidden-dropout 0.1 --attention-dropout 0.1 --recompute-granularity "
         "full --recompute-method block --recompute-num-layers 1".split(), "gpt_dropout"),
    Case("gpt_documents", 1, DOCUMENTS + ["--position-embedding-type", "rope"], data=True),
    # Packed documents under every context-parallel mode and Seq1F1B, on the one-rank curve.
    Case("gpt_documents_cp2_ring", 2, DOCUMENTS + (
        "--position-embedding-type rope --context-parallel-size 2 --cp-comm-type p2p").split(),
        "gpt_documents", data=True),
    Case("gpt_documents_cp2_ulysses", 2, DOCUMENTS + (
        "--position-embedding-type rope --context-parallel-size 2 --cp-comm-type a2a").split(),
        "gpt_documents", data=True),
    # head-first here, context-first in gpt_llama_cp4_2d_context_first_selective_checkpoint_pp
    Case("gpt_documents_cp4_2d_head_first", 4, DOCUMENTS + (
        "--position-embedding-type rope --context-parallel-size 4 --cp-comm-type a2a+p2p "
        "--hierarchical-context-parallel-sizes 2 2 --cp-placement head-first").split(), "gpt_documents", data=True),
    Case("gpt_documents_pp2_cp2_seq1f1b_k2", 4, DOCUMENTS + (
        "--position-embedding-type rope --pipeline-model-parallel-size 2 --context-parallel-size 2 "
        "--pipe-sp-splits 2").split(), "gpt_documents", data=True),
    # Each micro-batch's segments chosen by its documents' FLOPs (partition.document_partition): at
    # 512 tokens attention is ~30% of this model's Eq.-8 cost, so they move (252/260, 256/256, ...
    # where the static uniform_comp is 276/236) -- under MEMO too, whose buffers the static
    # partition's longest segment sizes.
    Case("gpt_documents_512", 1, DOCUMENTS + SEQ_512, data=True),
    Case("gpt_documents_pp2_cp2_seq1f1b_k2_uniform_comp_memo", 4, DOCUMENTS + SEQ_512 + (
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --pipe-sp-splits 2 "
        "--pipe-sp-strategy uniform_comp --memo --memo-swap-fraction 0.5 --memo-planner greedy").split(),
         "gpt_documents_512", data=True),
    Case("gpt_documents_512_cp4_double_ring_seq1f1b_k2", 4, DOCUMENTS + SEQ_512 + (
        "--context-parallel-size 4 --cp-inner-ring-size 2 --pipe-sp-splits 2 "
        "--pipe-sp-strategy uniform_comp").split(), "gpt_documents_512", data=True),
    # Context and data parallel together; bf16 beyond one rank (half-precision shards of the
    # distributed optimizer, bf16 activations between stages); MEMO under tensor parallelism.
    Case("gpt_llama_cp2_dp2_distopt_overlap", 4, LLAMA + (
        "--context-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--ddp-bucket-size 20000").split(), "gpt_llama"),
    Case("gpt_llama_bf16_dp2_distopt_overlap", 2, LLAMA + (
        "--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--ddp-bucket-size 20000").split(), "gpt_llama_bf16"),
    Case("gpt_llama_bf16_pp2", 2, LLAMA + "--bf16 --pipeline-model-parallel-size 2".split(), "gpt_llama_bf16"),
    Case("gpt_llama_tp2_memo_auto", 2, LLAMA + LAYERS_4 + "--tensor-model-parallel-size 2 --memo --memo-planner "
         "greedy".split(), "gpt_llama_4_layers"),
    # MEMO's set-up iterations fire the overlapped buckets' hooks too
    Case("gpt_llama_dp2_distopt_overlap_memo_auto", 2, LLAMA + LAYERS_4 + (
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 20000 "
        "--memo --memo-planner greedy").split(), "gpt_llama_4_layers"),
    # learned absolute positions (every other cp case has RoPE) on load-balanced ring chunks
    Case("gpt_base_cp2_ring", 2, "--context-parallel-size 2 --cp-comm-type p2p".split(), "gpt_base"),
]

BY_NAME = {c.name: c for c in CASES}
