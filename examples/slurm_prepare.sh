#!/bin/bash
# `lmforge prepare` on a Slurm cluster as job arrays: one array job per stage, each task a worker
# that takes its share of the stage's work units (rank = SLURM_ARRAY_TASK_ID, workers =
# SLURM_ARRAY_TASK_COUNT), the stages chained with --dependency=afterok. The one-task stages
# (cluster, tokenizer, merge) are one-task jobs. Slurm does the scheduling; lmforge only computes
# each worker's share (the same as on one machine, so the output bytes are the same).
#
#   bash examples/slurm_prepare.sh prep.toml 64          # 64 workers per parallel stage
#   WORKERS_MAX=16 bash examples/slurm_prepare.sh prep.toml 64   # at most 16 running at once
#
# Inputs and output_dir must be visible to every node: a shared file system or s3:// URLs (set
# prepare.s3_endpoint or AWS_ENDPOINT_URL for a non-AWS store). Nothing is kept on a node's disk
# but temporary files (--scratch, default the node's $TMPDIR).
#
# A task that died (preempted, OOM, node failure) leaves the later stages waiting on a dependency
# that can no longer be met: `scancel` them and run this script again. Every finished task is
# skipped, so only the dead worker's unfinished units (and the stages after) run; or re-run that
# one task alone: sbatch --array=17 --wrap "lmforge prepare --config prep.toml --stage scan --world 64"
# `lmforge prepare --config prep.toml --status` shows every stage's progress, MB/s per worker and
# what each filter removed; the next stage refuses to start and names the workers whose tasks
# are missing.
set -euo pipefail
CONFIG=${1:?usage: slurm_prepare.sh CONFIG.toml [WORKERS]}
WORKERS=${2:-16}
THROTTLE=${WORKERS_MAX:+%$WORKERS_MAX}
SBATCH_ARGS=${SBATCH_ARGS:-"--cpus-per-task=4 --mem=16G --time=24:00:00 --output=logs/prepare-%x-%A_%a.out"}
mkdir -p logs

step() {  # step NAME TASKS DEPENDENCY -> job id
    local name=$1 tasks=$2 dep=$3 array=""
    [ "$tasks" -gt 1 ] && array="--array=0-$((tasks - 1))$THROTTLE"
    # shellcheck disable=SC2086
    sbatch --parsable --job-name="prep-$name" $array ${dep:+--dependency=afterok:$dep} \
        $SBATCH_ARGS --wrap "lmforge prepare --config $CONFIG --stage $name --world $tasks -q"
}

scan=$(step scan "$WORKERS" "")
dedup=$(step dedup "$WORKERS" "$scan")      # each task owns hash ranges of the digests
cluster=$(step cluster 1 "$dedup")          # greedy near-dedup over the LSH buckets
filter=$(step filter "$WORKERS" "$cluster")
tok=$(step tokenizer 1 "$filter")           # BPE on the content-hash sample
tokenize=$(step tokenize "$WORKERS" "$tok")
assemble=$(step assemble "$WORKERS" "$tokenize")
merge=$(step merge 1 "$assemble")           # manifests, mixture.json, prepare.json
echo "submitted: scan $scan -> dedup $dedup -> cluster $cluster -> filter $filter -> tokenizer $tok" \
     "-> tokenize $tokenize -> assemble $assemble -> merge $merge"
