#!/usr/bin/env bash
# GPU check: the pipeline on CUDA with bf16 autocast and torch.compile, then the PPO iteration
# benchmark at GPT-2-small shape. Prints tokens/s and MFU per stage (from each stage's TensorBoard perf/* tags) and
# the benchmark's phase breakdown. About 4 minutes on one H200 for the pipeline, about 3 more for the benchmark.
#
# Constraints (docs/design.md §7): the system python3 (torch >= 2.11, transformers, tiktoken, tensorboard, numpy present),
# no network, no venv. tyro and its pure-Python dependencies travel as wheels in .whl/ beside the repo: run
# `make wheels` on a machine with network first (wheels are zip files; they go on PYTHONPATH as they are).
#
#   bash bench/gpu_check.sh              # pipeline + scale + benchmark
#   bash bench/gpu_check.sh pipeline     # pipeline only
#   bash bench/gpu_check.sh scale        # on the pipeline's checkpoints: PPO with LoRA, then bf16 FSDP2 on
#                                        # one rank (the multi-rank paths are tested on CPU)
#   bash bench/gpu_check.sh bench        # benchmark only
#   bash bench/gpu_check.sh real         # make real's chain on SmolLM2-135M (needs MODEL_DIR, default out/smollm2,
#                                        # from `make smollm2`, and vaderSentiment, a pure-Python wheel: `make wheels`)
#   bash bench/gpu_check.sh fast         # at most 5 minutes (300 s of section timeouts): versions, then eager
#                                        # against compiled decode (tokens/s, HBM bandwidth) at GPT-2-small and
#                                        # Llama-1B shapes, the PPO update's MFU and the compiles at Llama-1B shape
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/gpu_check}
WHAT=${1:-all}
export PYTHONPATH="$(ls "$PWD"/.whl/*.whl 2>/dev/null | tr '\n' ':')${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
$PY -c "import tyro" 2>/dev/null || { echo "gpu_check: tyro is missing: run 'make wheels' where there is network and carry .whl/"; exit 2; }
$PY - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check: no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: torch {torch.__version__}, {p.name}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)")
PY
COMMON="--device cuda --dtype bfloat16 --task-dir $OUT/data"

if [ "$WHAT" = fast ]; then
  $PY - <<'PY'
import subprocess, torch, transformers
print(f"gpu_check fast: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")
print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip())
PY
  section() {  # name, seconds, command...: a section that runs past its time is cut and reported, the next runs
    local name=$1 limit=$2; shift 2
    echo "gpu_check fast: [$name] (at most $limit s)"
    timeout "$limit" "$@" || echo "gpu_check fast: [$name] stopped with status $? (124 = out of time)"
  }
  GPT2="--layers 12 --heads 12 --dim 768 --vocab 50257 --n-positions 1024"
  LLAMA1B="--arch llama --layers 16 --heads 32 --kv-heads 8 --dim 2048 --intermediate 8192 --vocab 128256 \
      --n-positions 1024"
  # decode: bf16 weights (the rollout's sampler copy: the bytes a decode must read), and Llama's fp32 weights under
  # autocast (the rollout before the bf16 copy)
  section decode-gpt2 40 $PY bench/decode.py --device cuda --dtype bfloat16 --weights bf16 $GPT2 --batch 64 \
      --prompt-len 64 --resp-len 128 --threads 8
  section decode-llama1b 60 $PY bench/decode.py --device cuda --dtype bfloat16 --weights bf16 $LLAMA1B --batch 64 \
      --prompt-len 128 --resp-len 256 --threads 8
  section decode-llama1b-fp32-weights 40 $PY bench/decode.py --device cuda --dtype bfloat16 --weights fp32 \
      $LLAMA1B --batch 64 --prompt-len 128 --resp-len 256 --reps 2 --threads 8
  # the update's MFU ([result] update ... % of peak), eager then compiled (training forward and decode step); the
  # reference and RM stored in bf16 and the rollouts from a bf16 copy of the actor, as the stages under bf16: the
  # decode's weight bytes a step, its GB/s ([result] decode traffic), and the compiled frames and graphs
  PPO1B="$LLAMA1B --batch 64 --prompt-len 128 --resp-len 128 --iters 3 --mini-batches 2 --micro-batch 16 \
      --ppo-epochs 1 --threads 8 --device cuda --dtype bfloat16"
  section update-llama1b-eager 60 $PY bench/ppo_throughput.py $PPO1B
  section update-llama1b-compiled 100 $PY bench/ppo_throughput.py $PPO1B --compile
  exit 0
fi

if [ "$WHAT" = all ] || [ "$WHAT" = pipeline ]; then
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

if [ "$WHAT" = all ] || [ "$WHAT" = scale ]; then
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

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  # GPT-2-small shape, batch 64, response 128, bf16 autocast, compiled training forward
  $PY bench/ppo_throughput.py --device cuda --dtype bfloat16 --compile --layers 12 --heads 12 --dim 768 \
      --vocab 50257 --prompt-len 64 --resp-len 128 --batch 64 --iters 6 --threads 8
fi
