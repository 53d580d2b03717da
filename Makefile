# The two set-up commands. Both work on a fresh machine with no network beyond PyPI.
.PHONY: run test test-lab install install-dev horovod clean

VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

$(VENV)/.installed-dev: pyproject.toml scripts/install.sh
	bash scripts/install.sh dev
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(VENV)/bin/distlm demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The lab's instruments (benchmarks/tools) have their own tests, apart from the product's suite.
test-lab: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q benchmarks/tests

# Horovod 0.28.1 (patched to build against torch >= 2.1), cached; see scripts/build_horovod.sh
horovod: $(VENV)/.installed-dev
	bash scripts/build_horovod.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
