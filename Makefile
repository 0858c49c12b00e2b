# dgc: Deep Gradient Compression for PyTorch. `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian packages holding the offline data sets (installed when root with apt)
DEB_DATA := dataset-fashion-mnist bible-kjv-text bible-kjv espeak-ng pocketsphinx-testdata

.PHONY: help install lock demo elastic-demo overlap-demo data test test-torch-floor test-slurm-cluster test-all identity lint format bench bench-cluster gpu-check chaos clean

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_.-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

install: ## create .venv with the stack pinned in uv.lock (uv's shared cache: seconds in a second clone; plain pip if uv is unavailable) and, as root with apt, the offline data packages; idempotent
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(DEB_DATA); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "apt-get install $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	else echo "not root with apt: skipping Debian data packages ($(DEB_DATA))"; fi
	@VENV=$(VENV) tools/install.sh

lock: ## re-resolve uv.lock after editing the dependencies in pyproject.toml (commit it)
	$$(tools/install.sh --print-uv) lock

demo: install ## the main job: fmnist_resnet20 on 4 CPU workers, dense vs DGC; table and plot in results/demo/
	$(PY) -m dgc.repro.demo --out results/demo

# make demo's DGC run (seed 0, 4 epochs) stopped at mid-run on 4 workers and finished on 2: the elastic resume's
# accuracy against results/demo/runs/dgc, the run left alone (issue 29); ~15 min on 2 cores
ELASTIC_RUN := runs/elastic-demo
DEMO_DGC := task=fmnist_resnet20 compression=dgc seed=0 train.epochs=4 task.compression_warmup_epochs=1 train.log_every=20 compression.wire_values=fp16
elastic-demo: install ## make demo's DGC resumed from 4 workers onto 2 at mid-run; prints its top-1 beside results/demo's
	rm -rf $(ELASTIC_RUN)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=4 -m dgc.train $(DEMO_DGC) run_dir=$(ELASTIC_RUN) train.max_steps=936
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 -m dgc.train $(DEMO_DGC) run_dir=$(ELASTIC_RUN) resume=true 'resume_allow=[world_size]'
	$(PY) -c "import json; a, b = (json.load(open(p + '/summary.json'))['metrics']['top1'] for p in ('results/demo/runs/dgc', '$(ELASTIC_RUN)')); print(f'top-1: 4 workers throughout {a:.2f}, 4 -> 2 at step 936 {b:.2f}, difference {b - a:+.2f}')"

# make demo's DGC run (seed 0) with the overlapped DDP hook (per-tensor clipping): its top-1 beside results/demo's
# serial run (issue 27); ~15 min on 2 cores
OVERLAP_RUN := runs/overlap-demo
overlap-demo: install ## make demo's DGC with sync.overlap=true; prints its top-1 beside results/demo's serial run
	rm -rf $(OVERLAP_RUN)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=4 -m dgc.train $(DEMO_DGC) run_dir=$(OVERLAP_RUN) sync.ddp_hook=true sync.overlap=true
	$(PY) -c "import json; a, b = (json.load(open(p + '/summary.json'))['metrics']['top1'] for p in ('results/demo/runs/dgc', '$(OVERLAP_RUN)')); print(f'top-1: serial {a:.2f}, overlapped {b:.2f}, difference {b - a:+.2f}')"

# where the data sets live: $DGC_DATA, else data/ here (what the configs' ${data_home:...} resolves to)
DATA ?= $(or $(DGC_DATA),data)

data: install ## build the offline corpora under $(DATA) (skipped when present): KJV text for kjv_lstm and kjv_gpt, espeak-ng speech for synth_deepspeech (~2 min)
	$(PY) -m dgc.tasks.text_corpora --root $(DATA)/kjv
	$(PY) -m dgc.tasks.token_files --root $(DATA)/kjv_char
	$(PY) -m dgc.tasks.synth_speech --root $(DATA)/synth_speech

