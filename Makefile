# queue-ref: `make demo` shows a real queue at work; `make test` runs lint, types and tests.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
JOBS   ?= 2

.PHONY: setup sysdeps demo test test-thorough lint typecheck pytest crosshair bench explore certify clean

# Debian packages from .ci/apt-packages.txt: installed when missing and we are root
# (a fresh machine of this kind); otherwise only listed, so a user can install them.
# Postfix's installer would ask what kind of mail server this is: the answer "No
# configuration" is given first (the tests run private instances, never the system's).
sysdeps:
	@missing=$$(grep -v '^\s*#' .ci/apt-packages.txt | grep -v '^\s*$$' | while read -r p; do \
	  dpkg -s "$$p" >/dev/null 2>&1 || echo "$$p"; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:" $$missing; \
	    echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $$missing >/dev/null; \
	  else echo "missing Debian packages (some tests will be skipped):" $$missing; fi; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: sysdeps $(STAMP)

demo: setup
	$(BIN)/queue-ref demo
	$(BIN)/queue-ref demo --relay

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(BIN)/pytest -q -n $(JOBS) --timeout=900 --durations=25 -m "not thorough"

# further seeds of the checks' broken variants (about 10 minutes on 2 cores), outside CI
test-thorough: setup
	$(BIN)/pytest -q -n $(JOBS) --timeout=1800 -m thorough

test: lint typecheck pytest

-include mk/*.mk

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
