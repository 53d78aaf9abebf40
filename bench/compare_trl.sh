#!/usr/bin/env bash
# Side-by-side PPO iteration throughput against TRL 1.12, alternating the two programs run by run on the same machine
# (bench/trl_ppo_bench.py is the TRL side), and generation against transformers' own generate (bench/decode.py
# --vs-hf). TRL lives in its own venv (never a dependency of this repo):
#   python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.12.0
# Usage: bash bench/compare_trl.sh [RUNS] [ITERS_S] [ITERS_L]   (defaults 3 10 10; about 50 min on 2 cores)
#        SHAPES=smollm2 bash bench/compare_trl.sh 2   # SmolLM2-135M from out/smollm2 (make smollm2), 4 iterations
# Logs go to out/bench/; the summary (medians and ratios per shape and phase) is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}; ITERS_S=${2:-10}; ITERS_L=${3:-10}; SHAPES=${SHAPES:-S L}   # SHAPES=S: shape S only
ITERS_smollm2=${ITERS_SMOLLM2:-4}
PY=${PY:-.venv/bin/python}; TRL_PY=${TRL_PY:-.venv-trl/bin/python}
LOG=out/bench; mkdir -p $LOG
S="--layers 4 --heads 4 --dim 256 --vocab 512 --prompt-len 16 --resp-len 48 --batch 64 --ppo-epochs 4 --mini-batches 4 --threads 2"
L="--layers 8 --heads 4 --dim 512 --vocab 8192 --prompt-len 16 --resp-len 48 --batch 64 --ppo-epochs 4 --mini-batches 4 --threads 2"
smollm2="--model-dir out/smollm2 --prompt-len 32 --resp-len 32 --batch 8 --ppo-epochs 1 --mini-batches 2 --threads 2"
for shape in $SHAPES; do
  flags=${!shape}; iters=ITERS_$shape; iters=${!iters}
  for run in $(seq 1 "$RUNS"); do
    TRL_EXPERIMENTAL_SILENCE=1 $TRL_PY bench/trl_ppo_bench.py $flags --iters "$iters" --quiet > $LOG/trl_${shape}_$run.txt 2>&1
    tail -n 1 $LOG/trl_${shape}_$run.txt
    $PY bench/ppo_throughput.py $flags --iters "$iters" > $LOG/ours_${shape}_$run.txt 2>&1
    tail -n 1 $LOG/ours_${shape}_$run.txt
  done
  gen=$(echo "$flags" | sed -E 's/--ppo-epochs [0-9]+ --mini-batches [0-9]+ //')
  gen=$(echo "$gen" | sed 's/--threads/--reps 5 --threads/')
  $PY bench/decode.py --vs-hf $gen > $LOG/generate_$shape.txt 2>&1; tail -n 1 $LOG/generate_$shape.txt
done
$PY bench/summarize_compare.py $LOG
