#!/usr/bin/env bash
# GPU check: what only a GPU run sees (torch.compile, bf16 autocast and CUDA graphs arrive together there), in
# sections with their own timeouts, each ending in a table of what passed with its figures.
#
# Constraints (docs/design.md §7): the system python3 (torch >= 2.11, transformers, tiktoken, tensorboard, numpy present),
# no network, no venv. tyro and its pure-Python dependencies travel as wheels in .whl/ beside the repo: run
# `make wheels` on a machine with network first (wheels are zip files; they go on PYTHONPATH as they are).
#
#   bash bench/gpu_check.sh              # all: fast, rl, then multiturn (at most 600 s of section timeouts)
#   bash bench/gpu_check.sh fast         # at most 300 s: versions; compiled against eager greedy decoding, token for
#                                        # token (fp32, then bf16); eager against compiled decode (tokens/s, HBM
#                                        # bandwidth) at GPT-2-small and Llama-1B shapes; the PPO update's MFU and
#                                        # the compiles at Llama-1B shape
#   bash bench/gpu_check.sh rl           # at most 240 s: bench/rl_check.py, the critic-free stage (GRPO, GSPO, CISPO,
#                                        # distillation, VinePPO, dynamic sampling) in bf16 and compiled, GRPO in fp32
#                                        # against the 1e-3 log-prob bound, a SIGKILL and --resume held bit-equal
#   bash bench/gpu_check.sh multiturn    # at most 60 s: experiments/multiturn.py --tiny, the guessing game's SFT, then
#                                        # PPO-max, GRPO and RLOO over its episodes, compiled, and eval.py's episodes
#   bash bench/gpu_check.sh long         # pipeline + scale + bench (about 10 minutes on one H200)
#   bash bench/gpu_check.sh pipeline     # SFT, RM, DPO, PPO and eval at GPT-2-small width, tokens/s and MFU per stage
#   bash bench/gpu_check.sh scale        # on the pipeline's checkpoints: PPO with LoRA, then bf16 FSDP2 on
#                                        # one rank (the multi-rank paths are tested on CPU)
#   bash bench/gpu_check.sh bench        # the PPO iteration benchmark at GPT-2-small shape
#   bash bench/gpu_check.sh real         # make real's chain on SmolLM2-135M (needs MODEL_DIR, default out/smollm2,
#                                        # from `make smollm2`, and vaderSentiment, a pure-Python wheel: `make wheels`)
#
# DEVICE=cpu runs fast and rl on the CPU at the same sizes, as a stand-in (DEVICE=auto, the default, takes the GPU
# when there is one): compile stays off where --compile auto leaves it off, the greedy check compiles with
# inductor's CPU backend, and the throughput checks are skipped (their sizes are set for a GPU's seconds, and four
# 1 B models do not fit a small host). TIME_SCALE=10 multiplies every timeout, for a CPU slower than the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/gpu_check}
WHAT=${1:-all}
export PYTHONPATH="$(ls "$PWD"/.whl/*.whl 2>/dev/null | tr '\n' ':')${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
$PY -c "import tyro" 2>/dev/null || { echo "gpu_check: tyro is missing: run 'make wheels' where there is network and carry .whl/"; exit 2; }
DEVICE=$(DEVICE=${DEVICE:-auto} $PY - <<'PY'
import os, subprocess, sys, torch, transformers
device = os.environ["DEVICE"]
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
assert device == "cpu" or torch.cuda.is_available(), "gpu_check: no CUDA device (DEVICE=cpu runs the stand-in)"
card = "cpu"
if device == "cuda":
    p = torch.cuda.get_device_properties(0)
    card = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}"
    smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    card += ", " + subprocess.run(smi, capture_output=True, text=True).stdout.strip()
print(f"gpu_check: torch {torch.__version__}, transformers {transformers.__version__}, {card}", file=sys.stderr)
print(device)
PY
)
THREADS=8
[ "$DEVICE" = cpu ] && THREADS=${OMP_NUM_THREADS:-2}
TIME_SCALE=${TIME_SCALE:-1}
FAILED=0
COMMON="--device $DEVICE --dtype bfloat16 --task-dir $OUT/data"
mkdir -p "$OUT/logs"