# TEST_WORKERS=2 runs the suite in 2 pytest-xdist processes (tests that share machine state keep to one worker through
# xdist_group marks): on 2 cores 31 min where one process took 41. CI runs it in one (0): under 2 workers the
# netcluster bench test once found its cluster's namespaces still listed after the run (not yet understood). The 30
# slowest tests are listed at the end.
TEST_WORKERS ?= 0
test: install ## run the test suite (CPU, gloo; what CI runs); TEST_WORKERS=2 runs it in 2 processes
	$(PY) -m pytest -q -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadgroup --durations=30

test-torch-floor: install ## the library's tests with the oldest torch it supports (torch 2.4.1 in a venv of its own, removed after; ~5 min)
	tools/test-torch-floor.sh

test-slurm-cluster: install ## (root, apt) a real launch/slurm/local_cluster.sh start / stop --purge cycle, ~1 min: installs slurm-wlm + munge, then removes them
	DGC_TEST_LOCAL_CLUSTER=1 $(PY) -m pytest -q -m slurm tests/test_slurm_local_cluster.py

test-all: install ## every test, including slow and GPU-marked ones
	$(PY) -m pytest -q

identity: install ## bit-identity of the library against results/identity/after-sync-rebuild.json: 84 set-ups, 2 gloo ranks, 20 steps each (gradients, state, weights, step stats); ~1 min
	$(PY) tools/step_fingerprints.py --compare results/identity/after-sync-rebuild.json

lint: ## ruff check and format check; every tensor the library builds says its device (tools/check_devices.py)
	$(VENV)/bin/ruff check dgc tests tasks launch conf tools examples
	$(VENV)/bin/ruff format --check dgc tests tasks launch conf tools examples
	$(PY) tools/check_devices.py

format: ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix dgc tests tasks launch conf tools examples
	$(VENV)/bin/ruff format dgc tests tasks launch conf tools examples

bench: install ## selection, wire-size and GPU launch-count benchmarks, JSON under results/bench/
	$(PY) -m dgc.bench select --out results/bench/select.json
	$(PY) -m dgc.bench wire --model resnet50 --out results/bench/wire.json
	$(PY) -m dgc.repro.frontier_cost --table cpu-frontier --wire results/bench/wire.json \
	  > results/bench/frontier-projection.md.tmp && mv results/bench/frontier-projection.md.tmp results/bench/frontier-projection.md
	$(PY) -m dgc.bench ops --methods none,fp16,topk,dgc,dgc_chunk,dgc_chunk_packed_all,terngrad,qsgd,powersgd --bucket-mb 25 --out results/bench/ops.json

CLUSTER := $(PY) -m dgc.bench cluster
RN50 := --model resnet50 --steps 7
bench-cluster: install ## (root) emulated 1 Gbps cluster benches of docs/performance.md and the cost model, ~5 min
	@[ "$$(id -u)" = 0 ] || { echo "bench-cluster: needs root (network namespaces, tc); run: sudo make bench-cluster"; exit 1; }
	$(CLUSTER) --nodes 4 $(RN50) --methods none,fp16,powersgd,topk,dgc,dgc_compact,dgc_compact_all \
	  --out results/bench/cluster.json
	$(CLUSTER) --nodes 2 $(RN50) --methods none,fp16,dgc,dgc_compact --out results/bench/cluster_n2.json
	$(CLUSTER) --nodes 8 $(RN50) --methods none,fp16,dgc,dgc_compact --out results/bench/cluster_n8.json
	$(CLUSTER) --nodes 4 --model alexnet --steps 5 --methods none,fp16,powersgd,dgc,dgc_compact \
	  --out results/bench/cluster_alexnet.json
	$(CLUSTER) --nodes 4 --model lstm --steps 5 --methods none,fp16,powersgd,dgc,dgc_compact \
	  --out results/bench/cluster_lstm.json
	$(CLUSTER) --e2e --nodes 4 --steps 8 --batch-size 32 --out results/bench/cluster_e2e.json
	$(CLUSTER) --nodes 4 --ranks-per-node 2 $(RN50) --methods none,dgc,dgc_hierarchical --out results/bench/cluster_4x2.json
	for n in 2 4 8; do $(CLUSTER) --nodes $$n $(RN50) --methods none,dgc,dgc_sparse_allreduce \
	  --out results/bench/cluster_sar_$${n}x1.json || exit 1; done
	$(CLUSTER) --nodes 4 --ranks-per-node 2 $(RN50) --methods none,dgc,dgc_hierarchical --out results/bench/cluster_4x2_rerun.json
	$(CLUSTER) --nodes 8 $(RN50) --methods none,dgc,dgc_sparse_allreduce --out results/bench/cluster_sar_8x1_rerun.json
	$(PY) -m dgc.bench costmodel results/bench/cluster_4x2.json results/bench/cluster_sar_2x1.json \
	  results/bench/cluster_sar_4x1.json results/bench/cluster_sar_8x1.json --out results/bench/costmodel.json

