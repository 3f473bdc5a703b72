#!/bin/bash
# Check a run, then queue the whole of it as one heterogeneous Slurm job (sbatch/run_async_ppo.sh).
#
#   scripts/submit_sbatch.sh [key=value ...]
#   HPCRL_CONFIG=configs/my.yaml HPCRL_RUN_DIR=/scratch/me/run1 scripts/submit_sbatch.sh trainer.total_steps=500
#
# Before anything is queued:
#   1. the Python: $HPCRL_PYTHON, else the checkout's .venv/bin/python, else python3 on PATH; the first that
#      imports hpcrl is used (and passed to the job); none: exit 2, nothing queued;
#   2. `python -m hpcrl.submit ... --dry-run`: the config, model and data (a bad key, a missing model folder
#      or dataset: exit 1, nothing queued);
#   3. `sbatch --test-only` of the job: its resources, partition, account (a refusal: exit 1).
# Then `sbatch` queues it with its Slurm output in <run_dir>/logs/slurm-<jobid>.out (the supervisor's own
# log is <run_dir>/logs/batch-<jobid>.log); the job id is printed.
#
# Environment (all optional):
#   HPCRL_CONFIG       config YAML (default configs/quickstart.yaml)
#   HPCRL_RUN_DIR      run directory (default runs/hpcrl-<date>-<time>); one that holds a run is resumed
#   HPCRL_OVERRIDES    more key=value overrides, space separated
#   HPCRL_PYTHON       the Python with hpcrl installed
#   HPCRL_SBATCH_ARGS  more sbatch options, space separated (e.g. "--time=600 --partition=gpu")
# The het groups' sizes (trainer.world_size, rollout.replicas) come from the job script's #SBATCH lines.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "[submit_sbatch] $*" >&2; }

PY=""
for cand in "${HPCRL_PYTHON:-}" "$REPO/.venv/bin/python" "$(command -v python3 || true)"; do
    if [[ -n $cand && -x $cand ]] && "$cand" -c "import hpcrl" 2>/dev/null; then
        PY=$cand
        break
    fi
    if [[ -n $cand && $cand == "${HPCRL_PYTHON:-}" ]]; then
        say "HPCRL_PYTHON=$cand cannot import hpcrl"
        exit 2
    fi
done
if [[ -z $PY ]]; then
    say "no Python that imports hpcrl: not $REPO/.venv/bin/python, not python3 on PATH;" \
        "install it (README) or set HPCRL_PYTHON. Nothing was queued."
    exit 2
fi
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")

CONFIG=${HPCRL_CONFIG:-configs/quickstart.yaml}
RUN_DIR=${HPCRL_RUN_DIR:-runs/hpcrl-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$(dirname "$RUN_DIR")"
RUN_DIR=$(cd "$(dirname "$RUN_DIR")" && pwd)/$(basename "$RUN_DIR")
read -r -a OVERRIDES <<<"${HPCRL_OVERRIDES:-}"
read -r -a SBATCH_ARGS <<<"${HPCRL_SBATCH_ARGS:-}"

if [[ -f $RUN_DIR/config.yaml ]]; then
    say "$RUN_DIR holds a run: the job resumes it (its config was checked when it started)"
else
    if ! "$PY" -m hpcrl.submit --config "$CONFIG" launch.scheduler=srun "run_dir=$RUN_DIR" \
            "${OVERRIDES[@]}" "$@" --dry-run; then
        say "the dry run failed (above): nothing was queued"
        exit 1
    fi
fi
TEST_ARGS=()
for a in "${SBATCH_ARGS[@]}"; do [[ $a == --wait || $a == -W ]] || TEST_ARGS+=("$a"); done
if ! out=$(sbatch --test-only "${TEST_ARGS[@]}" "$REPO/sbatch/run_async_ppo.sh" 2>&1); then
    say "Slurm refuses the job: $out"
    say "nothing was queued"
    exit 1
fi
say "${out//$'\n'/ }"

mkdir -p "$RUN_DIR/logs"
export HPCRL_PYTHON=$PY HPCRL_RUN_DIR=$RUN_DIR HPCRL_CONFIG=$CONFIG
job=$(sbatch --parsable --output="$RUN_DIR/logs/slurm-%j.out" "${SBATCH_ARGS[@]}" "$REPO/sbatch/run_async_ppo.sh" "$@")
job=${job%%;*}
say "queued job $job for $RUN_DIR: python -m hpcrl status $RUN_DIR; Slurm output $RUN_DIR/logs/slurm-$job.out"
echo "$job"
