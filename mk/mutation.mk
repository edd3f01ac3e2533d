# Mutation testing of the backends' storage code, judged by their quick certification
# (cosmic-ray; about 35 s per mutant on one core, so a 300-mutant sample takes hours).
MUTATION_SAMPLE ?= 150
MUTATION_SEED ?= 13

.PHONY: mutation
mutation: setup
	$(BIN)/pip install --quiet -e '.[mutation]'
	$(BIN)/python benchmarks/mutation.py --backend all --sample $(MUTATION_SAMPLE) --seed $(MUTATION_SEED)
