# Two commands set everything up on a fresh machine: `make demo` and `make test` (both idempotent).
#   make demo            the whole pipeline on the built-in task (SFT, RM, DPO, PPO, eval), default sizes (out/)
#   make demo TINY=1     the same chain with tiny sizes in under a minute (43 s; outputs under out/tiny/)
#   make test            ruff format --check, ruff check (pinned in requirements.txt), then the test suite
#   make test-fast       ruff check and the fast tier of the suite (84 s on 2 cores; requirements.txt only)
#   make ablation        PPO-max vs vanilla vs minus-one-trick, 2 seeds, and a --kl-coef sweep (about 1.5 h;
#                        needs out/sft and out/rm from `make demo`; resumes; table in out/ablation/ablation.md)
#   make frontier        gold vs KL for PPO-max, GRPO, Dr. GRPO, RLOO, REINFORCE++, REBEL, DAPO, GSPO, CISPO, DPPO,
#                        the gold-reward oracle (VinePPO's and REBEL's too), DPO, KTO and best-of-N (62 runs, about 2 h
#                        on 2 cores before DPPO's 4; needs `make demo`; resumes; out/frontier/frontier.md and .png)
#   make rlvr            the verifiable-reward task (--task arith): SFT, then GRPO, DAPO, GSPO, CISPO, DPPO (TV, KL),
#                        RLOO and PPO-max on the verifier's reward, pass@1/4/16/64 on 128 held-out problems (12.5 min
#                        on 2 quiet cores; resumes; out/rlvr/results.json)
#   make multiturn       the multi-turn task (--task guess, a guessing game): SFT, then PPO-max, GRPO and RLOO over
#                        4-turn episodes, each against the optimum (8 min on 2 cores; resumes; out/multiturn/results.json)
#   make real            RLHF on a real pretrained model: SmolLM2-135M-Instruct (out/smollm2, from a PyPI package), an RM
#                        on its own samples labelled by VADER, PPO-max on the RM and on VADER, eval (42 min on 2
#                        cores in fp32; 29 with DTYPE=bfloat16 where the CPU has bf16 matmuls; resumes; out/real/)
#   make real-rlvr       RLVR on SmolLM2 on two reasoning-gym tasks (chain_sum, leg_counting): a format SFT, GRPO on
#                        the task's own scorer, pass@1 and pass@8 on 64 held-out questions each
#                        (out/real_rlvr/results.json; 22 min on 2 cores in fp32)
#   make real-rlvr-losses    after make real-rlvr: DAPO's recipe, GSPO, CISPO, DPPO (TV, KL) beside its GRPO on
#                        chain_sum, at equal episodes (into out/real_rlvr/results.json)
#   make real-rlvr-feedback  after make real-rlvr: GRPO on chain_sum in a feedback game (up to 3 attempts, the
#                        scorer's verdict after a wrong one); first-try and any-try success of SFT, GRPO and it
#   make real-multiturn  multi-turn RL on SmolLM2: the guessing game in chat (1..10, 4 guesses, "Higher."/"Lower." as
#                        the next user turn), success on 128 held-out games, 5 GRPO steps, again (556 s on 2 quiet
#                        cores; resumes; out/real_multiturn/results.json)
#   make online          iterated RLHF: rounds of PPO, on-policy pairs labelled by the task's simulated human and a
#                        new reward model (needs `make demo`; 15 min on 2 cores; resumes; out/online/results.json)
PYTHON ?= python3
VENV   := .venv
PY     ?= $(VENV)/bin/python
DATA   ?= out/data
TINY   ?=
# make real's and make real-rlvr's --dtype (experiments/real.py, real_rlvr.py): auto, float32 or bfloat16
DTYPE  ?= auto
ifeq ($(TINY),1)
OUT       ?= out/tiny
SFT_FLAGS := --n-layer 2 --n-head 2 --n-embd 64 --max-steps 150 --eval-every 100 --num-samples 64 --warmup-steps 10
RM_FLAGS  := --max-steps 40 --eval-every 40 --eval-pairs 256 --probe-size 32 --calib-size 256
DPO_FLAGS := --max-steps 10 --eval-every 10 --eval-pairs 128 --num-samples 64 --warmup-steps 2
PPO_FLAGS := --max-steps 8 --sample-every 4 --critic-warmup-steps 2 --warmup-steps 2
EVAL_FLAGS := --num-samples 64
else
OUT       ?= out
SFT_FLAGS :=
RM_FLAGS  :=
DPO_FLAGS :=
PPO_FLAGS :=
EVAL_FLAGS :=
endif
COMMON := --task-dir $(DATA)

.PHONY: demo test test-fast venv real-venv clean ablation frontier online rlvr multiturn real real-rlvr real-multiturn \
	real-rlvr-losses real-rlvr-feedback smollm2 wheels

venv: $(VENV)/.installed
real-venv: $(VENV)/.installed-real

# (re-)install only when requirements.txt changes. pip byte-compiles what it installs on one core (35 of its 57 s
# here): --no-compile, then compileall on every core. -qq and `|| true`: like pip, it skips the few files that are not
# this Python's syntax (torch/testing/_internal/py312_intrinsics.py)
COMPILE := $(VENV)/bin/python -W ignore -m compileall -qq -j 0 $(VENV)/lib || true
$(VENV)/.installed: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q --no-compile -r requirements.txt
	$(COMPILE)
	touch $@

$(VENV)/.installed-real: requirements-real.txt $(VENV)/.installed
	$(VENV)/bin/python -m pip install -q --no-deps --no-compile -r requirements-real.txt
	$(COMPILE)
	touch $@

