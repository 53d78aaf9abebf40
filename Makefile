# Two commands set everything up on a fresh machine: `make demo` and `make test` (both idempotent).
#   make demo            the whole pipeline on the built-in task, default sizes (outputs under out/)
#   make demo TINY=1     the same chain with tiny sizes in about a minute (outputs under out/tiny/)
#   make test            the test suite
PYTHON ?= python3
VENV   := .venv
PY     ?= $(VENV)/bin/python
DATA   ?= out/data
TINY   ?=
ifeq ($(TINY),1)
OUT       ?= out/tiny
SFT_FLAGS := --n-layer 2 --n-head 2 --n-embd 64 --max-steps 150 --eval-every 100 --num-samples 64 --warmup-steps 10
else
OUT       ?= out
SFT_FLAGS :=
endif

.PHONY: demo test venv clean

venv: $(VENV)/.installed

# (re-)install only when requirements.txt changes
$(VENV)/.installed: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r requirements.txt
	touch $@

demo: venv
	$(PY) train_sft.py --out-dir $(OUT)/sft --task-dir $(DATA) $(SFT_FLAGS)

test: venv
	$(PY) -m pytest -q --durations=15 tests

clean:
	rm -rf out
