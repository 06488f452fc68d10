# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create/refresh .venv.  The venv sees system site-packages, so a torch you already
# have (a GPU build) is kept; only when no torch is importable is the CPU build pinned (in the
# same pip run as refspec itself: one resolve).  --no-compile: pip does not byte-compile all of
# torch's ~2300 modules up front (~20 s); Python compiles the ~770 it imports on first use
# (~2.5 s, cached in __pycache__, or paid per process where PYTHONDONTWRITEBYTECODE is set).
# `make demo` installs only what the demo needs (the `real` extra, DEMO_EXTRAS); `make test`
# adds the test, docs and notebook extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= test,real,docs,notebooks
DEMO_EXTRAS ?= real

.PHONY: venv test demo check mutants mutation conformance sweep docs lab clean triton-check
venv: $(VENV)/.stamp-$(EXTRAS)

$(VENV)/.stamp-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --no-compile -e ".[$*]" $$($(PY) -c "import torch" 2>/dev/null || echo "$(TORCH_PIN)")
	case ",$*," in *,real,*) $(PY) -m refspec.real.install ;; esac
	touch $@

test: venv
	$(PY) -m ruff check refspec tests docs
	$(PY) -m pytest -n 2 -q tests

.PHONY: lint
lint: venv
	$(PY) -m ruff check refspec tests docs

demo: $(VENV)/.stamp-$(DEMO_EXTRAS)
	$(PY) -m refspec demo

# check / mutants need no extra: they reuse whichever set-up `make demo` or `make test` made (a
# pip run only when pyproject.toml changed since), and make the demo's where neither ran
SETUP := $(firstword $(wildcard $(VENV)/.stamp-*) $(VENV)/.stamp-$(DEMO_EXTRAS))

check: $(SETUP)
	$(PY) -m refspec check

mutants: $(SETUP)
	$(PY) -m refspec mutants

# mutation testing of the checkers (validators, trace checks, the conformance comparison):
# mutmut, one mutant at a time, each module against its own tests (the table in
# benchmarks/mutation.py); writes benchmarks/results/mutation.md, fails on a survivor that is
# not listed as equivalent.  Its own target, not part of make test / .ci/run (CPU minutes).
mutation:
	$(MAKE) venv EXTRAS=test,mutation
	timeout 3600 $(PY) benchmarks/mutation.py

# the fused Triton kernels (merge, tree acceptance, tree structure) compiled for Hopper (sm_90)
# on this CPU machine: Triton's passes and ptxas need no GPU (tests/test_triton_compile.py; a CPU
# torch brings no Triton, so a pinned one goes into .triton/, outside the venv; a fresh Triton
# cache, so every run compiles).  .ci/run calls it after make test.
TRITON_PIN ?= triton==3.6.0
triton-check: venv
	test -d .triton/triton || $(PY) -m pip install -q --no-deps --target .triton "$(TRITON_PIN)"
	PYTHONPATH=.triton TRITON_CACHE_DIR=$$(mktemp -d) $(PY) -m pytest -q -p no:cacheprovider tests/test_triton_compile.py

# SGLang's own FA3 backend on the same batches (installs the pinned releases into .conformance/,
# patched copies for the known-bug controls into .conformance-patched/).  The known upstream bugs
# the pins reproduce are stated here and strict: the run fails when one disappears or another
# failure appears (refspec/conformance/known.py; docs/conformance.md#exit-status)
EXPECTED_BUGS ?= 0.5.23:context-wall-page-table,0.5.12.post1:context-wall-page-table,0.5.12.post1:draft-expand-unsliced-scatter
conformance: venv
	$(PY) -m refspec conformance --expect-bugs $(EXPECTED_BUGS)
	$(PY) -m pytest -q -m "conformance and not releases" tests/test_conformance_upstream.py tests/test_conformance_targets.py \
		tests/test_conformance_kernel.py \
		tests/test_conformance_controls.py

# every release with the FA3 backend (0.4.4.post2 .. 0.5.23), one worker at a time; rewrites the
# measured table of docs/versions.md (CPU-heavy: 25 to 35 minutes on 2 shared cores, 2026-12-07; not part of CI)
sweep: venv
	$(PY) -m refspec conformance --sweep
	$(PY) -m pytest -q -m releases tests/test_conformance_targets.py tests/test_conformance_sweep.py

# executes the tutorials while building, so their pages show outputs and figures (a few
# minutes: 05 and 06 load the real model); make test's strict build does not execute them
docs: venv
	REFSPEC_DOCS_EXECUTE=true $(PY) -m mkdocs build --strict

lab:
	$(MAKE) venv EXTRAS=$(EXTRAS),lab
	$(VENV)/bin/jupyter lab tutorials/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site .conformance .conformance-patched
