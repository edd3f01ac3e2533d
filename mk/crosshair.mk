# Symbolic check of the PEP316 contracts (pre:/post:/inv: in docstrings) of the pure
# spec modules.  Exit 0: no counterexample found.  About four minutes on two cores;
# tests/test_crosshair.py runs the fast part (spec/states.py) in CI.
crosshair: setup
	$(BIN)/crosshair check --analysis_kind=PEP316 --per_condition_timeout=5 spec/states.py spec/model.py spec/delivery_model.py
