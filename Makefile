# The README's two commands: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build of torch; installed first so that no later requirement pulls a CUDA build (several GB).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip install --quiet
# uv resolves and installs the project's ~200 packages in ~5 s where pip takes ~70 s (same pins); pip is the
# fallback when uv cannot be had or fails. torch stays with pip, installed first (STACK.md); uv keeps it.
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python
# Bytecode: nothing is compiled at install (all of site-packages is ~20k modules: 27 s with uv, 12 s for torch
# with pip); Python caches the ~3k modules the pipeline imports the first time it imports them (~6 s, once).
# Where a machine sets PYTHONDONTWRITEBYTECODE (this project's do), that cache is never written and every
# process start compiles them again (+6 s per pipeline stage): make's commands run without it.
unexport PYTHONDONTWRITEBYTECODE

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: setup run test test-slow test-gpu test-gpu-check test-server test-ui bench lint dvc-deps clean trl116

setup: $(STAMP)

# TRL 1.16.0 in its own venv, never a dependency of ours: tests/test_grpo.py runs its GRPO/RLOO loss there
# (tests/trl116_side.py) on inputs ours computed, to check both updates agree. The venv sees our packages (a .pth
# naming our site-packages: the same torch, transformers, accelerate and datasets, and ~40 s less than installing
# them again) under TRL 1.16.0 installed on its own, first on the path (our dev extra's TRL 1.9.0 stays behind
# it); `pip check` fails the target when that TRL needs other versions than ours. Rebuilt when pyproject.toml
# changes.
TRL116_VENV := .venv-trl116
TRL116_STAMP := $(TRL116_VENV)/.installed
purelib = $$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
trl116: $(TRL116_STAMP)
$(TRL116_STAMP): pyproject.toml | $(STAMP)
	rm -rf $(TRL116_VENV)
	$(PYTHON) -m venv --without-pip $(TRL116_VENV)
	echo "$(call purelib,$(abspath $(BIN))/python)" > "$(call purelib,$(TRL116_VENV)/bin/python)/ours.pth"
	$(BIN)/python -m pip install --quiet --no-compile --no-deps --target \
	  "$(call purelib,$(TRL116_VENV)/bin/python)" trl==1.16.0
	$(TRL116_VENV)/bin/python -m pip check
	$(TRL116_VENV)/bin/python -c 'import trl; assert trl.__version__ == "1.16.0", trl.__version__'
	touch $(TRL116_STAMP)

# Re-install only when the dependency list changes; a no-op when already set up.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) --no-compile "$(TORCH_SPEC)"
	$(PIP) "uv>=0.9,<1" || true
	test -x $(BIN)/uv && $(UV) -e ".[dev]" || $(PIP) --no-compile -e ".[dev]"
	touch $(STAMP)

# Extra arguments for the run, e.g. make run RUN_ARGS="--set prepare.world.conversational=true"
run: setup
	$(BIN)/rlhf run $(RUN_ARGS)

# Two pytest workers, one test file each at a time (pytest-xdist, --dist loadfile: a file's module fixtures, e.g.
# its Prefect server or reproduced repo, are built once): most tests wait on subprocesses, servers and files for
# much of their time, so two overlap on 2 cores. Files go out slowest first (tests/durations.json, kept in its
# order by --no-loadscope-reorder). PYTEST_WORKERS=0 runs them in this process, one after another.
# `make test` leaves out the long tier (marker `slow`: more whole-pipeline runs, sweeps and launches of what the
# suite already proves once), which `make test-slow` runs; CI (.ci/run) runs both.
PYTEST_WORKERS ?= 2
NOT_ELSEWHERE := not gpu and not gpu_check and not server and not ui
PYTEST_XDIST = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
test: setup trl116
	$(BIN)/python -m pytest -m "not slow and $(NOT_ELSEWHERE)" $(PYTEST_XDIST) $(PYTEST_ARGS)

test-slow: setup trl116
	$(BIN)/python -m pytest -m "slow and $(NOT_ELSEWHERE)" $(PYTEST_XDIST) $(PYTEST_ARGS)

# On a CUDA machine: Pythia-1B shapes in bf16 (PPO, RLOO, LoRA); prints episodes/s and peak memory.
test-gpu: setup
	$(BIN)/python -m pytest -m gpu -s $(PYTEST_ARGS)

# The GPU check's CPU dry run (tests/test_gpu_check.py, marker `gpu_check`): bench/gpu_check.sh's every part at tiny
# shapes, so that the one call on a lent GPU can fail only for a reason that needs a GPU. Run it before that call;
# it is the GPU suite's, not make test's (~3 min of both cores on a quiet machine, ~9 on a slow one).
test-gpu-check: setup trl116
	$(BIN)/python -m pytest -m gpu_check $(PYTEST_ARGS) tests/test_gpu_check.py

# The server stack live on loopback (docs/scaling-out.md): the server extra, PostgreSQL from Debian packages if
# missing, then infra/stack.sh up ... down inside tests/test_server.py, the pipeline on the stack's Ray cluster
# tests/test_server_ray.py and the load test tests/test_load.py (and the infra/ checks with their extras).
test-server: setup
	test -x $(BIN)/uv && $(UV) -e ".[server]" || $(PIP) -e ".[server]"
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || \
	  { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get install -y -q postgresql || \
	    { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q postgresql; }; }
	$(BIN)/python -m pytest -s $(PYTEST_ARGS) tests/test_infra.py tests/test_server.py tests/test_server_ray.py \
	  tests/test_load.py

# The Prefect and MLflow UIs and DVC's plots page in headless Chromium (tests/test_ui.py, marker `ui`): the ui extra
# (selenium), Debian's chromium and chromium-driver if missing; screenshots of each page in reports/ui/.
test-ui: setup
	test -x $(BIN)/uv && $(UV) -e ".[ui]" || $(PIP) -e ".[ui]"
	{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || \
	  { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get install -y -q chromium chromium-driver || \
	    { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium chromium-driver; }; }
	$(BIN)/python -m pytest -m ui $(PYTEST_ARGS) tests/test_ui.py

bench: setup
	$(BIN)/rlhf bench --algo ppo --json
	$(BIN)/rlhf bench --algo rloo --json

lint: setup
	$(BIN)/ruff check .

# dvc.yaml's code deps are generated from each stage's imports (tests/test_code_deps.py fails when stale).
dvc-deps: setup
	$(BIN)/python -m tasks.dag.code_deps --write

clean:
	rm -rf $(VENV) .pytest_cache
