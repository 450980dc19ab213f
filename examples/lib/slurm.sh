# Shared by the sbatch scripts in examples/ (sourced, not run): where the code is, which device,
# and an srun launch that turns a preemption into a requeue.
#
# pretrain_gpt.py (and pretrain_clip.py) exits with status 75 when it stopped early at a checkpoint (SIGUSR1 or SIGTERM,
# or --exit-duration-in-mins); tempnet_launch then requeues the job, and the requeued job resumes
# from the checkpoint directory's `latest`.

EXIT_REQUEUE=75

die() {
    echo "error: $*" >&2
    exit 2
}

# Variables every script understands (defaults in brackets):
#   REPO            [the directory sbatch was run from] the megatron-tempnet checkout
#   PYTHON          [$REPO/.venv/bin/python if present, else python3]
#   DEVICE          [gpu] gpu or cpu (cpu: gloo, DS_ACCELERATOR=cpu, one thread per task)
#   NPROC_PER_NODE  [tasks per node of the allocation] one task (rank) per GPU; each task
#                   finds its GPU whether it sees all of the node's (--gpus-per-node) or only
#                   its own (--gpus-per-task 1)
#   CPUS_PER_TASK   [the job's --cpus-per-task, else the node's CPUs / NPROC_PER_NODE] given to
#                   srun: since Slurm 22.05 srun does not take it from the job, and each task
#                   (its data loader workers, its compile threads) would get one CPU
tempnet_init() {
    [ -n "${SLURM_JOB_ID:-}" ] || die "submit this script with sbatch (SLURM_JOB_ID is not set)"
    [ -f "$REPO/pretrain_gpt.py" ] || die "REPO=$REPO holds no pretrain_gpt.py: submit from the repository root or set REPO"
    if [ -z "${PYTHON:-}" ]; then
        PYTHON=python3
        [ -x "$REPO/.venv/bin/python" ] && PYTHON=$REPO/.venv/bin/python
    fi
    NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_NTASKS_PER_NODE:-8}}
    NPROC_PER_NODE=${NPROC_PER_NODE%%(*}
    local node_cpus=${SLURM_CPUS_ON_NODE:-$NPROC_PER_NODE}
    CPUS_PER_TASK=${CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-$((node_cpus / NPROC_PER_NODE))}}
    [ "$CPUS_PER_TASK" -ge 1 ] 2>/dev/null || CPUS_PER_TASK=1
    DEVICE=${DEVICE:-gpu}
    case $DEVICE in
        gpu) ;;
        cpu) export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ;;
        *) die "DEVICE=$DEVICE: use gpu or cpu" ;;
    esac
    echo "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): ${NODES} node(s) x ${NPROC_PER_NODE} tasks x ${CPUS_PER_TASK} CPUs on ${DEVICE}"
}

# tempnet_launch FLAGS...: the entry point (ENTRY [pretrain_gpt.py], or pretrain_clip.py) with FLAGS on every task of the allocation (srun sets each
# task's rank; the rendezvous is the first node). A signal sent to the batch shell only
# (--signal=B:USR1@...) is passed on to the tasks. Returns pretrain_gpt.py's status; on 75 the
# job is requeued first. Every task exits 75 after a preemption, not at the same instant: srun
# does not kill the others when the first exits (75 is a non-zero status), it gives them
# TASK_EXIT_WAIT seconds [120] (a crashed rank leaves the others waiting in a collective).
tempnet_launch() {
    srun --nodes="$NODES" --ntasks-per-node="$NPROC_PER_NODE" --cpus-per-task="$CPUS_PER_TASK" \
        --ntasks=$((NODES * NPROC_PER_NODE)) --kill-on-bad-exit=0 --wait="${TASK_EXIT_WAIT:-120}" \
        "$PYTHON" "$REPO/${ENTRY:-pretrain_gpt.py}" "$@" &
    local pid=$! status
    trap 'kill -USR1 $pid 2>/dev/null' USR1
    trap 'kill -TERM $pid 2>/dev/null' TERM
    while :; do
        wait "$pid"
        status=$?
        kill -0 "$pid" 2>/dev/null || break # still running: a trapped signal cut the wait short
    done
    trap - USR1 TERM
    if [ "$status" -eq "$EXIT_REQUEUE" ]; then
        echo "stopped early at a checkpoint: requeueing job ${SLURM_JOB_ID}"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}

# Flags every run gets: checkpoints under RUN_DIR (resumed from automatically), TensorBoard, the
# metrics file. Sets the array RUN_FLAGS.
#   RUN_DIR         the run's directory: checkpoints/, tensorboard/, metrics.jsonl
#   SAVE_INTERVAL   [500] iterations between checkpoints (and one on every preemption)
#   LOG_INTERVAL    [10]
tempnet_run_flags() {
    mkdir -p "$RUN_DIR"
    RUN_FLAGS=(
        --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints"
        --save-interval "${SAVE_INTERVAL:-500}" --keep-last 2
        --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl"
        --log-interval "${LOG_INTERVAL:-10}"
    )
}

# tempnet_precision_flags: PRECISION_FLAGS from PRECISION [bf16]: bf16 (the LM in bf16 with float32
# masters; TempNet's float32 products on the tensor cores in TF32) or fp32
tempnet_precision_flags() {
    case ${PRECISION:-bf16} in
        bf16) PRECISION_FLAGS=(--bf16); export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 ;;
        fp32) PRECISION_FLAGS=() ;;
        *) die "PRECISION=$PRECISION: use bf16 or fp32" ;;
    esac
}
