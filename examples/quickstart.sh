#!/usr/bin/env bash
# A small GPT trained on CPU: 4 ranks under torchrun (tensor parallel 2 x data parallel 2), gloo,
# mock data, Megatron's log format (about a minute on two cores); then passkey retrieval under 2D
# context parallelism (examples/quickstart_passkey_cp.sh, a few minutes). QUICKSTART=tpdp or
# QUICKSTART=passkey runs one of the two.
#   bash examples/quickstart.sh [extra pretrain_gpt.py flags for the first run]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "${QUICKSTART:-all}" != passkey ]; then
    torchrun --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py \
        --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 128 --num-attention-heads 8 \
        --group-query-attention --num-query-groups 2 \
        --position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear \
        --seq-length 256 --max-position-embeddings 256 \
        --micro-batch-size 4 --global-batch-size 16 \
        --train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
        --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 2048 \
        --log-interval 5 --eval-interval 30 --eval-iters 2 --log-throughput --num-workers 0 \
        "$@"
fi
if [ "${QUICKSTART:-all}" != tpdp ]; then
    bash examples/quickstart_passkey_cp.sh
fi
