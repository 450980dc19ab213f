#!/bin/bash
# CLIP (ViT-B/16 towers) trained with TempNet under the robust global contrastive loss: the
# paper's bimodal setting (Section 6.2, Table 6 "CLIP Model Training": batch 512, learning rate
# 2e-4 with 1000 warmup steps and cosine decay, weight decay 0.02, Adam betas (0.9, 0.999),
# eps 1e-8, 30 epochs; tau in [0.001, 0.05], d1 = d2 = 256, rho tuned in 7-10, TempNet learning
# rate in {1e-4, 5e-5, 1e-5, 5e-6}).
#
#   sbatch examples/run_clip_tempnet.sh                  # 1 node, 8 GPUs: DP 8 with ZeRO-1
#   CLIP_LOSS=isogclr sbatch examples/run_clip_tempnet.sh  # a baseline on the same data
#   CAPTION_NOISE=15 sbatch examples/run_clip_tempnet.sh   # the noisy-caption experiment
#
# Preemption-safe like the GPT scripts: on SIGUSR1 (5 minutes before the time limit) or SIGTERM
# the run checkpoints (per-sample state included), the job requeues itself and resumes.
#
# Environment (defaults in brackets), plus REPO, PYTHON, DEVICE, NPROC_PER_NODE, SAVE_INTERVAL and
# LOG_INTERVAL from examples/lib/slurm.sh:
#   TRAIN_DATA      [data/cc3m_train.csv] manifests (image,caption) or .tar shards
#   VALID_DATA      [data/coco_karpathy_test.csv] held-out pairs; LABEL_KEY [image_id] groups
#                   the captions of one image for retrieval
#   TOKENIZER       [data/clip-tokenizer] a Hugging Face tokenizer directory (or, with
#                   TOKENIZER_TYPE=SentencePieceTokenizer, a .model file)
#   RUN_DIR         [runs/clip_tempnet]   CLIP_LOSS [tempnet]  CAPTION_NOISE [0]
#   MODEL [vit-b-16]  EMBED_DIM [256]  TP [1]  ZERO [1]  GLOBAL_BATCH [512]
#   TRAIN_ITERS [169500: 30 epochs of ~2.83M CC3M pairs at 512]  WARMUP_ITERS [1000]  RHO [8]
#   TEMPNET_LR [1e-4]
#   EXTRA_ARGS [more flags]
#
#SBATCH --job-name=clip-tempnet
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
ENTRY=pretrain_clip.py

RUN_DIR=${RUN_DIR:-runs/clip_tempnet}
tempnet_run_flags

GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TP=${TP:-1}
DP=$((NODES * NPROC_PER_NODE / TP))
[ $((GLOBAL_BATCH % DP)) -eq 0 ] || die "GLOBAL_BATCH=$GLOBAL_BATCH is not divisible by the $DP data-parallel ranks"

FLAGS=(
    --model "${MODEL:-vit-b-16}" --embed-dim "${EMBED_DIM:-256}"
    --tensor-model-parallel-size "$TP" --zero-stage "${ZERO:-1}"
    --train-data ${TRAIN_DATA:-data/cc3m_train.csv}
    --valid-data ${VALID_DATA:-data/coco_karpathy_test.csv} --label-key "${LABEL_KEY:-image_id}"
    --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "${TOKENIZER:-data/clip-tokenizer}"
    --image-augment --caption-noise "${CAPTION_NOISE:-0}"
    --clip-loss "${CLIP_LOSS:-tempnet}" --tempnet-rho "${RHO:-8}"
    --tempnet-tau-min 0.001 --tempnet-tau-max 0.05 --tempnet-proj-size 256
    --tempnet-lr "${TEMPNET_LR:-1e-4}"
    --train-iters "${TRAIN_ITERS:-169500}" --global-batch-size "$GLOBAL_BATCH"
    --micro-batch-size $((GLOBAL_BATCH / DP))
    --lr 2e-4 --lr-decay-style cosine --min-lr 0 --lr-warmup-iters "${WARMUP_ITERS:-1000}"
    --weight-decay 0.02
    --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --clip-grad 1.0
    --eval-interval 5650 --eval-batch-size 256
)

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags; the data variables may list several
tempnet_launch "${FLAGS[@]}" "${RUN_FLAGS[@]}" ${EXTRA_ARGS:-}