.PHONY: projection
projection: install ## the step-time model of real hardware: every method and profile, 8 to 1,024 GPUs (results/bench/projection.json), and its check on this machine's e2e runs
	$(PY) -m dgc.costmodel --table --out results/bench/projection.json
	$(PY) -m dgc.costmodel --check --e2e results/bench/cluster_e2e_ddp.json $(wildcard results/bench/cluster_e2e_ddp_rerun.json)

gpu-check: install ## (GPU machine) the whole GPU check in one command, ~8 min: gpu tests, every task on CUDA, every collective on NCCL, compress timing, cluster bench; results/gpu/
	$(PY) -m dgc.bench gpu --out-dir results/gpu

chaos: install ## one 2-rank run hit by random faults and relaunched, against the same run left alone (~15 min); results/reliability/
	$(PY) -m dgc.repro.chaos --out results/reliability

clean: ## remove caches (keeps .venv and results/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info

# -- the paper's tables (dgc/repro/tables.py): runs under results/runs/<table>/<key>/, then results/<table>.{md,csv,png} --
# Full scale needs a GPU cluster: submitted through Slurm (launch/slurm/*.sbatch, one job per run, then a report job)
# unless LAUNCHER=local (one torchrun after another on this machine). Data roots (the configs' defaults):
CIFAR_ROOT ?= $(DATA)/cifar10
IMAGENET_ROOT ?= $(DATA)/imagenet
PTB_ROOT ?= $(DATA)/ptb
LIBRISPEECH_ROOT ?= $(DATA)/LibriSpeech
AN4_ROOT ?= $(DATA)/an4
OWT_ROOT ?= $(DATA)/openwebtext
LAUNCHER ?= slurm
# more python -m dgc.repro.sweep options, e.g. SWEEP_ARGS='--sbatch=--partition=gpu --gpus-per-node=8 --skip-done'
SWEEP_ARGS ?=
DATA_ROOTS := --data-root cifar10=$(CIFAR_ROOT) --data-root imagenet=$(IMAGENET_ROOT) --data-root ptb=$(PTB_ROOT) \
	--data-root librispeech=$(LIBRISPEECH_ROOT) --data-root an4=$(AN4_ROOT) --data-root gpt2=$(OWT_ROOT)
TABLE_DIRS := --runs-root results/runs --out results
SWEEP := $(PY) -m dgc.repro.sweep --launcher $(LAUNCHER) $(TABLE_DIRS) $(DATA_ROOTS) $(SWEEP_ARGS)
CPU_SWEEP := $(PY) -m dgc.repro.sweep --launcher local $(TABLE_DIRS) $(SWEEP_ARGS)

.PHONY: table2-cifar table3-imagenet table4-ptb table4-librispeech lm-gpt2 figure-ablation cpu-fmnist cpu-ablation cpu-kjv cpu-speech cpu-speech-long cpu-compact cpu-exchange cpu-frontier-grid cpu-frontier cpu-lm-frontier-grid cpu-lm-frontier

table2-cifar: install ## Table 2 (GPU cluster): ResNet-110 CIFAR-10 on 4/8/16/32 GPUs, baseline / Gradient Dropping / DGC
	$(SWEEP) $@

table3-imagenet: install ## Table 3 (GPU cluster): ImageNet AlexNet baseline / TernGrad / DGC, ResNet-50 baseline / DGC
	$(SWEEP) $@

table4-ptb: install ## Table 4 (GPU cluster): PTB 2 x 1500 LSTM perplexity, baseline / DGC
	$(SWEEP) $@

