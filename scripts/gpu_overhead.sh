#!/usr/bin/env bash
# What the tracker costs on a CUDA GPU: benchmarks/overhead.py with --device cuda on the demo GPT
# (256-token microbatches, the worst case: "auto" twice, every window measured once) and on the
# 10.8M GPT (every window measured). Each run's output goes to DIR/<name>.log (its last line is
# the JSON object); a run that fails is reported and the others still run.
#
#   scripts/gpu_overhead.sh [DIR]        # skips (exit 0) without CUDA; DIR defaults to a new temp folder
#   PYTHON=python3 scripts/gpu_overhead.sh out/
set -uo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python}"
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
bench demo_auto_1 "${demo[@]}" --measure-every auto
bench demo_auto_2 "${demo[@]}" --measure-every auto
bench demo_every "${demo[@]}" --attribution-steps 120
bench gpt10m_every --attribution-steps 30
echo "gpu_overhead: logs in $dir"
exit "$failed"
