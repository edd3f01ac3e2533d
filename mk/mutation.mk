# Mutation testing of the backends' storage code, judged by their quick certification
# (cosmic-ray; about 35 s per mutant on one core, so a 300-mutant sample takes hours).
MUTATION_SAMPLE ?= 150
MUTATION_SEED ?= 13

.PHONY: mutation
mutation: setup
	$(BIN)/pip install --quiet -e '.[mutation]'
	$(BIN)/python benchmarks/mutation.py --backend all --sample $(MUTATION_SAMPLE) --seed $(MUTATION_SEED)

# Mutation testing of the relay and the operator commands, judged by their tests (real
# servers on loopback; run on an idle machine).  Figures in docs/relay.md.
RELAY_MUTATION_SAMPLE ?= 120

.PHONY: mutation-relay
mutation-relay: setup
	$(BIN)/pip install --quiet -e '.[mutation]'
	$(BIN)/python benchmarks/mutation.py --backend relay --sample $(RELAY_MUTATION_SAMPLE) --seed $(MUTATION_SEED)
