#!/bin/bash
# The official TempNet code's LLaMA-2/pretrain_llama_distributed.sh, as its users run it, with the
# sequence shrunk and TP, PP and the paths given by the test (the model's shape comes from the
# checkpoint: --use-checkpoint-args) on 2 CPU processes. EXTRA_ARGS: flags the test appends.

export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=2
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))
TP=${TP}
PP=${PP}
TOKENIZER_MODEL=${TOKENIZER_MODEL}
CHECKPOINT_PATH=${CHECKPOINT_PATH}
DATA_PATH=${DATA_PATH}

DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --seq-length 32 \
    --max-position-embeddings 64 \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model ${TOKENIZER_MODEL} \
    --exit-on-missing-checkpoint \
    --use-checkpoint-args \
    --no-load-optim \
    --no-load-rng \
    --bf16 \
    --untie-embeddings-and-output-weights \
    --use-rotary-position-embeddings \
    --normalization RMSNorm \
    --no-position-embedding \
    --no-masked-softmax-fusion \
    --micro-batch-size 4 \
    --global-batch-size 16 \
    --lr 0.0001 \
    --train-iters 30000 \
    --lr-decay-iters 30000 \
    --lr-decay-style cosine \
    --min-lr 1.0e-4 \
    --weight-decay 1e-2 \
    --lr-warmup-fraction .01 \
    --clip-grad 1.0 \
    --use-flash-attn \
    --use-distributed-optimizer \
    --swiglu \
    --tempnet-rho 8.5 \
    --use-tempnet
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --split 949,50,1
"

OUTPUT_ARGS="
    --log-interval 100 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --eval-iters 10
"

torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend nccl \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    $EXTRA_ARGS