table4-librispeech: install ## Table 4 (GPU cluster): LibriSpeech DeepSpeech 7 x 1200 GRU WER, baseline / DGC
	$(SWEEP) $@

lm-gpt2: install ## GPT-2 124M on OpenWebText (GPU cluster, 8 GPUs, bf16): dense AdamW, bf16, DGC feeding AdamW, DiLoCo H 64, DeMo, SparseLoCo; OWT_ROOT=<nanoGPT's data/openwebtext>
	$(SWEEP) $@

figure-ablation: install ## ablation (GPU cluster): ResNet-110 CIFAR-10 and AN4 with each DGC technique off in turn
	$(SWEEP) $@

cpu-fmnist: install ## CPU analog of Table 2: fmnist_resnet20, 4 workers, 5 epochs, none / topk / dgc / dgc accumulating updates, 2 seeds (~70 min on 2 cores)
	$(CPU_SWEEP) $@

cpu-ablation: install ## CPU ablation: fmnist_resnet20 DGC with momentum correction / masking / clipping / warm-up off (~30 min)
	$(CPU_SWEEP) $@

cpu-kjv: install ## CPU analog of Table 4 (PTB): kjv_lstm, 2 workers, 12 epochs, none / dgc, 2 seeds (~90 min)
	$(CPU_SWEEP) $@

cpu-speech: data ## CPU analog of Table 4 (LibriSpeech): synth_deepspeech, 2 workers, 44 epochs, none, DGC accumulating gradients or updates, and a density-0.01 diagnostic, seeds 0-1; dense and the chosen DGC seeds 2-4 too (14 runs, ~12-16 h)
	$(CPU_SWEEP) $@

cpu-speech-long: data ## the speech analog at 2.5x the epochs (110, same total decay), dense and the chosen DGC, seeds 0-1 (4 runs, 2.8 h each measured here, niced; resumable: tools/background-sweep.sh)
	$(CPU_SWEEP) $@

cpu-compact: install ## compact wire format vs the default: fmnist_resnet20 as in make demo, 4 seeds x 3 formats (~70 min)
	$(CPU_SWEEP) $@

cpu-exchange: install ## the exchanges (flat, hierarchical 2x2, sparse allreduce) on make demo's setup, 2 seeds (~45 min)
	$(CPU_SWEEP) $@

cpu-frontier-grid: install ## the frontier's learning-rate grid: 10 arms (dense, bf16, PowerSGD, DGC, DGC chunk, DiLoCo H 16/64/256, DeMo, SparseLoCo) x 3 rates on a validation split, seed 0, one more doubling for the 7 arms best at an end (37 runs, 6.5 h measured here, niced beside other work; resumable)
	$(CPU_SWEEP) $@

cpu-frontier: install ## DGC against DiLoCo, DeMo and SparseLoCo: the 10 arms at the rates chosen on cpu-frontier-grid, seeds 0-1, test read once (20 runs, 3.9 h measured here, niced beside other work; resumable)
	$(CPU_SWEEP) $@

cpu-lm-frontier-grid: data ## the language-model frontier's learning-rate grid: 11 arms (dense, bf16, PowerSGD, DGC as published, DGC feeding AdamW, DGC chunk, DiLoCo H 16/64/256-bf16, DeMo, SparseLoCo) x 3 rates on kjv_gpt's validation split, seed 0, 4 workers, 7,773 steps each (33 runs, ~8 h on 2 cores; resumable: tools/background-sweep.sh)
	$(CPU_SWEEP) $@

cpu-lm-frontier: data ## DGC against DiLoCo, DeMo and SparseLoCo on a GPT: the 11 arms at the rates chosen on cpu-lm-frontier-grid, seeds 0-1, test read once (22 runs, ~5 h on 2 cores; resumable)
	$(CPU_SWEEP) $@

.PHONY: report
report: install ## a table's report from its runs under results/runs/, rows not run yet marked: make report TABLE=cpu-fmnist (results/<table>.{md,csv} and plots)
	@[ -n "$(TABLE)" ] || { echo "report: name the table: make report TABLE=<name> (python -m dgc.repro.report --list shows them)"; exit 2; }
	$(PY) -m dgc.repro.report --table $(TABLE) $(TABLE_DIRS)
