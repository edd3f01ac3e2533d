# The relay, mailq and qshape on queues of 10k, 100k and 1M deferred messages (the 1M run
# takes tens of minutes and some 4 GB of disk: outside CI). Last line: JSON with the ratios.
SCALE_SIZES ?= 10000,100000,1000000

.PHONY: bench-scale
bench-scale: setup
	$(BIN)/python benchmarks/scale.py --sizes $(SCALE_SIZES)