# a section's checks: each under its own timeout, its output in $OUT/logs/<name>.log and on the console; a check
# that fails or runs past its time is a row of the table, and the next one runs
ROWS=()
check() {  # name, seconds, command...
  local name=$1 limit=$(($2 * TIME_SCALE)) start=$SECONDS status
  shift 2
  echo "gpu_check $WHAT: [$name] (at most $limit s)"
  set +e
  timeout "$limit" "$@" 2>&1 | tee "$OUT/logs/$name.log"
  status=${PIPESTATUS[0]}
  set -e
  local result=pass
  [ "$status" = 0 ] || { result="FAIL ($status)"; FAILED=1; }
  [ "$status" = 124 ] && result="out of time"
  # the figures: the check's own last line
  ROWS+=("$(printf '%-28s %-12s %5d s  %s' "$name" "$result" $((SECONDS - start)) "$(tail -n 1 "$OUT/logs/$name.log" | cut -c1-160)")")
}
skip() {  # name, why
  ROWS+=("$(printf '%-28s %-12s %5s    %s' "$1" skipped - "$2")")
}
table() {  # the section's rows, then its wall time
  echo
  echo "gpu_check $1 on $DEVICE: $(printf '%-28s %-12s %7s  %s' check result seconds figures)"
  for row in "${ROWS[@]}"; do echo "gpu_check $1 on $DEVICE: $row"; done
  ROWS=()
}

if [ "$WHAT" = all ] || [ "$WHAT" = fast ]; then
  t0=$SECONDS
  GPT2="--layers 12 --heads 12 --dim 768 --vocab 50257 --n-positions 1024"
  LLAMA1B="--arch llama --layers 16 --heads 32 --kv-heads 8 --dim 2048 --intermediate 8192 --vocab 128256 \
      --n-positions 1024"
  # compiled against eager greedy decoding, token for token: fp32 (no TF32) must agree exactly; bf16 may flip a
  # random model's near-flat ties, so a divergence within 0.1 of the eager forward's logits is counted, not failed
  check greedy-gpt2-fp32 25 $PY bench/decode.py --greedy-check --device $DEVICE --dtype float32 --weights fp32 $GPT2 \
      --batch 16 --prompt-len 32 --resp-len 64 --threads $THREADS
  check greedy-gpt2-bf16 25 $PY bench/decode.py --greedy-check --tie-margin 0.1 --device $DEVICE --dtype bfloat16 \
      --weights bf16 $GPT2 --batch 16 --prompt-len 32 --resp-len 64 --threads $THREADS
  # the update's MFU ([result] update ... % of peak), eager then compiled (training forward and decode step); the
  # reference and RM stored in bf16 and the rollouts from a bf16 copy of the actor, as the stages under bf16: the
  # decode's weight bytes a step, its GB/s ([result] decode traffic), and the compiled frames and graphs
  PPO1B="$LLAMA1B --batch 64 --prompt-len 128 --resp-len 128 --iters 3 --mini-batches 2 --micro-batch 16 \
      --ppo-epochs 1 --threads $THREADS --device $DEVICE --dtype bfloat16"
  if [ "$DEVICE" = cuda ]; then
    # decode: bf16 weights (the rollout's sampler copy: the bytes a decode must read), and Llama's fp32 weights under
    # autocast (the rollout before the bf16 copy)
    check decode-gpt2 35 $PY bench/decode.py --device $DEVICE --dtype bfloat16 --weights bf16 $GPT2 --batch 64 \
        --prompt-len 64 --resp-len 128 --threads $THREADS
    check decode-llama1b 50 $PY bench/decode.py --device cuda --dtype bfloat16 --weights bf16 $LLAMA1B --batch 64 \
        --prompt-len 128 --resp-len 256 --threads $THREADS
    check decode-llama1b-fp32-weights 30 $PY bench/decode.py --device cuda --dtype bfloat16 --weights fp32 \
        $LLAMA1B --batch 64 --prompt-len 128 --resp-len 256 --reps 2 --threads $THREADS
    check update-llama1b-eager 45 $PY bench/ppo_throughput.py $PPO1B
    check update-llama1b-compiled 90 $PY bench/ppo_throughput.py $PPO1B --compile
  else
    for name in decode-gpt2 decode-llama1b decode-llama1b-fp32-weights update-llama1b-eager update-llama1b-compiled; do
      skip $name "throughput at a GPU's sizes: GPU only"
    done
  fi
  table fast
  echo "gpu_check fast: $((SECONDS - t0)) s"
