#!/usr/bin/env bash
# The GPU check: one call that proves the runtime on a GPU and measures it, within 8 minutes on one H100 or H200.
#
#   bash bench/gpu_wheels.sh                  # here, once: wheels the GPU machine lacks (bench/.gpu-wheels)
#   OUT=/some/dir bash bench/gpu_check.sh     # there (carry bench/.gpu-wheels): figures in $OUT
#   bash bench/gpu_check.sh --cpu-dry-run     # here: the same script at tiny shapes on the CPU (make test runs it)
#
# Parts, in order, each under its own time limit; a part that fails or runs out is recorded and the next one runs:
#   env        versions and the device
#   vs_trl     ours against TRL 1.9.0 side by side: PPO and RLOO, one pair, 3 steady updates (bench/vs_trl.py)
#   decode     the rollout's decode loop, eager and with CUDA graphs, against generate (bench/decode_loop.py)
#   gpu_tests  the gpu-marked tests: PPO/RLOO full and LoRA in bf16 at lr 0, DeepSpeed ZeRO-2/3 one-process launches
#   pipeline   every stage (`rlhf stage`) of tldr-pythia-1b on local random-weight models and generated data
# A rerun of some parts only (a second, shorter call): GPU_CHECK_PARTS="vs_trl gpu_tests", GPU_CHECK_ALGOS="rloo"
# (vs_trl), GPU_CHECK_TESTS="deepspeed and rloo" (pytest -k), GPU_CHECK_LIMITS="env=20 vs_trl=100 gpu_tests=150".
# After every part $OUT/gpu_check.json and $OUT/gpu_check.md are rewritten (bench/gpu_report.py), so a call cut
# short still returns what finished; $OUT/gpu_check.log holds each part's output.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

DRY_RUN=0
[[ "${1:-}" == "--cpu-dry-run" ]] && DRY_RUN=1
OUT=${OUT:-$ROOT/bench/.gpu-check}
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$OUT"
rm -f "$OUT"/gpu_check.{json,md,log}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 RLHF_SYSTEM_METRICS=off RLHF_GPU_CHECK_OUT=$WORK
if (( DRY_RUN )); then
  # no GPU, whatever the machine has; tiny shapes (tests/test_gpu.py, bench/vs_trl.py's "dry-run")
  export CUDA_VISIBLE_DEVICES="" RLHF_GPU_CHECK=cpu-dry-run DS_ACCELERATOR=cpu
  # a rehearsal of the parts, not of the GPU's time budget: limits a busy 2-core machine (make test runs two test
  # files at once) stays inside; vs_trl and gpu_tests took 120-150 s alone and ran out beside another test
  LIMITS=(env=120 vs_trl=420 decode=120 gpu_tests=420 pipeline=300)
  VS_TRL=(--device cpu --shapes dry-run --updates 3)
  DECODE=(--device cpu --shapes dry-run --repeats 2)
  PIPELINE=(--shapes dry-run --updates 2 --rows 200)
else
  LIMITS=(env=20 vs_trl=130 decode=100 gpu_tests=140 pipeline=90)
  VS_TRL=(--device cuda --shapes pythia-1b --updates 4)
  DECODE=(--device cuda --shapes pythia-1b --repeats 5)
  PIPELINE=(--shapes pythia-1b --updates 2 --rows 400)
fi
[[ -n ${GPU_CHECK_LIMITS:-} ]] && read -ra LIMITS <<<"$GPU_CHECK_LIMITS"  # e.g. "env=20 vs_trl=100 gpu_tests=150"
limit() { local kv; for kv in "${LIMITS[@]}"; do [[ ${kv%%=*} == "$1" ]] && echo "${kv#*=}"; done; }

# the wheels are for the GPU machine's Python: a dry run uses this machine's environment as it is
WHEELS=${GPU_WHEELS:-$( (( DRY_RUN )) || echo "$ROOT/bench/.gpu-wheels")}
if [[ -n "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  # the carried wheels take precedence over the image's packages (the versions tested here)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$WHEELS"/*.whl || echo "gpu_check: installing the wheels failed" >&2
  export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

PARTS=" ${GPU_CHECK_PARTS:-vs_trl decode gpu_tests pipeline} "
part() {  # part NAME COMMAND...: run it under its limit, log it, record exit and seconds, refresh the report
  local name=$1 start rc; shift
  [[ $name == env || $PARTS == *" $name "* ]] || return 0
  start=$(date +%s%N)
  echo "== $name (limit $(limit "$name") s): $*" | tee -a "$OUT/gpu_check.log"
  timeout --kill-after=15 "$(limit "$name")" "$@" >>"$OUT/gpu_check.log" 2>&1
  rc=$?
  printf '{"part": "%s", "exit": %d, "seconds": %s, "limit_s": %s}\n' "$name" "$rc" \
    "$(( ($(date +%s%N) - start) / 1000000000 ))" "$(limit "$name")" >>"$WORK/parts.jsonl"
  echo "== $name: exit $rc" | tee -a "$OUT/gpu_check.log"
  "$PY" bench/gpu_report.py "$WORK" "$OUT" --dry-run "$DRY_RUN" >/dev/null 2>>"$OUT/gpu_check.log"
}

part env "$PY" bench/gpu_report.py --environment "$WORK/environment.json"
part vs_trl "$PY" bench/vs_trl.py "${VS_TRL[@]}" --algos ${GPU_CHECK_ALGOS:-ppo rloo} --pairs 1 --trl-python "$PY" --trl-pythonpath "$PYTHONPATH" \
  --json "$WORK/vs_trl.json"
part decode "$PY" bench/decode_loop.py "${DECODE[@]}" --json "$WORK/decode.json"
part gpu_tests "$PY" -m pytest -m gpu tests/test_gpu.py -k "${GPU_CHECK_TESTS:-}" -v -s -p no:cacheprovider \
  --junitxml="$WORK/gpu_tests.xml"
part pipeline "$PY" bench/gpu_pipeline.py "$WORK/pipeline" "${PIPELINE[@]}" --timeout "$(( $(limit pipeline) - 10 ))" \
  --json "$WORK/pipeline.json"

"$PY" bench/gpu_report.py "$WORK" "$OUT" --dry-run "$DRY_RUN"
status=$?
rm -rf "$WORK"
exit $status