demo: venv
	@echo "== make demo 1/5: SFT, train_sft.py -> $(OUT)/sft"
	$(PY) train_sft.py $(COMMON) --out-dir $(OUT)/sft --overwrite $(SFT_FLAGS)
	@echo "== make demo 2/5: reward model, train_rm.py -> $(OUT)/rm"
	$(PY) train_rm.py $(COMMON) --out-dir $(OUT)/rm --overwrite --init $(OUT)/sft/ckpt.pt $(RM_FLAGS)
	@echo "== make demo 3/5: DPO, train_dpo.py -> $(OUT)/dpo"
	$(PY) train_dpo.py $(COMMON) --out-dir $(OUT)/dpo --overwrite --init $(OUT)/sft/ckpt.pt $(DPO_FLAGS)
	@echo "== make demo 4/5: PPO-max, train_ppo.py -> $(OUT)/ppo (the longest stage)"
	$(PY) train_ppo.py $(COMMON) --out-dir $(OUT)/ppo --overwrite --sft-ckpt $(OUT)/sft/ckpt.pt --rm-ckpt $(OUT)/rm/ckpt.pt $(PPO_FLAGS)
	@echo "== make demo 5/5: eval, eval.py -> $(OUT)/results.json"
	rm -f $(OUT)/results.json
	$(PY) eval.py $(COMMON) --pairs --rm $(OUT)/rm/ckpt.pt --json $(OUT)/results.json
	$(PY) eval.py $(COMMON) --policy $(OUT)/sft/ckpt.pt $(OUT)/ppo/ckpt.pt $(OUT)/dpo/ckpt.pt --names sft ppo dpo \
		--ref $(OUT)/sft/ckpt.pt --rm $(OUT)/rm/ckpt.pt --json $(OUT)/results.json $(EVAL_FLAGS)
ifeq ($(TINY),1)
	@echo "make demo TINY=1 checked that the chain runs (a 2-layer model, 8 PPO iterations): the table above means nothing. The real run: make demo (5-12 minutes on 2 cores), then make test."
endif

ablation: venv
	$(PY) experiments/ablation.py --sft-ckpt $(OUT)/sft/ckpt.pt --rm-ckpt $(OUT)/rm/ckpt.pt --task-dir $(DATA) \
		--out-dir $(OUT)/ablation

# matplotlib draws the plot; it is not a dependency of the stages
frontier: venv
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) experiments/frontier.py --sft-ckpt $(OUT)/sft/ckpt.pt --rm-ckpt $(OUT)/rm/ckpt.pt --task-dir $(DATA) \
		--out-dir $(OUT)/frontier

rlvr: venv
	$(PY) experiments/rlvr.py --task-dir $(DATA) --out-dir $(OUT)/rlvr

multiturn: venv
	$(PY) experiments/multiturn.py --task-dir $(DATA) --out-dir $(OUT)/multiturn

# out/smollm2: the model as a Hugging Face folder, once
smollm2: real-venv
	$(PY) experiments/real.py --model-only --model-dir $(OUT)/smollm2

real: real-venv
	$(PY) experiments/real.py --model-dir $(OUT)/smollm2 --out-dir $(OUT)/real --dtype $(DTYPE)

real-rlvr: real-venv
	$(PY) experiments/real_rlvr.py --model-dir $(OUT)/smollm2 --out-dir $(OUT)/real_rlvr --dtype $(DTYPE)

# the same task files, format SFT and GRPO run: the other losses at equal episodes, and the feedback game
real-rlvr-losses: real-venv
	$(PY) experiments/real_rlvr.py --model-dir $(OUT)/smollm2 --out-dir $(OUT)/real_rlvr --dtype $(DTYPE) \
		--tasks chain_sum --losses grpo dppo_tv dppo_kl cispo gspo dapo

real-rlvr-feedback: real-venv
	$(PY) experiments/real_rlvr.py --model-dir $(OUT)/smollm2 --out-dir $(OUT)/real_rlvr --dtype $(DTYPE) \
		--tasks chain_sum --feedback-turns 3 --game-prompts 128

real-multiturn: real-venv
	$(PY) experiments/real_multiturn.py --model-dir $(OUT)/smollm2 --out-dir $(OUT)/real_multiturn --dtype $(DTYPE)

online: venv
	$(PY) train_online.py --sft-ckpt $(OUT)/sft/ckpt.pt --rm-ckpt $(OUT)/rm/ckpt.pt --task-dir $(DATA) \
		--out-dir $(OUT)/online

# one pytest worker a core (at most 4), one thread each: the tests are small and many start processes of their own
XDIST := -n auto --maxprocesses 4 --dist worksteal

test: venv real-venv
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m pytest $(XDIST) -q --durations=15 tests

# the edit-run loop of a fork: the math, the user errors, one tiny smoke run per stage; only requirements.txt (the
# real-model tests skip without requirements-real.txt's packages: make real-venv adds them)
test-fast: venv
	$(PY) -m ruff check .
	$(PY) -m pytest $(XDIST) -q -m "not slow" --durations=10 tests

# tyro and its pure-Python dependencies as wheels, for bench/gpu_check.sh on a CUDA box without network
wheels: venv
	$(PY) -m pip download -q --no-deps -d .whl "tyro==$$($(PY) -c 'import tyro; print(tyro.__version__)')" \
		docstring-parser typeguard typing-extensions vaderSentiment

clean:
	rm -rf out
