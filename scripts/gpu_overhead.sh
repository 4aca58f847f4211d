#!/usr/bin/env bash
# What the tracker costs on a CUDA GPU: benchmarks/overhead.py with --device cuda on the demo GPT
# (256-token microbatches, the worst case: "auto" twice, every window measured once) and on the
# 10.8M GPT (every window measured). Each run's output goes to DIR/<name>.log (its last line is
# the JSON object); a run that fails is reported and the others still run.
#
#   scripts/gpu_overhead.sh [DIR]        # skips (exit 0) without CUDA; DIR defaults to a new temp folder
#   PYTHON=python3 scripts/gpu_overhead.sh out/
#   GPU_OVERHEAD_ROWS=sizes scripts/gpu_overhead.sh   # the demo with labels= against size= numbers, "auto"
#   GPU_OVERHEAD_ROWS=gpt2 scripts/gpu_overhead.sh DIR # GPT-2 small then medium (bf16 autocast, fused AdamW,
#       8,192-token microbatches, 4 per step): every window measured, measure_every="auto", and one window in
#       8 measured (an unmeasured window's own cost); within GPU_OVERHEAD_BUDGET_S (default 470 s) in all
# Every row's JSON object is also appended to DIR/results.jsonl (with "row": its name) and printed.
# The adapters install as cbs_tracker.integrations: install the package (pip install .) before running.
set -uo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python}"
rows="${GPU_OVERHEAD_ROWS:-all}"
if [[ "$rows" != all && "$rows" != sizes && "$rows" != gpt2 ]]; then
  echo "gpu_overhead: GPU_OVERHEAD_ROWS must be 'all', 'sizes' or 'gpt2', not '$rows'" >&2
  exit 64
fi
dir="${1:-$(mktemp -d)}"
mkdir -p "$dir"
if [[ "$("$python" -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ]]; then
  echo "gpu_overhead: SKIPPED: no CUDA GPU visible; nothing was measured"
  exit 0
fi
"$python" -c 'import torch; print("gpu_overhead: torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
budget="${GPU_OVERHEAD_BUDGET_S:-470}"
if ! [[ "$budget" =~ ^[0-9]+$ ]] || (( budget < 30 )); then
  echo "gpu_overhead: GPU_OVERHEAD_BUDGET_S must be a whole number of seconds >= 30, not '$budget'" >&2
  exit 64
fi
start=$SECONDS

failed=0
limit=300
bench() {  # name args...   (a row gets at most $limit seconds and what is left of the budget)
  local name="$1"; shift
  local left=$(( budget - (SECONDS - start) ))
  local cap=$(( left < limit ? left : limit ))
  if (( cap < 20 )); then
    echo "gpu_overhead: SKIPPED: $name: the budget of ${budget}s is spent"
    failed=1
    return
  fi
  echo "gpu_overhead: $name (at most ${cap}s): $python benchmarks/overhead.py --device cuda $* --json"
  if timeout "$cap" "$python" benchmarks/overhead.py --device cuda "$@" --json >"$dir/$name.log" 2>&1; then
    grep -v '^{' "$dir/$name.log" | sed 's/^/  /'
    local line
    line="$(grep '^{' "$dir/$name.log" | tail -n 1)"
    if [[ -n "$line" ]]; then
      echo "{\"row\": \"$name\", ${line#\{}" | tee -a "$dir/results.jsonl"
    fi
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
  gpt2)  # the preset's run (1,024 context, 8 x 1,024 tokens, 4 microbatches, bf16, fused AdamW); fewer rounds
    for preset in gpt2-small gpt2-medium; do
      [[ $preset == gpt2-small ]] && limit=110 || limit=170
      short=(--preset "$preset" --memory-steps 2 --warmup 2)
      bench "${preset}_every" "${short[@]}" --measure-every 1 --rounds 4 --attribution-steps 20
      bench "${preset}_unmeasured" "${short[@]}" --measure-every 8 --rounds 2 --attribution-steps 24
      bench "${preset}_auto" "${short[@]}" --measure-every auto --rounds 2 --attribution-steps 20
    done ;;
esac
echo "gpu_overhead: $(( SECONDS - start ))s of the ${budget}s budget"
echo "gpu_overhead: logs in $dir"
exit "$failed"
