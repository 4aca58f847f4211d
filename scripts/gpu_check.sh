#!/usr/bin/env bash
# GPU check: the torchrun examples (DDP, FSDP2, FSDP2 bf16 + reduce every microbatch)
# with the NCCL backend, shortened as in tests/test_torchrun_examples.py, plus the
# DDP vs FSDP2 cross-check of the measured noise scale.
#
#   scripts/gpu_check.sh                 # NCCL on up to 2 GPUs; skips (exit 0) without CUDA
#   scripts/gpu_check.sh --require-gpu   # same, but a missing GPU is a failure (exit 2)
#   GPU_CHECK_BACKEND=gloo scripts/gpu_check.sh   # exercise this script on CPU
#
# NCCL needs one GPU per rank: with one GPU the runs use one rank (D=1, A=2).
set -euo pipefail
cd "$(dirname "$0")/.."

require_gpu=0
for arg in "$@"; do
  case "$arg" in
    --require-gpu) require_gpu=1 ;;
    *) echo "gpu_check: unknown argument $arg (allowed: --require-gpu)" >&2; exit 64 ;;
  esac
done

backend="${GPU_CHECK_BACKEND:-nccl}"
python="${PYTHON:-python}"
if [[ "$backend" == "nccl" ]]; then
  ngpu="$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  if [[ "$ngpu" -lt 1 ]]; then
    echo "gpu_check: SKIPPED: no CUDA GPU visible (torch.cuda.is_available() is False);"
    echo "gpu_check: the NCCL checks did NOT run. On CPU the same runs are tests/test_torchrun_examples.py (gloo)."
    [[ "$require_gpu" == 1 ]] && exit 2
    exit 0
  fi
  nproc=$(( ngpu < 2 ? ngpu : 2 ))
  echo "gpu_check: $ngpu CUDA GPU(s) visible, running $nproc rank(s) with NCCL"
else
  nproc=2
  echo "gpu_check: backend $backend (script self-test, not a GPU check), $nproc ranks"
fi

short=(--backend "$backend" --steps 12 --micro-sequences 1 --seq-len 64 --max-bytes 2000000 --print-every 4)
export OMP_NUM_THREADS=1
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT

run() {  # name script args...
  local name="$1"; shift
  echo "gpu_check: $name"
  if ! timeout 600 "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$@" "${short[@]}" \
      >"$log/$name.out" 2>&1; then
    tail -n 40 "$log/$name.out"
    echo "gpu_check: FAILED: $name"
    exit 1
  fi
  local done_line
  done_line="$(grep '^done:' "$log/$name.out" || true)"
  if [[ -z "$done_line" || "$done_line" != *"noise scale "[0-9]* ]]; then
    tail -n 40 "$log/$name.out"
    echo "gpu_check: FAILED: $name printed no measured noise scale"
    exit 1
  fi
  echo "  $done_line"
}

run ddp examples/torchrun_ddp.py
run fsdp examples/torchrun_fsdp.py
run fsdp_bf16_every examples/torchrun_fsdp.py --bf16 --gradient-sync every

"$python" - "$log/ddp.out" "$log/fsdp.out" <<'EOF'
import re, sys
ns = []
for path in sys.argv[1:]:
    m = re.search(r"noise scale ([\d,]+) tokens", open(path).read())
    ns.append(float(m.group(1).replace(",", "")))
ddp, fsdp = ns
if abs(fsdp - ddp) > 0.02 * ddp + 1:
    sys.exit(f"gpu_check: FAILED: FSDP2 noise scale {fsdp:g} differs from DDP's {ddp:g}")
print(f"gpu_check: DDP and FSDP2 agree (noise scale {ddp:g} vs {fsdp:g} tokens)")
EOF
echo "gpu_check: PASSED ($backend, $nproc rank(s))"
