#!/bin/bash
# Site template of sbatch/run_async_ppo.sh: copy it, fill the <...> placeholders, submit it.
#
#   cp sbatch/template_site.sh my_run.sh && $EDITOR my_run.sh && sbatch my_run.sh [key=value ...]
#
# Placeholders:
#   <PARTITION>  GPU/NPU partition (sinfo -s lists them)     <ACCOUNT>  your project/account (sacctmgr show assoc user=$USER)
#   <GPUS>       accelerators per node (8 on a DGX/910B node) <HOURS>    wall-clock limit
# Het group 0 is the trainer: --ntasks-per-node = <GPUS> (one rank per device),
#   nodes x tasks = trainer.world_size. Het group 1 holds the rollout replicas,
#   one task per replica (rollout.replicas), each with its own devices.
# Walltime/preemption: SIGUSR2 reaches the supervisor <SIGNAL_S> s before the limit
#   (pick it above one checkpoint's duration); every component checkpoints, the job
#   requeues itself and the restarted job continues the run with --resume.
# Ascend: replace --gpus-per-node by your site's gres (e.g. --gres=npu:8) and
#   load CANN (source /usr/local/Ascend/ascend-toolkit/set_env.sh) in the setup lines.
#
# --- het group 0: trainer ---
#SBATCH --job-name=hpcrl
#SBATCH --output=hpcrl-%j.out
#SBATCH --open-mode=append
#SBATCH --time=<HOURS>:00:00
#SBATCH --signal=B:USR2@<SIGNAL_S>
#SBATCH --requeue
#SBATCH --partition=<PARTITION>
#SBATCH --account=<ACCOUNT>
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=<GPUS>
#SBATCH --gpus-per-node=<GPUS>
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH hetjob
# --- het group 1: rollout replicas ---
#SBATCH --partition=<PARTITION>
#SBATCH --account=<ACCOUNT>
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
set -euo pipefail

# --- site setup: modules, environment (edit) ---
# module load cuda/12.4 nccl
# source /path/to/venv/bin/activate
export HF_HUB_OFFLINE=1

cd "${SLURM_SUBMIT_DIR:-.}"
RUN_DIR=${HPCRL_RUN_DIR:-runs/hpcrl-${SLURM_JOB_ID}}
mkdir -p "$RUN_DIR/logs"
exec >>"$RUN_DIR/logs/batch-${SLURM_JOB_ID}.log" 2>&1

# exec: the supervisor is the batch process, so --signal=B:USR2 reaches it
if [[ -f "$RUN_DIR/config.yaml" ]]; then  # requeued after walltime/preemption: continue the run
    exec python -m hpcrl.submit --resume "$RUN_DIR"
fi
# trainer.world_size must equal het group 0's tasks; rollout.replicas group 1's tasks.
# shellcheck disable=SC2086
exec python -m hpcrl.submit --config "${HPCRL_CONFIG:-configs/quickstart.yaml}" launch.scheduler=srun \
    "run_dir=$RUN_DIR" trainer.world_size="${SLURM_NTASKS_HET_GROUP_0:-1}" \
    rollout.replicas="${SLURM_NTASKS_HET_GROUP_1:-1}" ${HPCRL_OVERRIDES:-} "$@"
