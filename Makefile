# The two commands a new user types. Both install whatever is missing first.
PY ?= python3
export PYTHON := $(PY)

.PHONY: serve test test-all install bench

serve:  ## install what is missing, then serve the embedded SmolLM2 on 127.0.0.1:8000
	bash scripts/bootstrap.sh
	$(PY) -m memserve.cli up $(ARGS)

test:  ## install what is missing (test extras too), then run the default test suite
	bash scripts/bootstrap.sh test
	$(PY) -m pytest -q $(ARGS)

test-all:  ## the default suite plus the slow tests
	bash scripts/bootstrap.sh test
	MEMSERVE_SLOW=1 $(PY) -m pytest -q $(ARGS)

install:
	bash scripts/bootstrap.sh
