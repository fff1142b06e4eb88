# Two entry points for a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test test-slow test-all golden bench clean

# torch is installed first and pinned: left alone, pip resolves transformer-lens to a multi-GB CUDA torch.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/conceptdict demo

# The README's test command: unit + integration (+ gpu tests, which skip without CUDA); not `slow`. Then the
# equivalence tests (N ranks = 1 process, shards, resume, kernels = reference) again under each ATen CPU capability
# of CAPS: another vectorised reduction order, so that this CPU catches what another would (`make test CAPS="default
# avx2"` on an AVX-512 machine; .ci/run does that). Under avx2 the numba kernels are compiled for an AVX2 CPU too
# (NUMBA_CPU_NAME=haswell with its own features, not this machine's), so their code is an AVX2 machine's as well.
# Every pass runs on one pytest-xdist worker per logical CPU (at most 8; XDIST= runs in one process). Whole test
# files go to whichever worker is free (--dist loadfile), so that a module-scoped fixture is built once;
# tests/conftest.py gives each worker its share of torch's threads. (Not --dist loadgroup: with pytest 9.2 it
# ignores xdist_group marks, pytest-xdist issue 1386.)
CAPS ?= default
XDIST ?= -n logical --maxprocesses 8 --dist loadfile
test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest -m "not slow" -q $(XDIST)
	for cap in $(CAPS); do numba=""; [ "$$cap" = avx2 ] && numba="NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES="; \
	  echo "equivalence tests under ATEN_CPU_CAPABILITY=$$cap $$numba"; \
	  env $$numba ATEN_CPU_CAPABILITY=$$cap HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest -m "equivalence and not slow" \
	    -k "not triton" -q -p no:cacheprovider $(XDIST) || exit 1; done

# What .ci/run adds after `make test`: the `slow` tier, i.e. long end-to-end runs that a default-tier test covers
# more cheaply (each says which) and the checks against the real foreign libraries, which skip without their side
# environments. `make test` + `make test-slow` = `make test-all`.
test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest -m slow -q $(XDIST)

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest -q $(XDIST)

# Rewrites tests/golden/training.json; legitimate only as tests/golden/make_golden.py's docstring says.
golden: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python tests/golden/make_golden.py

clean:
	rm -rf $(VENV) runs .pytest_cache
