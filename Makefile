# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create/refresh .venv.  The venv sees system site-packages, so a torch you already
# have (a GPU build) is kept; only when no torch is importable is the CPU build pinned (in the
# same pip run as refspec itself: one resolve).  --no-compile: pip does not byte-compile all of
# torch's ~2300 modules up front (~20 s); Python compiles the ~770 it imports on first use
# (~2.5 s, cached in __pycache__, or paid per process where PYTHONDONTWRITEBYTECODE is set).
# `make demo` and `make tutorials` install what the demo and every tutorial run as a script need
# (the `real` and `tutorials` extras, DEMO_EXTRAS); `make test` adds the test, docs and notebook extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= test,real,docs,notebooks
DEMO_EXTRAS ?= real,tutorials

.PHONY: venv test demo tutorials check mutants mutation conformance sweep full-grid docs lab clean triton-check
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

# the learning path's set-up (the demo's): every tutorial then runs as a script or in `make lab`.
# A tutorial's first cell (refspec/harness/needs.py) stops with this command when it is missing;
# when the venv lost a package after its stamp, the set-up runs again.
tutorials: $(VENV)/.stamp-$(DEMO_EXTRAS)
	@$(PY) -c "import sys; from refspec.harness.needs import missing; sys.exit(bool(missing('tutorials', 'real')))" \
		|| { rm -f $<; $(MAKE) --no-print-directory $<; }
	@echo "Set up for every tutorial. Start with 01 (the paged KV cache) and 03 (the forward modes):"
	@echo "  $(PY) tutorials/01_paged_kv_cache.py"
	@echo "  $(PY) tutorials/03_forward_modes.py"
	@echo "or open them all in JupyterLab: make lab"

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
# not listed as equivalent and on a mutant no test reaches (its function never called: mutmut's
# "no tests").  Its own target, not part of make test / .ci/run (CPU minutes).
mutation:
	$(MAKE) venv EXTRAS=test,mutation
	timeout 3600 $(PY) benchmarks/mutation.py

# the fused Triton kernels (merge, tree acceptance, tree structure, KV move) compiled for Hopper
# (sm_90) on this CPU machine: Triton's passes and ptxas need no GPU (tests/test_triton_compile.py),
# and run by Triton's interpreter against their torch rules on random inputs
# (tests/test_triton_interpret.py); a CPU torch brings no Triton, so a pinned one goes into
# .triton/, outside the venv; a fresh Triton cache, so every run compiles.  .ci/run calls it after make test.
TRITON_PIN ?= triton==3.6.0
triton-check: venv
	test -d .triton/triton || $(PY) -m pip install -q --no-deps --target .triton "$(TRITON_PIN)"
	PYTHONPATH=.triton TRITON_CACHE_DIR=$$(mktemp -d) $(PY) -m pytest -q -p no:cacheprovider tests/test_triton_compile.py \
		tests/test_triton_interpret.py

# SGLang's own FA3 backend on the same batches (installs the pinned releases into .conformance/,
# patched copies for the known-bug controls into .conformance-patched/).  The known upstream bugs
# the pins reproduce are stated here and strict: the run fails when one disappears or another
# failure appears (refspec/conformance/known.py; docs/conformance.md#exit-status)
EXPECTED_BUGS ?= 0.5.23:context-wall-page-table,0.5.12.post1:context-wall-page-table,0.5.12.post1:draft-expand-unsliced-scatter
# the MLA forward path's (refspec/conformance/mla_forward.py; docs/conformance.md#mla)
MLA_EXPECTED_BUGS ?= 0.5.23:mla-verify-expand-paged-view,0.5.12.post1:mla-verify-expand-paged-view,0.5.12.post1:mla-pool-no-move-kv-cache,0.5.12.post1:mla-store-writes-slot-0
conformance: venv
	$(PY) -m refspec conformance --expect-bugs $(EXPECTED_BUGS),$(MLA_EXPECTED_BUGS)
	$(PY) -m pytest -q -m "conformance and not releases" tests/test_conformance_upstream.py tests/test_conformance_targets.py \
		tests/test_conformance_kernel.py \
		tests/test_conformance_controls.py tests/test_conformance_mla.py

# every release with the FA3 backend (0.4.4.post2 .. 0.5.23), one worker at a time; rewrites the
# measured table of docs/versions.md (CPU-heavy: 25 to 35 minutes on 2 shared cores, 2026-12-07; not part of CI)
sweep: venv
	$(PY) -m refspec conformance --sweep
	$(PY) -m pytest -q -m releases tests/test_conformance_targets.py tests/test_conformance_sweep.py \
		tests/test_conformance_mla.py

# the rest of the lossless grids whose representative subset make test runs (marker full_grid):
# the MLA target + MTP draft at every P x v1 / v2 / v2-overlap x eager / graph, chain and trees
# (tests/test_mla_lossless.py: 59 cases, 63-90 s with one worker on a shared 2-core machine; not part of CI)
full-grid: venv
	$(PY) -m pytest -n 2 -q -m full_grid tests/test_mla_lossless.py

# executes the tutorials while building, so their pages show outputs and figures (a few
# minutes: 05 and 06 load the real model); make test's strict build does not execute them
docs: venv
	REFSPEC_DOCS_EXECUTE=true $(PY) -m mkdocs build --strict

# the tutorials' set-up plus JupyterLab
lab:
	$(MAKE) venv EXTRAS=$(DEMO_EXTRAS),lab
	$(VENV)/bin/jupyter lab tutorials/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site .conformance .conformance-patched
