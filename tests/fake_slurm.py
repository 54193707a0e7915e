"""Stand-ins for Slurm's `sbatch`, `srun` and `scontrol` on one machine, so the tests run
examples/slurm_*.sh as written (no Slurm here). They do what the scripts rely on and no more:

* `sbatch [--parsable] [--array=A-B[%N]] [--dependency=afterok:ID] [--opt=value ...] (--wrap CMD |
  SCRIPT [ARGS])`: runs the job at once (an array's tasks concurrently, with
  SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT; a script on one node: SLURM_JOB_ID, SLURM_NNODES=1,
  SLURM_JOB_NODELIST=localhost, whatever its #SBATCH lines ask), fails if any task fails, prints
  a new job id, and appends `ID DEPENDENCY TASKS CMD` to $FAKE_SLURM_LOG. Running each job before
  sbatch returns honours every `afterok` dependency.
* `srun [options] CMD ...`: runs CMD once (one node), options dropped.
* `scontrol show hostnames LIST`: prints `localhost`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SBATCH = r"""#!/bin/bash
set -euo pipefail
array="" wrap="" dep="-" script=""
while [ $# -gt 0 ]; do
    case "$1" in
        --array=*) array=${1#--array=} ;;
        --dependency=*) dep=${1#--dependency=} ;;
        --wrap) wrap=$2; shift ;;
        --wrap=*) wrap=${1#--wrap=} ;;
        -*) ;;
        *) script=$1; shift; break ;;
    esac
    shift
done
id=1000
if [ -f "$FAKE_SLURM_LOG" ]; then id=$((1000 + $(wc -l < "$FAKE_SLURM_LOG"))); fi
if [ -n "$array" ]; then
    range=${array%%\%*}; first=${range%-*}; last=${range#*-}; count=$((last - first + 1))
    pids=()
    for ((i = first; i <= last; i++)); do
        SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=$count SLURM_ARRAY_JOB_ID=$id bash -c "$wrap" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
elif [ -n "$script" ]; then
    count=1 wrap="$script $*"
    SLURM_JOB_ID=$id SLURM_NNODES=1 SLURM_JOB_NODELIST=localhost bash "$script" "$@"
else
    count=1
    bash -c "$wrap"
fi
echo "$id $dep $count $wrap" >> "$FAKE_SLURM_LOG"
echo "$id"
"""

SRUN = r"""#!/bin/bash
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do
    case "$1" in -w|-N|-n|--nodelist|--nodes|--ntasks) shift ;; esac
    shift
done
exec "$@"
"""

SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && echo localhost
"""


def install(bin_dir: Path) -> dict[str, str]:
    """Write the three commands into `bin_dir`; the environment to run a script with them."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM_LOG": str(bin_dir / "jobs.log")}
