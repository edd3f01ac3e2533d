# A plain `pip install .` (no extras) in a fresh virtual environment must give a working
# `queue-ref`: its commands import only runtime dependencies.  `make test` runs this check.

PLAIN_VENV ?= $(shell mktemp -d -u /tmp/queue-ref-plain.XXXXXX)

.PHONY: plain-install-check
plain-install-check:
	@set -e; venv=$(PLAIN_VENV); trap 'rm -rf "$$venv" "$$venv.work" "$$venv.src"' EXIT; \
	$(PYTHON) -m venv "$$venv"; \
	mkdir -p "$$venv.src" "$$venv.work"; \
	git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$$venv.src"; \
	"$$venv/bin/pip" install --quiet --no-cache-dir "$$venv.src"; \
	cd "$$venv.work"; \
	"$$venv/bin/queue-ref" --help >/dev/null; \
	"$$venv/bin/queue-ref" demo --json | tail -n 1 | "$$venv/bin/python" -c 'import json,sys; json.loads(sys.stdin.read())'; \
	"$$venv/bin/queue-ref" crash explore --backend fs --model process-kill --bound 1 --no-recovery --json \
	  | tail -n 1 | "$$venv/bin/python" -c 'import json,sys; assert json.loads(sys.stdin.read())["violating_states"] == 0' ; \
	"$$venv/bin/queue-ref" certify --help >/dev/null; \
	"$$venv/bin/queue-ref" certify conformance.examples.sqlite_backend:factory --model process-kill \
	  --only bad-input,process-kill --seed 1 --out "$$venv.work/cert" --json \
	  | tail -n 1 | "$$venv/bin/python" -c 'import json,sys; assert json.loads(sys.stdin.read())["status"] == "certified"'; \
	"$$venv/bin/queue-ref" repair --help >/dev/null; \
	echo "plain install: queue-ref --help, demo, crash explore, certify and repair work"

test: plain-install-check
