#!/usr/bin/env bash
# GPT-3 1.3B-shaped model on one node of GPUs: bf16, NCCL, distributed optimizer, overlapped
# gradient reduction, flash attention through the fastest kernel present.
#   DATA=/data/corpus_text_document VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt \
#       bash examples/gpt_1node_gpu.sh [extra flags]
# Without DATA it trains on mock data. ITERS (1000) and WARMUP (100) set the schedule's length; CKPT
# the checkpoint directory it saves to and resumes from (CKPT=none: no checkpoints, e.g. a short
# timing run; a second run with the same CKPT resumes where the first one ended). SEQ (8192) is
# the sequence length, TB (runs/gpt-1.3b) the TensorBoard directory, GPUS (every visible one) the
# ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
# One hardware queue: a tensor-parallel all-gather / reduce-scatter launched before the GEMM it
# overlaps is scheduled first (megatron-core's advice for tp > 1 and sequence parallel)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# the GPUs this process may use (nvidia-smi -L ignores CUDA_VISIBLE_DEVICES and lists MIG slices)
GPUS=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
if [ "$GPUS" -lt 1 ]; then
    echo "gpt_1node_gpu.sh: no CUDA device visible to torch (examples/quickstart.sh runs on CPU)" >&2
    exit 2
fi
SEQ=${SEQ:-8192}
ITERS=${ITERS:-1000}
WARMUP=${WARMUP:-$((ITERS / 10))}
CKPT=${CKPT:-checkpoints/gpt-1.3b}
CKPT_ARGS=(--save "$CKPT" --load "$CKPT" --save-interval 500)
if [ "$CKPT" = none ]; then CKPT_ARGS=(); fi
if [ -n "${DATA:-}" ]; then
    DATA_ARGS=(--data-path "$DATA" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
# --standalone: a rendezvous on a free port of its own, so two jobs can share a node
exec torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --position-embedding-type rope \
    --micro-batch-size 1 --global-batch-size $((GPUS * 8)) \
    --train-iters "$ITERS" --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce \
    "${DATA_ARGS[@]}" \
    --log-interval 10 --log-throughput --eval-interval 500 --eval-iters 10 \
    "${CKPT_ARGS[@]}" \
    --tensorboard-dir "${TB:-runs/gpt-1.3b}" \
    "$@"
