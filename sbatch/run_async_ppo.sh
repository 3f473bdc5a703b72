#!/bin/bash
# The whole hpcrl run inside ONE heterogeneous Slurm allocation.
#
#   sbatch sbatch/run_async_ppo.sh [key=value ...]
#   HPCRL_CONFIG=configs/my.yaml HPCRL_RUN_DIR=/scratch/me/run1 sbatch sbatch/run_async_ppo.sh trainer.total_steps=500
#
# Het group 0 runs the trainer (one task per accelerator; its --ntasks
# becomes trainer.world_size), het group 1 the rollout replicas (its
# --ntasks becomes rollout.replicas). The supervisor (python -m hpcrl.submit with
# launch.scheduler=srun) runs here, in the batch script, and starts each
# component as `srun --het-group=N` step; the components meet in the run
# directory. This script's own output goes to <run_dir>/logs/batch-<jobid>.log,
# each component's to <run_dir>/logs/<component>.log.
#
# Walltime and preemption: Slurm sends SIGUSR2 to the supervisor 120 s before
# the time limit (--signal=B:USR2@120; SIGTERM on preemption does the same):
# every component checkpoints and stops, the supervisor requeues this job
# (--requeue) and exits 75. The requeued job (same job id, same run
# directory) finds config.yaml there and continues with `--resume`, so a run
# longer than the walltime needs no babysitting. Raise the 120 s for models
# whose checkpoint takes longer.
#
# Environment (all optional):
#   HPCRL_CONFIG     config YAML (default configs/quickstart.yaml)
#   HPCRL_RUN_DIR    run directory (default runs/hpcrl-<jobid>)
#   HPCRL_OVERRIDES  more key=value overrides, space separated
#   HPCRL_PYTHON     the Python with hpcrl installed (default: .venv/bin/python in the
#                    submit directory if there is one, else python3 on PATH)
# For a site's partition/account/GPUs, copy sbatch/template_site.sh.
# scripts/submit_sbatch.sh checks the config, model, data and this job's resources
# before queueing it, finds the Python, and puts Slurm's output in the run directory;
# submitted directly, Slurm's output goes to hpcrl-<jobid>.out in the submit directory.
#
# --- het group 0: trainer ---
#SBATCH --job-name=hpcrl
#SBATCH --output=hpcrl-%j.out
#SBATCH --open-mode=append
#SBATCH --time=60
#SBATCH --signal=B:USR2@120
#SBATCH --requeue
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem-per-cpu=1000M
#SBATCH hetjob
# --- het group 1: rollout replicas ---
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem-per-cpu=1000M
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
RUN_DIR=${HPCRL_RUN_DIR:-runs/hpcrl-${SLURM_JOB_ID}}
mkdir -p "$RUN_DIR/logs"
exec >>"$RUN_DIR/logs/batch-${SLURM_JOB_ID}.log" 2>&1
echo "[batch] job ${SLURM_JOB_ID} on $(hostname): het groups ${SLURM_HET_SIZE:-1}, run dir $RUN_DIR," \
     "restart ${SLURM_RESTART_COUNT:-0}"

PY=${HPCRL_PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import hpcrl" 2>/dev/null; then
    echo "[batch] error: $PY cannot import hpcrl: set HPCRL_PYTHON to the Python where hpcrl is installed" \
         "(or submit with scripts/submit_sbatch.sh, which finds it before queueing)"
    exit 2
fi

# exec: the supervisor is the batch process itself, so --signal=B:USR2 reaches it
if [[ -f "$RUN_DIR/config.yaml" ]]; then  # requeued after walltime/preemption: continue the run
    exec "$PY" -m hpcrl.submit --resume "$RUN_DIR" trainer.world_size="${SLURM_NTASKS_HET_GROUP_0:-1}" \
        rollout.replicas="${SLURM_NTASKS_HET_GROUP_1:-1}"  # this allocation's size, if resubmitted resized
fi
# shellcheck disable=SC2086  # HPCRL_OVERRIDES is a space-separated list on purpose
exec "$PY" -m hpcrl.submit --config "${HPCRL_CONFIG:-configs/quickstart.yaml}" \
    launch.scheduler=srun "run_dir=$RUN_DIR" trainer.world_size="${SLURM_NTASKS_HET_GROUP_0:-1}" \
    rollout.replicas="${SLURM_NTASKS_HET_GROUP_1:-1}" ${HPCRL_OVERRIDES:-} "$@"
