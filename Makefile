# The two commands of the README: `make run` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem experiment --preset demo --out reports/demo

# The Redis state-store tests start their own redis-server: install the binary when missing (Debian, root).
# Tolerated to fail: those tests then skip, naming the missing binary.
.PHONY: redis
redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
		|| echo "note: could not install redis-server; the Redis state-store tests will skip"

test: $(STAMP) redis
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py

clean:
	rm -rf $(VENV) reports
