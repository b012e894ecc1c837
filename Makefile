# The two commands of the README: `make run` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean bench serve sim-demo

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $(STAMP)

install: $(STAMP)

# The end-to-end demo: a tiny model served by 1 prefill + 1 decode worker process, a multi-round ToolBench-shaped
# workload at a rate and SLO derived from this machine's profile, replayed through the HTTP API with AMPD and then
# an always-remote baseline, side by side with the simulator's prediction (table and reports/demo/ttft.png).
run: $(STAMP)
	$(BIN)/tandem demo

# The simulator's demo experiment (AMPD vs baselines at cluster scale).
sim-demo: $(STAMP)
	$(BIN)/tandem experiment --preset demo --out reports/demo

# Keep a server running on 127.0.0.1:8000 (tiny model made once under models/).
serve: $(STAMP)
	test -f models/tiny-qwen3-1m/config.json || $(BIN)/tandem tiny-model --arch qwen3 --size 1m --out models/tiny-qwen3-1m
	$(BIN)/tandem serve --model models/tiny-qwen3-1m --prefill-workers 1 --decode-workers 1 --max-model-len 4096

# The Redis state-store tests start their own redis-server: install the binary when missing (Debian, root).
# Tolerated to fail: those tests then skip, naming the missing binary.
.PHONY: redis
redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
		|| echo "note: could not install redis-server; the Redis state-store tests will skip"

# Two test processes (pytest-xdist), one torch thread each: the suite is mostly tiny models and servers waiting on
# each other, and two processes of two torch threads each on 2 cores slow torch down far more than they gain.
# Tests marked `serial` (they assert timings) run afterwards, alone.
test: $(STAMP) redis
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -m "not serial"
	$(BIN)/python -m pytest -m serial

# The layer rule (ARCHITECTURE.md, "Layers") and no import cycles inside packages (pyproject.toml
# [tool.importlinter]), and ruff's checks (pyproject.toml [tool.ruff]).
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check tandem tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py

clean:
	rm -rf $(VENV) reports models
