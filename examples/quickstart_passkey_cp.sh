#!/usr/bin/env bash
# Long-range learning under context parallelism on CPU: passkey retrieval (a key planted in the
# first quarter, asked at the end) with 2D attention over 4 ranks -- head-parallel 2 x ring 2,
# context-first placement. The answer loss starts near ln(384) = 5.95 (any of the padded vocabulary's
# rows: 256 ids and the end-of-document one, padded to a multiple of 128), comes down to
# chance, ln(10) = 2.30, once the model knows the key is one of ten tokens, and falls well below it
# only because every query attends over the whole sequence across the ranks. A few minutes on two
# cores.
#   bash examples/quickstart_passkey_cp.sh [extra pretrain_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --nproc-per-node 4 --master-port "${MASTER_PORT:-29501}" pretrain_gpt.py \
    --context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 \
    --cp-placement context-first \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
    --position-embedding-type rope --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size 8 --global-batch-size 32 \
    --train-iters 300 --lr 1.5e-3 --min-lr 1.5e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.0 --hidden-dropout 0 --attention-dropout 0 \
    --passkey-data --tokenizer-type NullTokenizer --vocab-size 256 \
    --log-interval 25 --eval-interval 150 --eval-iters 4 --log-throughput --num-workers 0 \
    "$@"
