#!/usr/bin/env bash
# What the tracker costs on a CUDA GPU: benchmarks/overhead.py with --device cuda on the demo GPT
# (256-token microbatches, the worst case: "auto" twice, every window measured once) and on the
# 10.8M GPT (every window measured). Each run's output goes to DIR/<name>.log (its last line is
# the JSON object); a run that fails is reported and the others still run.
#
#   scripts/gpu_overhead.sh [DIR]        # skips (exit 0) without CUDA; DIR defaults to a new temp folder
#   PYTHON=python3 scripts/gpu_overhead.sh out/
#   GPU_OVERHEAD_ROWS=sizes scripts/gpu_overhead.sh   # the demo with labels= against size= numbers, "auto"
# The adapters install as cbs_tracker.integrations: install the package (pip install .) before running.
set -uo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python}"
rows="${GPU_OVERHEAD_ROWS:-all}"
if [[ "$rows" != all && "$rows" != sizes ]]; then
  echo "gpu_overhead: GPU_OVERHEAD_ROWS must be 'all' or 'sizes', not '$rows'" >&2
  exit 64
fi
dir="${1:-$(mktemp -d)}"
mkdir -p "$dir"
if [[ "$("$python" -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ]]; then
  echo "gpu_overhead: SKIPPED: no CUDA GPU visible; nothing was measured"
  exit 0
fi
"$python" -c 'import torch; print("gpu_overhead: torch", torch.__version__, "on", torch.cuda.get_device_name(0))'

failed=0
bench() {  # name args...
  local name="$1"; shift
  echo "gpu_overhead: $name: $python benchmarks/overhead.py --device cuda $* --json"
  if timeout 300 "$python" benchmarks/overhead.py --device cuda "$@" --json >"$dir/$name.log" 2>&1; then
    grep -v '^{' "$dir/$name.log" | sed 's/^/  /'
  else
    tail -n 30 "$dir/$name.log"
    echo "gpu_overhead: FAILED: $name"
    failed=1
  fi
}

demo=(--preset demo --seq-len 128 --micro-sequences 2)
case "$rows" in
  all)
    bench demo_auto_1 "${demo[@]}" --measure-every auto
    bench demo_auto_2 "${demo[@]}" --measure-every auto
    bench demo_every "${demo[@]}" --attribution-steps 120
    bench gpt10m_every --attribution-steps 30 ;;
  sizes)  # labels= against size= numbers, "auto" (a window not measured then reads nothing from the device)
    bench demo_auto_labels "${demo[@]}" --measure-every auto
    bench demo_auto_numbers_1 "${demo[@]}" --measure-every auto --sizes numbers
    bench demo_auto_numbers_2 "${demo[@]}" --measure-every auto --sizes numbers ;;
esac
echo "gpu_overhead: logs in $dir"
exit "$failed"
