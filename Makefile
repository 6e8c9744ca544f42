# regen — the two commands a user needs:
#   make regen   set everything up and run the whole pipeline on the embedded default (localhost, CPU)
#   make test    set everything up and run every check (lint, unit, integration, end-to-end)
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PYTHONDONTWRITEBYTECODE := 1
INVENTORY ?= inventory/local
PYTEST_ARGS ?=

.PHONY: help bootstrap regen test lint check unit e2e bench lock clean stop sweep

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

bootstrap: ## build or reuse the project venv (.venv) from the pinned lock
	@scripts/bootstrap.sh

regen: bootstrap ## run the whole pipeline on $(INVENTORY) (default: the embedded local demo)
	ansible-playbook -i $(INVENTORY) regen.yml $(ARGS)

sweep: bootstrap ## measure serving layouts on $(INVENTORY) -> artifacts/sweep/report.md (ARGS="-e layout_sweep_force=true")
	ansible-playbook -i $(INVENTORY) playbooks/sweep.yml $(ARGS)

stop: bootstrap ## stop what the pipeline left running (model servers, router, trainings, online stack)
	ansible-playbook -i $(INVENTORY) playbooks/teardown.yml

test: bootstrap ## every check: lint, unit + integration tests, end-to-end runs (lint and molecule alongside)
	@scripts/test-all.sh $(PYTEST_ARGS)

lint: bootstrap ## ruff, yamllint, ansible-lint (production profile)
	ruff check .
	yamllint --strict .
	ansible-lint --offline

check: bootstrap ## unit and integration tests (fast; no end-to-end runs)
	pytest -m "not e2e" $(PYTEST_ARGS)

e2e: bootstrap ## slow end-to-end cases: the full demo pipeline twice, molecule scenarios
	pytest -m e2e $(PYTEST_ARGS)

# Bounded sizes by default (minutes on a 2-core machine); `make bench BENCH_SIZE=` runs the full sizes
# (the generate benchmark's long-answer case then generates 10,000 prompts per variant and checks memory
# from 10,000 to 160,000 prompts).
BENCH_SIZE ?= --quick
bench: bootstrap ## benchmarks (ratios against a limit or a peer measured in the same run)
	@for b in bench/bench_*.py; do echo "== $$b"; \
	  case $$b in bench/bench_generate.py) python $$b $(BENCH_SIZE) || exit 1;; *) python $$b || exit 1;; esac; \
	done

lock: ## re-resolve the hashed requirements/controller.lock from controller.in (envs/resolve.sh: host locks)
	envs/resolve.sh requirements/controller.in

clean: ## remove the venv, caches, work data and artifacts
	rm -rf $(VENV) .cache .work artifacts .collections
