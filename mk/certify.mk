# Certify the project's own backends with the quick profile; reports land in out/certify/<backend>/.
CERT_BACKENDS ?= fs fs_fsync kv_log kv_leveldb

certify: setup
	@set -e; for b in $(CERT_BACKENDS); do \
	  echo "== certify $$b"; \
	  $(BIN)/queue-ref certify conformance.examples.backends:$$b --profile quick --out out/certify/$$b; \
	done

explore: setup
	$(BIN)/queue-ref crash explore --backend fs-syncfs --model all --bound 3 --after-life 3
	$(BIN)/queue-ref crash explore --backend fs-fsync --model all --bound 3 --after-life 3
	$(BIN)/queue-ref crash explore --backend kv --model all --bound 3

bench: setup
	$(BIN)/python benchmarks/lifecycle.py --backend all
	$(BIN)/python benchmarks/crash_explore.py