fi

if [ "$WHAT" = all ] || [ "$WHAT" = rl ]; then
  t0=$SECONDS
  # the critic-free stage; rl_check.py stops its runs at 230 s so its own table (one row a run) prints in time
  check rl 240 $PY bench/rl_check.py --device $DEVICE --out-dir "$OUT/rl" --task-dir "$OUT/data" \
      --limit $((230 * TIME_SCALE)) --share-scale $TIME_SCALE
  table rl
  echo "gpu_check rl: $((SECONDS - t0)) s"
fi

if [ "$WHAT" = all ] || [ "$WHAT" = multiturn ]; then
  t0=$SECONDS
  # the multi-turn chain at tiny sizes (experiments/multiturn.py --tiny): SFT on the guessing game's episodes, then
  # PPO-max, GRPO and RLOO over its environment side by side (--compile auto and the stages' dtype: the episode
  # decode's context-long static cache compiled once for every turn), eval.py's episodes against the optimum; then
  # every policy's row read back, its success and KL finite
  rm -rf "$OUT/multiturn"
  check multiturn 55 $PY experiments/multiturn.py --tiny --jobs 3 --out-dir "$OUT/multiturn" --task-dir "$OUT/data"
  check multiturn-results 5 $PY - "$OUT/multiturn/results.json" <<'PY'
import json, math, sys
results = json.load(open(sys.argv[1]))
rows = {name: results[name] for name in ("sft", "ppo", "grpo", "rloo")}
bad = [name for name, row in rows.items() if not all(math.isfinite(row[key]) for key in ("success", "kl", "turns"))]
assert not bad, f"not finite: {bad}"
print(" | ".join(f"{name} success {row['success']:.3f} kl {row['kl']:.2f}" for name, row in rows.items()))
PY
  table multiturn
  echo "gpu_check multiturn: $((SECONDS - t0)) s"
fi

if [ "$FAILED" != 0 ]; then
  echo "gpu_check: a check failed (the tables above; logs in $OUT/logs)"
  exit 1
fi

if [ "$WHAT" = long ] || [ "$WHAT" = pipeline ]; then
  rm -rf "$OUT/sft" "$OUT/rm" "$OUT/dpo" "$OUT/ppo"
  t0=$(date +%s)
  # a GPT-2-small-width model on the built-in task: big enough for the GPU to matter, small enough for minutes
  $PY train_sft.py $COMMON --out-dir $OUT/sft --n-layer 12 --n-head 12 --n-embd 768 --batch-size 64 \
      --micro-batch-size 64 --max-steps 300 --eval-every 300 --num-samples 64 --log-every 50
  $PY train_rm.py $COMMON --out-dir $OUT/rm --init $OUT/sft/ckpt.pt --max-steps 100 --eval-every 100 \
      --eval-pairs 512 --log-every 25
  $PY train_dpo.py $COMMON --out-dir $OUT/dpo --init $OUT/sft/ckpt.pt --max-steps 50 --eval-every 50 \
      --num-samples 64 --log-every 10
  $PY train_ppo.py $COMMON --out-dir $OUT/ppo --sft-ckpt $OUT/sft/ckpt.pt --rm-ckpt $OUT/rm/ckpt.pt \
      --max-steps 30 --rollout-batch-size 256 --micro-batch-size 64 --log-every 5 --sample-every 10
  $PY eval.py --device cuda --task-dir $OUT/data --policy $OUT/sft/ckpt.pt $OUT/dpo/ckpt.pt $OUT/ppo/ckpt.pt --names sft dpo ppo \
      --ref $OUT/sft/ckpt.pt --rm $OUT/rm/ckpt.pt --num-samples 256 --seeds 2
  echo "gpu_check: pipeline wall $(( $(date +%s) - t0 )) s"
  $PY - "$OUT" <<'PY'
