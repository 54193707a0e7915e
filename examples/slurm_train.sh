#!/bin/bash
# lmforge on a SLURM cluster: one srun task per node, each starting torchrun for the node's GPUs;
# the nodes meet through torchrun's c10d rendezvous on the first node of the allocation.
#
#   sbatch examples/slurm_train.sh                     # defaults below: 2 nodes x 8 GPUs
#   sbatch --nodes 4 examples/slurm_train.sh --parallel.dp_shard 4 --parallel.tp 8
#
# The layout must multiply to nodes x GPUs per node: dp_replicate x dp_shard x tp x pp. Keep TP
# within a node (it is the innermost mesh dim, so ranks of one TP group are neighbours) and put
# pipeline stages / data-parallel replicas across nodes. Extra arguments are config overrides.
#
# Preemption and the time limit: Slurm sends this batch script SIGUSR1 120 s before it kills the
# job (--signal=B:USR1@120; B: = to this shell only, not to every process of the step: torchrun's
# agent has no handler for SIGUSR1 and would die of it). The trap below hands it on as SIGTERM to
# srun, which forwards it to torchrun on every node, which forwards it to its workers: they finish
# the step, save a checkpoint, and the script exits 75. Submitting the same command again resumes.
# Raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT (how long torchrun waits for its workers after forwarding
# the signal, default 30 s) and the 120 s together if a checkpoint takes longer to write.
#SBATCH --job-name=lmforge
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --signal=B:USR1@120

set -euo pipefail
CONFIG=${CONFIG:-llama-1b}                      # a preset name or a path to a .toml file
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_addr=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')
port=${MASTER_PORT:-29500}
mkdir -p logs

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_ASYNC_ERROR_HANDLING=1              # a failed collective aborts the job instead of hanging
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}  # time for the preemption checkpoint

# Example layouts for 16 GPUs (append to the command line):
#   FSDP2 (ZeRO-3):      --parallel.dp_shard 16
#   HSDP:                --parallel.dp_replicate 2 --parallel.dp_shard 8
#   FSDP2 x TP:          --parallel.dp_shard 2 --parallel.tp 8 --parallel.sequence_parallel true
#   TP x PP:             --parallel.tp 8 --parallel.pp 2 --parallel.pp_schedule interleaved --parallel.pp_virtual_stages 2
#   3-D:                 --parallel.dp_shard 2 --parallel.tp 4 --parallel.pp 2
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_addr:$port" \
    -m lmforge train --config "$CONFIG" "$@" &
step=$!
preempted=0
trap 'preempted=1; echo "preemption notice: SIGTERM to the training step (each rank checkpoints and exits)"; kill -TERM "$step" 2>/dev/null || true' USR1 TERM
while :; do  # (a trapped signal cuts `wait` short: wait again until srun has ended)
    wait "$step" && rc=0 || rc=$?
    kill -0 "$step" 2>/dev/null || break
done
if [ "$preempted" = 1 ]; then
    echo "preempted: submit the same command again to resume from the run's last checkpoint"
    exit 75
fi
exit "$rc"
