# Set-up and entry points. Each target creates .venv when it is missing.
#   make demo   small GPT, PipeDream-2BW, 2 pipeline stages on 2 CPU processes
#   make test   the test suite (CPU, gloo)
#   make bench  schedules side by side on 2 CPU processes
#   make compare / make convergence   the paper's baseline table and Figure 5 on CPU

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TORCHRUN    := $(VENV)/bin/torchrun
# On a machine without a GPU the CPU build of torch is installed; clusters bring their own
# CUDA build (install it into the environment first, `pip install -e .` keeps it).
TORCH_CPU   ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test bench compare convergence data clean-venv

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_CPU)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

data: $(VENV)/.installed
	$(PY) -m megatron_2bw.data.default

demo: $(VENV)/.installed
	$(PY) scripts/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest tests -q

bench: $(VENV)/.installed
	$(PY) tools/bench_schedules.py --rounds 5 --json runs/bench/schedules.json

compare: $(VENV)/.installed
	$(PY) tools/compare.py

convergence: $(VENV)/.installed
	$(PY) tools/convergence.py

clean-venv:
	rm -rf $(VENV)