import statistics, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for stage in ("sft", "rm", "dpo", "ppo"):
    acc = EventAccumulator(f"{sys.argv[1]}/{stage}", size_guidance={"scalars": 0}); acc.Reload()
    get = lambda tag: [e.value for e in acc.Scalars(tag)][1:] or [e.value for e in acc.Scalars(tag)]  # skip compile
    print(f"gpu_check: {stage:3s} tokens/s {statistics.median(get('perf/tokens_per_sec')):,.0f}  "
          f"mfu {100 * statistics.median(get('perf/mfu')):.1f}% (median over logged steps, first dropped)")
PY
fi

if [ "$WHAT" = long ] || [ "$WHAT" = scale ]; then
  # LoRA (reference and RM as views of the actor's and critic's bases, the tied embedding adapter among the
  # targets, --grad-ckpt), then --fsdp on one rank under bf16 (MixedPrecisionPolicy; --compile auto compiles there
  # too); peak memory of each
  rm -rf "$OUT/ppo_lora" "$OUT/ppo_fsdp"
  PPO_SCALE="--sft-ckpt $OUT/sft/ckpt.pt --rm-ckpt $OUT/rm/ckpt.pt --max-steps 10 --rollout-batch-size 256 \
      --micro-batch-size 64 --log-every 5 --sample-every 10"
  $PY train_ppo.py $COMMON --out-dir $OUT/ppo_lora $PPO_SCALE --lora-rank 8 --lora-targets c_attn c_proj c_fc wte \
      --grad-ckpt
  $PY -m torch.distributed.run --standalone --nproc_per_node 1 train_ppo.py $COMMON --out-dir $OUT/ppo_fsdp \
      $PPO_SCALE --fsdp
  $PY eval.py --device cuda --task-dir $OUT/data --policy $OUT/ppo_lora/ckpt.pt $OUT/ppo_fsdp/ckpt.pt \
      --names ppo_lora ppo_fsdp --ref $OUT/sft/ckpt.pt --rm $OUT/rm/ckpt.pt --num-samples 256
fi

if [ "$WHAT" = real ]; then
  # the real model's chain at make real's sizes (experiments/real.py: pairs, RM, PPO on the RM and on VADER, eval);
  # every stage picks the GPU by itself (--device auto) and bf16 autocast (--dtype auto)
  MODEL_DIR=${MODEL_DIR:-out/smollm2}
  [ -f "$MODEL_DIR/model.safetensors" ] || { echo "gpu_check real: no $MODEL_DIR: run 'make smollm2' and carry it"; exit 2; }
  # vaderSentiment reads its lexicon from its own folder: unzipped, not imported from the wheel
  for wheel in .whl/vaderSentiment-*.whl; do [ -f "$wheel" ] && $PY -m zipfile -e "$wheel" "$OUT/site"; done
  export PYTHONPATH="$OUT/site:$PYTHONPATH"
  $PY -c "import vaderSentiment" 2>/dev/null || { echo "gpu_check real: vaderSentiment is missing: 'make wheels'"; exit 2; }
  rm -rf "$OUT/real"
  t0=$(date +%s)
  $PY experiments/real.py --model-dir "$MODEL_DIR" --out-dir "$OUT/real"
  echo "gpu_check: real wall $(( $(date +%s) - t0 )) s"
fi

if [ "$WHAT" = long ] || [ "$WHAT" = bench ]; then
  # GPT-2-small shape, batch 64, response 128, bf16 autocast, compiled training forward
  $PY bench/ppo_throughput.py --device cuda --dtype bfloat16 --compile --layers 12 --heads 12 --dim 768 \
      --vocab 50257 --prompt-len 64 --resp-len 128 --batch 64 --iters 6 --threads 8
fi
