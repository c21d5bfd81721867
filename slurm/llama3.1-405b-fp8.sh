#!/bin/bash
# Llama 3.1 405B in FP8 on one node of 8 GPUs (TP=8).
# What ran: this job's settings at half the width, TP=4 on 4 x H200 with --max-model-len 32768 (the full 131,072
# does not fit four H200s; llmlab launch says so and names the context that does), through the launcher with dummy
# weights and vLLM 0.26: READY in 309 s, 90,160 KV tokens, 27.9 tokens/s for one request
# (benchmarks/results/h200x4-llama3.1-405b-fp8-tp4/).  TP=8 on 8 GPUs has not run: no such machine was lent.
# Only the allocation is here (sbatch reads #SBATCH lines literally); everything else is the
# ["llama3.1-405b-fp8"] table of models.toml.  Account, partition and a different time: sbatch flags or SBATCH_*.
#   sbatch --account=ACCOUNT --partition=PARTITION slurm/llama3.1-405b-fp8.sh
#SBATCH --job-name=llmlab-llama3.1-405b-fp8
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-gpu=8
#SBATCH --time=04:00:00
#SBATCH --output=/dev/null

# sbatch runs a copy of this file: find the launcher beside the original that was submitted.
if [[ -n ${LLMLAB_SLURM_DIR:-} ]]; then
  here=$LLMLAB_SLURM_DIR
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
  here=$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=//p')")
else
  here=$(dirname "${BASH_SOURCE[0]}")
fi
exec bash "$here/llmlab-serve.sh" llama3.1-405b-fp8
