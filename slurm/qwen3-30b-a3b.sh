#!/bin/bash
# Qwen3-30B-A3B on one GPU (TP=1): a mixture of experts, 3.3B of 30.5B parameters active.
# Only the allocation is here (sbatch reads #SBATCH lines literally); everything else is the
# ["qwen3-30b-a3b"] table of models.toml.  Account, partition and a different time: sbatch flags or SBATCH_*.
#   sbatch --account=ACCOUNT --partition=PARTITION slurm/qwen3-30b-a3b.sh
#SBATCH --job-name=llmlab-qwen3-30b-a3b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-gpu=8
#SBATCH --time=02:00:00
#SBATCH --output=/dev/null

# sbatch runs a copy of this file: find the launcher beside the original that was submitted.
if [[ -n ${LLMLAB_SLURM_DIR:-} ]]; then
  here=$LLMLAB_SLURM_DIR
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
  here=$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=//p')")
else
  here=$(dirname "${BASH_SOURCE[0]}")
fi
exec bash "$here/llmlab-serve.sh" qwen3-30b-a3b
