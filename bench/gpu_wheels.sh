#!/usr/bin/env bash
# Wheels for the GPU machine, made here (it has no internet): what bench/gpu_check.sh needs that its image lacks,
# at the versions this project's .venv has (what `make test` tests), for that machine's Python (3.12, x86_64).
#
#   bash bench/gpu_wheels.sh [DEST]        # default bench/.gpu-wheels (git-ignored; carried, <= 64 MiB)
#
# The image (the device tool's KINDS.md) has torch, accelerate, numpy, pandas, pyarrow, matplotlib, pytest,
# huggingface-hub, tokenizers, safetensors, typer, rich, jinja2, narwhals, scipy...; it lacks pydantic,
# ruamel.yaml, deepspeed, trl, datasets and Great Expectations, and its transformers (5.17) and peft are not
# the versions tested here, so those come too. TRL 1.16.0, RLOO's second peer in bench/vs_trl.py, comes alone in
# DEST/trl116 (bench/gpu_check.sh installs it in a folder of its own, before TRL 1.9.0's environment).
# No Prefect, MLflow or DVC: the check runs every stage as DVC does
# (`rlhf stage`) with tracking off.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/bench/.gpu-wheels}
PY=${PYTHON:-$ROOT/.venv/bin/python}
TARGET_PY=${GPU_PYTHON_VERSION:-3.12}

PACKAGES=(
  pydantic pydantic-core annotated-types typing-inspection  # the typed params
  ruamel.yaml ruamel.yaml.clib                              # params.yaml round-trips
  transformers peft                                         # the versions tested here
  trl datasets dill multiprocess                            # TRL 1.9.0's side of bench/vs_trl.py
  hjson                                                     # deepspeed (built below: PyPI has only its sdist)
  great-expectations altair cryptography cffi pycparser jsonschema jsonschema-specifications referencing
  rpds-py marshmallow mistune tzlocal                       # the validate stage
)

installed_version() {
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
specs=()
for name in "${PACKAGES[@]}"; do
  specs+=("$name==$(installed_version "$name")")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$TARGET_PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST.tmp" "${specs[@]}"
# deepspeed is a pure-Python sdist whose setup imports torch: build it against this venv's torch, no ops compiled
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$DEST.tmp/trl116" "trl==1.16.0"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST.tmp" \
  "deepspeed==$(installed_version deepspeed)"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
du -sh "$DEST" | awk '{print "wheels: " $1 " in '"$DEST"'"}'
ls "$DEST" "$DEST/trl116"
