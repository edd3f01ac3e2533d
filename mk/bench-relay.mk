# queue-ref relay against a private Postfix instance, same load, interleaved rounds
# (installs Debian's postfix if missing; run as root). Last line: JSON with the ratios.
RELAY_ROUNDS ?= 3
RELAY_MESSAGES ?= 5000

.PHONY: bench-relay
bench-relay: setup
	$(BIN)/python benchmarks/relay.py --rounds $(RELAY_ROUNDS) --messages $(RELAY_MESSAGES)
