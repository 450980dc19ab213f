#!/bin/bash
# The paper's GPT-2 ablations of the loss and TempNet (Table 4 and Table 18), one job-array task
# each, every task a run_gpt2_tempnet.sh run (same model, data and hyper-parameters) with:
#
#   0 ce-fixed-tau       --loss ce --tau-source fixed            Table 4 Baseline1 (tau = 1)
#   1 dro-newton         --loss dro --tau-source newton          Table 4 Baseline2 (tau per token)
#   2 tsce-tempnet       --loss ts-ce --tau-source tempnet       Table 4 Baseline3 = T18 Baseline2
#   3 tsce-tempnet-nosg  ... --no-tempnet-stop-grad              Table 18 Baseline1
#   4 dro-tempnet-nosg   --loss dro --tau-source tempnet --no-tempnet-stop-grad  T18 Baseline3
#   5 dro-tempnet        --loss dro --tau-source tempnet         ours (Tables 4 and 18)
#
#   bash examples/run_ablations.sh                  # submits the array (same as sbatch below)
#   sbatch examples/run_ablations.sh
#   sbatch --array=0,5 examples/run_ablations.sh    # a subset
#
# Task i writes ABLATION_DIR/<name>/ (default runs/gpt2_ablations). Every other variable of
# run_gpt2_tempnet.sh applies to all tasks (MODEL, TRAIN_ITERS, DATA_PATH, ...).
#
#SBATCH --job-name=gpt2-ablations
#SBATCH --array=0-5
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%A_%a.out

set -u
if [ -z "${SLURM_JOB_ID:-}" ]; then
    exec sbatch "$@" "$0"
fi
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}

NAMES=(ce-fixed-tau dro-newton tsce-tempnet tsce-tempnet-nosg dro-tempnet-nosg dro-tempnet)
OBJECTIVES=(
    "--loss ce --tau-source fixed --fixed-tau 1.0"
    "--loss dro --tau-source newton"
    "--loss ts-ce --tau-source tempnet"
    "--loss ts-ce --tau-source tempnet --no-tempnet-stop-grad"
    "--loss dro --tau-source tempnet --no-tempnet-stop-grad"
    "--loss dro --tau-source tempnet"
)
TASK=${SLURM_ARRAY_TASK_ID:-}
if [ -z "$TASK" ] || [ "$TASK" -lt 0 ] || [ "$TASK" -ge ${#NAMES[@]} ]; then
    echo "error: SLURM_ARRAY_TASK_ID=${TASK:-unset}: submit as an array with indices 0-$((${#NAMES[@]} - 1))" >&2
    exit 2
fi
export RUN_DIR=${ABLATION_DIR:-runs/gpt2_ablations}/${NAMES[$TASK]}
export LOSS_ARGS=${OBJECTIVES[$TASK]}
echo "ablation $TASK: ${NAMES[$TASK]} ($LOSS_ARGS) -> $RUN_DIR"
exec bash "$REPO/examples/run_gpt2_tempnet.sh"
