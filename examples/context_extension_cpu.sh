#!/usr/bin/env bash
# Context extension on CPU: the path a user takes with a pretrained model, in miniature.
#   1. train a small Llama-layout model at 512 tokens on passkey retrieval, the key anywhere in
#      the sequence (--passkey-depth 1), and export it to Hugging Face safetensors;
#   2. extend it to 4096 tokens: --finetune from that checkpoint under context parallelism 4
#      (2D attention: head-parallel 2 x ring 2) with the RoPE base raised 4x, and export it;
#   3. score retrieval at 512 .. 4096 tokens with transformers: the original, the original with
#      a RoPE change and no training (base x4; positions interpolated x8), and the extended model
#      (tools/passkey_eval.py).
# About half an hour on two cores.   bash examples/context_extension_cpu.sh [work dir]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/context_extension}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PORT=${MASTER_PORT:-29511}
MODEL="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
       --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
       --position-embedding-type rope"
DATA="--passkey-data --passkey-depth 1 --tokenizer-type NullTokenizer --vocab-size 256 --num-workers 0"
COMMON="--weight-decay 0.0 --hidden-dropout 0 --attention-dropout 0 --lr-decay-style cosine --log-interval 25
        --eval-iters 4 --ckpt-format torch"
mkdir -p "$WORK"

# 1. 512 tokens, data parallel 2
torchrun --nproc-per-node 2 --master-port "$PORT" pretrain_gpt.py $MODEL $DATA $COMMON \
    --seq-length 512 --max-position-embeddings 512 --micro-batch-size 8 --global-batch-size 32 --train-iters 400 \
    --lr 1.5e-3 --min-lr 1.5e-4 --lr-warmup-iters 20 --eval-interval 200 --save "$WORK/ckpt-512"
python tools/checkpoint/convert.py --loader megatron --saver hf --load-dir "$WORK/ckpt-512" --save-dir "$WORK/hf-512"

# 2. 4096 tokens, context parallel 4; --finetune: the model only, a fresh optimizer at iteration 0
torchrun --nproc-per-node 4 --master-port "$PORT" pretrain_gpt.py $MODEL $DATA $COMMON \
    --seq-length 4096 --max-position-embeddings 4096 --rotary-base 40000 \
    --context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 \
    --micro-batch-size 2 --global-batch-size 8 --train-iters 150 \
    --lr 5e-4 --min-lr 5e-5 --lr-warmup-iters 10 --eval-interval 150 --log-interval 10 \
    --load "$WORK/ckpt-512" --finetune --save "$WORK/ckpt-4k"
python tools/checkpoint/convert.py --loader megatron --saver hf --load-dir "$WORK/ckpt-4k" --save-dir "$WORK/hf-4k"

# 3. the table
python tools/passkey_eval.py --vocab-size 256 --depth 1 --lengths 512 1024 2048 4096 --samples 128 \
    --model "trained at 512" "$WORK/hf-512" \
    --model "trained at 512, RoPE base x4, no training" "$WORK/hf-512" base:40000 \
    --model "trained at 512, positions interpolated x8, no training" "$WORK/hf-512" linear:8 \
    --model "extended: 150 iterations at 4096, CP 4, RoPE base x4" "$WORK/hf-4k" \
    | tee "$WORK/passkey_table.md"
