# Set-up and entry points. Each target creates .venv when it is missing.
#   make demo   small GPT, PipeDream-2BW, 2 pipeline stages on 2 CPU processes
#   make test   the test suite (CPU, gloo; the Slurm tests where Slurm is installed);
#               TEST_ARGS adds pytest arguments
#   make test-fast   unit tests and one exactness run per schedule, while working
#   make test-slurm   the Slurm tests alone on a throwaway 2-node Slurm (root, Slurm's packages:
#               docs/slurm.md)
#   make bench  schedules side by side on 2 CPU processes
#   make bench-splits   even against the planner's layer split at vocabulary 32,000 (idle machine)
#   make bench-muon     flush and 2bw with Muon and ef, the planner's prediction beside (idle machine)
#   make bench-dist-muon   2bw with Muon against dist_muon at PP=2 x DP=2 (idle machine)
#   make compare / make convergence   the paper's baseline table and Figure 5 on CPU
#   make gpu-wheels   the wheels scripts/gpu_check.py needs on a bare GPU machine, into wheels/

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TORCHRUN    := $(VENV)/bin/torchrun
# On a machine without a GPU the CPU build of torch is installed; clusters bring their own
# CUDA build (install it into the environment first, `pip install -e .` keeps it).
TORCH_CPU   ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-fast test-slurm bench bench-splits bench-muon bench-dist-muon compare convergence data clean-venv gpu-wheels

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

# two workers (pytest-xdist), a test module each at a time (its shared runs made once);
# TEST_WORKERS=0 runs the suite in this one process
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --durations=20 $(TEST_ARGS)

# the tests marked fast in tests/conftest.py (FAST)
test-fast: $(VENV)/.installed
	$(PY) -m pytest tests -q -m fast

test-slurm: $(VENV)/.installed
	$(PY) -m pytest tests/test_slurm.py -q

bench: $(VENV)/.installed
	$(PY) tools/bench_schedules.py --microbatches 4 --rounds 3 --iters 5 --warmup 2 --json runs/bench/schedules.json

# this CPU's layer profile first (the planner predicts from it), then 3 paired rounds
bench-splits: $(VENV)/.installed
	$(PY) tools/plan.py profile --cpu --num-layers 8 --hidden-size 512 --num-attention-heads 8 \
	    --seq-length 128 --vocab-size 32000 --micro-batch-sizes 2 --tensor-parallel-sizes 1 \
	    --idle-below 0.3 --out runs/bench/splits_profile.json
	$(PY) tools/bench_schedules.py --vocab-size 32000 --microbatches 8 --schedules 2bw,flush \
	    --splits even,planner --rounds 3 --iters 12 --warmup 2 \
	    --profile runs/bench/splits_profile.json --json runs/bench/splits.json

# the benchmark model's profile first, as the benchmark runs it (untied, no dropout; the
# planner predicts each row from it), then 3 paired rounds of the Muon rows beside AdamW's
bench-muon: $(VENV)/.installed
	$(PY) tools/plan.py profile --cpu --num-layers 8 --hidden-size 512 --num-attention-heads 8 \
	    --seq-length 128 --vocab-size 1024 --untie-embeddings-and-output-weights --no-dropout \
	    --micro-batch-sizes 2 --tensor-parallel-sizes 1 --idle-below 0.3 \
	    --out runs/bench/muon_profile.json
	$(PY) tools/bench_schedules.py --microbatches 4 --rounds 3 --iters 5 --warmup 2 \
	    --schedules flush,2bw,flush+muon,2bw+muon,2bw-ef+muon \
	    --profile runs/bench/muon_profile.json --json runs/bench/muon.json

compare: $(VENV)/.installed
	$(PY) tools/compare.py

convergence: $(VENV)/.installed
	$(PY) tools/convergence.py

# The GPU machine (Python 3.12, CUDA build of torch, no network) has numpy, packaging, psutil,
# sentencepiece, regex and tensorboard but no megatron-core: its cp312 wheel (~2.6 MB) travels
# in wheels/ (git-ignored); see docs/gpu.md.
GPU_WHEELS  ?= megatron-core==0.16.1
PIP_BOOT    ?= $(PYTHON_BOOT) -m pip

gpu-wheels:
	$(PIP_BOOT) download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels $(GPU_WHEELS)
	@ls -l wheels

clean-venv:
	rm -rf $(VENV)

# Muon's state and Newton-Schulz work sharded over 2 data-parallel replicas (dist_muon) against
# unsharded Muon, both under 2bw, with and without ef; 4 processes on this machine's cores
bench-dist-muon: $(VENV)/.installed
	$(PY) tools/bench_schedules.py --schedules 2bw+muon,2bw+dist_muon,2bw-ef+muon,2bw-ef+dist_muon \
	    --data-parallel-size 2 --microbatches 4 --rounds 3 --iters 5 --warmup 2 --no-single-rows \
	    --json runs/bench/dist_muon.json
