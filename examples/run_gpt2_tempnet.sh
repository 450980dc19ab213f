#!/bin/bash
# GPT-2 (125M) trained from scratch jointly with TempNet under the KL-DRO loss: the paper's
# setting (i) (Figure 4 left, Tables 2 and 4; Table 5, column "Training GPT-2": 320k iterations,
# batch 32, learning rate 6e-4).
#
#   sbatch examples/run_gpt2_tempnet.sh          # 1 node, 8 GPUs: DP 8 with ZeRO-1, bf16
#
# The LM trains in bf16 with DeepSpeed's float32 master weights; TempNet and the loss stay a
# float32 island. Their float32 matrix products (TempNet's W1 over the vocabulary shard) run on
# the tensor cores in TF32 (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1: inputs rounded to 10 mantissa
# bits, float32 accumulation); tau itself is computed by float32 element-wise operations.
# PRECISION=fp32 trains in float32 (and without TF32) instead.
#
# Preemption-safe: on SIGUSR1 (5 minutes before the time limit) or SIGTERM the run checkpoints,
# the job requeues itself and resumes from RUN_DIR/checkpoints/latest.
#
# Environment (defaults in brackets), plus REPO, PYTHON, DEVICE, NPROC_PER_NODE, SAVE_INTERVAL and
# LOG_INTERVAL from examples/lib/slurm.sh:
#   VOCAB_FILE, MERGE_FILE [data/gpt2-vocab.json, data/gpt2-merges.txt] the GPT-2 BPE
#   DATA_PATH       [data/owt2_gpt2_text_document]   SPLIT [949,50,1]
#   RUN_DIR         [runs/gpt2_tempnet]
#   LOSS_ARGS       [--loss dro --tau-source tempnet] the objective (run_ablations.sh sets it)
#   MODEL [gpt2-125m]  TP [1]  PP [1]  ZERO [1]  TRAIN_ITERS [320000]  GLOBAL_BATCH [32]
#   MICRO_BATCH [4]  RHO [10]  SEQ_LENGTH [the preset's: 1024]  PRECISION [bf16] bf16 or fp32
#   EXTRA_ARGS [more flags]
#
#SBATCH --job-name=gpt2-tempnet
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -u
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
source "$REPO/examples/lib/slurm.sh" || { echo "error: no $REPO/examples/lib/slurm.sh: submit from the repository root or set REPO" >&2; exit 2; }
tempnet_init

RUN_DIR=${RUN_DIR:-runs/gpt2_tempnet}
tempnet_run_flags

tempnet_precision_flags

FLAGS=(
    --model "${MODEL:-gpt2-125m}" "${PRECISION_FLAGS[@]}"
    --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}"
    --zero-stage "${ZERO:-1}"
    --tokenizer-type GPT2BPETokenizer
    --vocab-file "${VOCAB_FILE:-data/gpt2-vocab.json}"
    --merge-file "${MERGE_FILE:-data/gpt2-merges.txt}"
    --data-path "${DATA_PATH:-data/owt2_gpt2_text_document}" --split "${SPLIT:-949,50,1}"
    ${LOSS_ARGS:---loss dro --tau-source tempnet}
    --tempnet-rho "${RHO:-10}" --tempnet-tau-min 0.001 --tempnet-tau-max 2.0
    --tempnet-hidden-size 256 --tempnet-proj-size 256
    --train-iters "${TRAIN_ITERS:-320000}" --global-batch-size "${GLOBAL_BATCH:-32}"
    --micro-batch-size "${MICRO_BATCH:-4}"
    --lr 6e-4 --lr-decay-style cosine --min-lr 0 --lr-warmup-fraction 0.01 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --eval-interval 1000 --eval-iters 10
)
[ -n "${SEQ_LENGTH:-}" ] && FLAGS+=(--seq-length "$SEQ_LENGTH")

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
tempnet_launch "${FLAGS[@]}" "${RUN_FLAGS[@]}" ${EXTRA_ARGS:-}
