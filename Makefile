# nostall developer entry points.
#   make venv   - create .venv (CPU torch pinned first, then the package in editable mode)
#   make demo   - the main job: torchrun trainer on 2 CPU ranks, async checkpoints, stop, resume (DEMO_ARGS=...)
#   make test   - ruff and mypy on src/, then the whole test suite: tests/unit, tests/dist, tests/system and
#                 src/nostall's doctests (PYTEST_ARGS="-k foo -x" to pass options; -m unit|dist|system picks a tier)
#   make test-fast - the unit tier (tests/unit: one process, no ranks, no server) and the doctests, in about a minute
#   make test-burn - `make test` with BURNERS CPU-bound processes beside it (default 2): no verdict may depend on speed
#   make clean  - remove the venv, build artefacts and caches
#
# TORCH_INDEX (default: PyTorch's CPU wheels) is an extra index for the torch install line only, so that a
# plain Linux machine gets the CPU build of torch (PyPI's is a CUDA build of several GB); TORCH_INDEX= (empty)
# for none, e.g. where pip already has a torch wheel at hand (find-links, a local index). The index is probed
# first (10 s at most): an unreachable one is left out with a note, and torch comes from pip's configured index.

PYTHON        ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS   ?=
BURNERS       ?= 2
DEMO_ARGS     ?= --plot demo-checkpoints/demo.png

VENV  := .venv
VPY   := $(VENV)/bin/python
PIP   := $(VPY) -m pip
STAMP := $(VENV)/.stamp

.PHONY: venv demo test test-fast test-burn clean

venv: $(STAMP)

# Rebuilt when pyproject.toml changes. torch is installed pinned FIRST (with
# TORCH_INDEX: the CPU build) so that resolving the package's own dependencies
# never pulls a (CUDA) torch build; the pin is repeated on the second install
# so pip cannot replace it.
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@idx="$(strip $(TORCH_INDEX))"; \
	if [ -n "$$idx" ] && ! $(VPY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$$idx" 2>/dev/null; then \
		echo "note: TORCH_INDEX $$idx is unreachable: torch comes from pip's configured index"; idx=""; \
	fi; \
	echo "$(PIP) install -q $${idx:+--extra-index-url $$idx} torch==$(TORCH_VERSION)"; \
	$(PIP) install -q $${idx:+--extra-index-url $$idx} "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]" "torch==$(TORCH_VERSION)"
	@touch $@

demo: venv
	$(VPY) -m nostall.tools.reference.demo $(DEMO_ARGS)

test: venv
	$(VPY) -m ruff check src
	$(VPY) -m mypy
	$(VPY) -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(VPY) -m pytest tests/unit src/nostall $(PYTEST_ARGS)

test-burn: venv
	$(VPY) tests/burn.py $(BURNERS) -- $(MAKE) test

clean:
	rm -rf $(VENV) build dist .pytest_cache demo-checkpoints
	find . -path ./.git -prune -o -name '*.egg-info' -prune -exec rm -rf {} +
	find . -path ./.git -prune -o -name '__pycache__' -prune -exec rm -rf {} +
