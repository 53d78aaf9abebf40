# Two commands set everything up on a fresh machine: `make demo` and `make test` (both idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TINY   ?=
ifeq ($(TINY),1)
OUT        := out/tiny
SFT_FLAGS  := --n-layer 2 --n-head 2 --n-embd 64 --max-steps 150 --eval-every 100 --num-samples 64 --warmup-steps 10
else
OUT        := out
SFT_FLAGS  :=
endif

.PHONY: demo test venv clean

venv: $(VENV)/.installed

# re-install only when requirements.txt changes
$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

demo: venv
	$(PY) train_sft.py --out-dir $(OUT)/sft --task-dir out/data $(SFT_FLAGS)

test: venv
	$(PY) -m pytest -q --durations=15 tests

clean:
	rm -rf out
