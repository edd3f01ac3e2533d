# Crash exploration of the relay: its commits and a delivery round crashed at every storage
# call, under every persistence model, on each backend the explorer drives (about a minute
# and a half here; figures in docs/relay.md, "Crash exploration").
CRASH_RELAY_BACKENDS ?= fs fs-fsync fs-syncfs kv

.PHONY: crash-relay
crash-relay: setup
	@for b in $(CRASH_RELAY_BACKENDS); do \
	  $(BIN)/queue-ref crash relay --backend $$b --model all || exit 1; done
