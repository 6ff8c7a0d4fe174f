#!/usr/bin/env bash
# The trainer's GPU check, in one script: what CPU CI cannot run.
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR]
#
# 1. the CUDA tests (those that skip without a GPU: fused AdamW after a DCP resume, the
#    delta found on the device);
# 2. the SmolLM2-1.7B shape loaded from a model directory (each process its rows), its step
#    with publishing and the asynchronous DCP stager, peak memory at start, step and resume,
#    the trainer as it was before (--before) beside it: bench/trainer_parallel.py;
# 3. a trainer SIGKILLed in a step and resumed from its DCP checkpoint on the GPU:
#    bench/gpu_resume.py;
# 4. NCCL with 2 processes (step 2 with --processes 1,2) where 2 GPUs are visible.
#
# --dry-run: every step on the CPU with the tiny shape and gloo (CI runs it:
# tests/bench/test_gpu_check.py), to keep the script working without a GPU. --out: where
# the JSON and logs go (default: a new temporary directory). Exits non-zero when a step
# fails; the last lines say which passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
dry=0
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out="$2"; shift ;;
    *) echo "gpu_check: unknown argument $1 (--dry-run, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
results=()
step() {  # name, command...: run it, its log in $out/<name>.log
  local name="$1"; shift
  echo "== $name: $*"
  if "$@" >"$out/$name.log" 2>&1; then
    results+=("ok      $name"); tail -n 3 "$out/$name.log"
  else
    results+=("FAILED  $name (log: $out/$name.log)"); tail -n 20 "$out/$name.log"
  fi
}

if [ "$dry" = 1 ]; then
  device=cpu; shape=tiny; procs=2; steps=1; extra=(--deadline-s 400)
  tests=(tests/unit/trainer/test_checkpoint_placement.py)
else
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no GPU (--dry-run runs the check on the CPU)" >&2
    exit 2
  fi
  device=cuda; shape=smollm2-1.7b; steps=3
  gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
  procs=1; [ "$gpus" -ge 2 ] && procs=1,2
  extra=(--autocast bf16 --gradient-checkpointing --micro-batch-size 64 --deadline-s 420)
  tests=(tests/unit/trainer/test_checkpoint_placement.py tests/unit/weights/test_device_delta.py
         tests/unit/trainer/test_fsdp.py)
fi

out="${out:-$(mktemp -d -t astraflow-gpu-check-XXXX)}"
mkdir -p "$out"

step cuda-tests "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
step trainer-parallel "$PY" bench/trainer_parallel.py --device "$device" --shape "$shape" \
  --from-disk --before --groups-only --processes "$procs" --steps "$steps" "${extra[@]}" \
  --out "$out/trainer_parallel-$device.json"
model="$out/resume-model"
"$PY" - "$shape" "$model" <<'PYEOF'
import sys
sys.path.insert(0, "bench")
import torch
from trainer_parallel import build_model
build_model(sys.argv[1], torch.device("cpu"), 0).save_pretrained(sys.argv[2])
PYEOF
step sigkill-resume "$PY" bench/gpu_resume.py --device "$device" --model "$model"
rm -rf "$model"

echo "== gpu_check ($device, processes $procs): results in $out"
printf '%s\n' "${results[@]}"
for r in "${results[@]}"; do
  case "$r" in FAILED*) exit 1 ;; esac
done
