#!/bin/bash
# TempNet for a frozen LLaMA-2-70B-chat, trained on OpenWebText2 with the KL-DRO loss: the paper's
# Table 1 recipe (setting iii; Table 5, column "Fixing LLaMA2 Chat", 20k iterations).
#
#   sbatch examples/run_llama70b_tempnet.sh                     # 1 node: TP 4 x DP 2
#   TP=8 PP=2 sbatch --nodes=8 examples/run_llama70b_tempnet.sh # TP 8 per node, PP 2, DP 4
#
# TP stays within a node; PP and DP span nodes: DP = nodes x NPROC_PER_NODE / (TP x PP).
#
# Why TP 4 on 8 GPUs: the LM is frozen, so it has no gradients and no optimizer state, and it
# runs forward only; a GPU holds its weight shard and little else. The planner
# (tools/estimate_memory.py --model llama2-70b --bf16 --freeze-lm --micro-batch-size 1
# --global-batch-size 16) gives per GPU: TP 8 x DP 1 16.4 GiB, TP 4 x DP 2 32.6 GiB, TP 2 x DP 4
# 65.0 GiB of 80 (before the CUDA context, NCCL's buffers and fragmentation). Fewer TP ranks
# mean larger matrix products and fewer all-reduces per token (each DP replica runs half the
# micro-batches): TP 4 is the smallest with ample headroom. TP 2 fits too, with 15 GiB left.
# Preemption-safe: on SIGUSR1 (sent 5 minutes before the time limit, --signal below) or SIGTERM
# the run checkpoints, the job requeues itself and resumes from RUN_DIR/checkpoints/latest.
#
# Environment (defaults in brackets), plus REPO, PYTHON, DEVICE, NPROC_PER_NODE, SAVE_INTERVAL and
# LOG_INTERVAL from examples/lib/slurm.sh:
#   LM_CHECKPOINT   [checkpoints/llama2-70b-chat] the frozen LM, as
#                   tools/checkpoint/convert_hf_to_megatron.py writes it from Llama-2-70b-chat-hf;
#                   any TP x PP loads (each rank reads its part at the run's layout). It is read
#                   at every start, a resume included: the run's checkpoints hold TempNet only
#   TOKENIZER_MODEL [$LM_CHECKPOINT/tokenizer] a Hugging Face tokenizer folder (the converter
#                   copies the model's tokenizer files there)
#   DATA_PATH       [data/owt2_llama2_text_document] OpenWebText2 from tools/preprocess_data.py
#                   with --tokenizer-type HuggingFaceTokenizer --tokenizer-model
#                   $LM_CHECKPOINT/tokenizer (a dataset of another tokenizer is refused)
#   SPLIT           [949,50,1] train, validation, test shares
#   RUN_DIR         [runs/llama70b_tempnet] checkpoints/ (TempNet, optimizer, data position),
#                   tensorboard/, metrics.jsonl
#   MODEL           [llama2-70b] a --model preset (tiny for a CPU test)
#   TP [4]  PP [1]  TRAIN_ITERS [20000]  GLOBAL_BATCH [16]  MICRO_BATCH [1]  RHO [10]
#   SEQ_LENGTH      [the preset's: 4096]
#   EXTRA_ARGS      more pretrain_gpt.py flags (word-split)
#
#SBATCH --job-name=llama70b-tempnet
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -u
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
source "$REPO/examples/lib/slurm.sh" || { echo "error: no $REPO/examples/lib/slurm.sh: submit from the repository root or set REPO" >&2; exit 2; }
tempnet_init

LM_CHECKPOINT=${LM_CHECKPOINT:-checkpoints/llama2-70b-chat}
RUN_DIR=${RUN_DIR:-runs/llama70b_tempnet}
tempnet_run_flags

FLAGS=(
    --model "${MODEL:-llama2-70b}" --bf16
    --tensor-model-parallel-size "${TP:-4}" --pipeline-model-parallel-size "${PP:-1}"
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:-$LM_CHECKPOINT/tokenizer}"
    --data-path "${DATA_PATH:-data/owt2_llama2_text_document}" --split "${SPLIT:-949,50,1}"
    --pretrained-checkpoint "$LM_CHECKPOINT" --freeze-lm
    --loss dro --tau-source tempnet --tempnet-rho "${RHO:-10}"
    --tempnet-tau-min 0.001 --tempnet-tau-max 2.0
    --tempnet-hidden-size 256 --tempnet-proj-size 256
    --train-iters "${TRAIN_ITERS:-20000}" --global-batch-size "${GLOBAL_BATCH:-16}"
    --micro-batch-size "${MICRO_BATCH:-1}"
    --lr 1e-4 --lr-decay-style cosine --min-lr 0 --lr-warmup-fraction 0.01 --weight-decay 0.01
    --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --clip-grad 1.0
    --eval-interval 1000 --eval-iters 10
)
[ -n "${SEQ_LENGTH:-}" ] && FLAGS+=(--seq-length "$SEQ_LENGTH")

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
tempnet_launch "${FLAGS[@]}" "${RUN_FLAGS[@]}" ${EXTRA_ARGS:-}
