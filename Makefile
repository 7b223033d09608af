# ecxfer build and test entry points. `make test` and `make run` are the two
# commands a fresh Debian 12 machine (as root) needs.

GO        ?= go
# Builds stamp no version control information (a clone owned by another
# user, or a machine without git, would fail them), and the Go on PATH is
# used as it is, never a toolchain downloaded for a go.mod line.
export GOFLAGS     ?= -buildvcs=false
export GOTOOLCHAIN ?= local
GOFMT     ?= $(shell $(GO) env GOROOT 2>/dev/null)/bin/gofmt
PKGS      ?= ./...
FUZZTIME  ?= 20000x
LONGFUZZ  ?= 2000000x
# libpython3-dev: the Python tests build a program that embeds Python
# (python/tests/test_interpreters.py).
DEBS      := ca-certificates gcc libc6-dev libucx-dev ucx-utils pkg-config iproute2 python3-msgpack python3-venv \
             libpython3-dev
GO_MIN    := 1.26
SOAK      ?= 5m
SOAK_RESTARTS ?= 100
BENCHTIME ?= 1s

.PHONY: python test-python bench-python test-vllm
.PHONY: all deps debs venv nixl-venv build test vet staticcheck fmt-check cgo-guard fuzz-seed fuzz run bench soak clean

all: build

# Install the Debian packages ecxfer needs, only those that are missing,
# then the project's Python virtual environment. Go itself is not a Debian
# package here (Debian 12's is 1.19): go-check says so when it is missing.
deps: go-check debs venv nixl-venv

.PHONY: go-check
go-check:
	@v=$$($(GO) env GOVERSION 2>/dev/null | sed 's/^go//'); \
	if [ -z "$$v" ]; then echo "ecxfer needs Go $(GO_MIN) or newer on PATH (or GO=/path/to/go): https://go.dev/dl/"; exit 1; fi; \
	if [ "$$(printf '%s\n%s\n' "$(GO_MIN)" "$$v" | sort -V | head -n1)" != "$(GO_MIN)" ]; then \
		echo "ecxfer needs Go $(GO_MIN) or newer; $(GO) is $$v (Debian 12's golang-go is too old): https://go.dev/dl/"; exit 1; fi

debs:
	@missing=""; for p in $(DEBS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "deps: all present ($(DEBS))"; exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "deps: missing Debian packages:$$missing"; \
		echo "deps: run 'make deps' as root, or: sudo apt-get install -y$$missing"; exit 1; \
	fi; \
	echo "deps: installing$$missing"; \
	export DEBIAN_FRONTEND=noninteractive; \
	i=0; until apt-get -o DPkg::Lock::Timeout=600 update -qq; do \
		i=$$((i + 1)); [ $$i -lt 60 ] || exit 1; \
		echo "deps: apt-get update failed (the package lists locked by the machine's own apt jobs?); again in 10 s"; sleep 10; \
	done; \
	apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $$missing

# The project's one Python virtual environment (.venv), for its Python
# tools and tests: every file in VENV_REQS, pinned, from PyPI. It is
# rebuilt only when a requirements file changes (the stamp records them),
# so a second run does nothing and needs no network; rebuilt from an
# empty one, so that it holds what the files say and nothing a former
# version of them added (NIXL's wheel is then installed again).
PYTHON3   ?= python3
VENV      := .venv
VENV_PY   := $(VENV)/bin/python
VENV_REQS ?= requirements-dev.txt
VENV_STAMP := $(VENV)/.installed

venv: $(VENV_STAMP)

$(VENV_STAMP): $(VENV_REQS) | debs
	$(PYTHON3) -m venv --clear $(VENV)
	$(VENV_PY) -m pip install -q --disable-pip-version-check $(addprefix -r ,$(VENV_REQS))
	@cat $(VENV_REQS) > $@

# NIXL's wheel in the same .venv (requirements-nixl.txt). --no-deps: the
# wheel names torch (and with it CUDA) as a dependency, which nothing here
# uses; the file lists what is needed instead. Its own stamp, so a second
# run does nothing and needs no network.
NIXL_REQS  := requirements-nixl.txt
NIXL_STAMP := $(VENV)/.installed-nixl

nixl-venv: $(NIXL_STAMP)

$(NIXL_STAMP): $(NIXL_REQS) $(VENV_STAMP)
	$(VENV_PY) -m pip install -q --disable-pip-version-check --no-deps -r $(NIXL_REQS)
	@cat $(NIXL_REQS) > $@

build: deps
	$(GO) build $(PKGS)

fmt-check: go-check
	@files=$$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'); \
	files=$$(for f in $$files; do [ -e "$$f" ] && echo "$$f"; done); \
	out=$$($(GOFMT) -l $$files) || exit 1; \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

vet: go-check debs
	$(GO) vet $(PKGS)

# staticcheck at a pinned version, fetched through the Go module proxy; it
# is a tool, so it stays out of go.mod and out of every importer's build.
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
staticcheck: go-check debs
	$(GO) run $(STATICCHECK) $(PKGS)

# Only the engine packages under nixl/ and the C ABI (cmd/libecxfer) may
# use cgo.
cgo-guard:
	@bad=$$(grep -rl --include='*.go' --exclude-dir='.venv*' -E '^import "C"|^[[:space:]]*"C"$$' . | grep -v -e '^\./nixl/' -e '^\./cmd/libecxfer/[^/]*\.go$$' || true); \
	if [ -n "$$bad" ]; then echo "cgo outside nixl/ and cmd/libecxfer:"; echo "$$bad"; exit 1; fi; \
	echo "cgo-guard: ok"

# Only metrics/ imports Prometheus' client, so embedding ecxfer without
# metrics pulls none of it in.
dep-guard: go-check debs
	@bad=$$(grep -rl --include='*.go' '"github.com/prometheus/' . | grep -v '^\./metrics/' || true); \
	if [ -n "$$bad" ]; then echo "prometheus imported outside metrics/:"; echo "$$bad"; exit 1; fi; \
	deps=$$($(GO) list -deps .) || exit 1; \
	if echo "$$deps" | grep -q '^github.com/prometheus/'; then echo "package ecxfer depends on prometheus"; exit 1; fi; \
	echo "dep-guard: ok"

# Run every fuzz target briefly: its seed corpus plus $(FUZZTIME) inputs.
# Counts, not durations: go 1.26's fuzzer can fail a time-limited run with
# "context deadline exceeded" when the time runs out.
define run-fuzz
	@set -e; for f in $$(grep -rl --include='*_test.go' --exclude-dir='.venv*' '^func Fuzz' . | sort); do \
		dir=$$(dirname $$f); \
		for t in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
			echo "fuzz: $$dir $$t ($(1))"; \
			$(GO) test -run '^$$' -fuzz "^$$t\$$" -fuzztime $(1) $$dir > .fuzz.log 2>&1 || { cat .fuzz.log; rm -f .fuzz.log; exit 1; }; \
		done; \
	done; rm -f .fuzz.log; echo "fuzz: ok"
endef

fuzz-seed: go-check debs
	$(call run-fuzz,$(FUZZTIME))

fuzz: go-check debs
	$(call run-fuzz,$(LONGFUZZ))

# UCX_LOG_LEVEL=error: the tests kill peers on purpose, and UCX then warns
# about every request it could not return; the warnings say nothing new.
# VIRTUAL_ENV: the NIXL peers and library come from the project's .venv,
# not from one the caller may have activated (the Python tests find it
# themselves, and one of them checks NIXL is found nowhere else).
# ECXFER_REQUIRE_NIXL=1: the NIXL engine's tests (its conformance suite,
# the ABI checks, the Go <-> Python interop) run against the wheel that
# `make nixl` builds the shim for, and fail rather than skip without it.
test: export UCX_LOG_LEVEL ?= error
test: export ECXFER_REQUIRE_NIXL = 1
test: deps nixl fmt-check cgo-guard dep-guard vet staticcheck
	VIRTUAL_ENV=$(NIXL_VENV) $(GO) test -race -count=1 -timeout 20m $(PKGS)
	VIRTUAL_ENV=$(NIXL_VENV) $(GO) test -count=1 -run 'Allocs' $(PKGS)
	@$(MAKE) --no-print-directory test-python
	@$(MAKE) --no-print-directory fuzz-seed
	@$(MAKE) --no-print-directory soak

# Random READs from 16 goroutines against three producer processes (an
# engine-allocated region, anonymous memory, a /dev/shm file), with releases
# in flight, vLLM-sized (101-byte) notifications, one producer replaced
# every 100 ms (killed or exiting) until
# SOAK_RESTARTS replacements (at most SOAK); checks that every accepted READ
# is accounted for, nothing leaks (goroutines, descriptors, RSS, shared
# mappings) and UCX's own teardown report is empty (hence UCX_LOG_LEVEL=warn).
# Then the same on the engine path (two producers of engine-allocated
# regions, half the replacements), where notifications go through UCX, and
# on the engine path over tcp alone (UCX_TLS=tcp: error mode PEER and
# gathered READs between the processes). Each run still going 2 minutes
# after SOAK ends is hung: it prints its goroutines and fails on its own
# (ecxfer-soak --hang-limit).
soak: export UCX_LOG_LEVEL = warn
soak: deps
	$(GO) build -o .soak ./cmd/ecxfer-soak
	./.soak --duration $(SOAK) --producers 3 --regions alloc,mmap,shm --workers 16 \
		--restart 100ms --restarts $(SOAK_RESTARTS) --notif-bytes 101 && \
	./.soak --duration $(SOAK) --producers 2 --regions alloc --direct off --workers 8 \
		--restart 100ms --restarts $$(( $(SOAK_RESTARTS) / 2 )) --notif-bytes 101 && \
	UCX_TLS=tcp ./.soak --duration $(SOAK) --producers 2 --regions alloc,mmap \
		--direct off --workers 8 --restart 100ms --restarts $$(( $(SOAK_RESTARTS) / 4 )) \
		--notif-bytes 101; s=$$?; rm -f .soak; exit $$s

# A real transfer between two processes (the harness forks a UCX producer)
# with every workload and mode, bytes verified, and the table (about 65 s).
run: deps
	$(GO) run ./cmd/ecxfer-bench run

# The full set: every package's Go benchmarks, then the harness with longer
# cells, writing bench.json and bench.svg.
bench: deps
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -benchmem -count 6 $(PKGS)
	$(GO) run ./cmd/ecxfer-bench run --duration 5s --warmup 1s --json bench.json --svg bench.svg

# Two hosts on one machine: two network namespaces and a veth pair, made
# and removed by scripts/bench-hosts.sh; the harness's producer in one, its
# consumer in the other, UCX over TCP, every workload and mode, beside the
# link's own TCP throughput and RTT; then one producer against 1, 4 and 16
# consumer processes across the link. Needs root.
.PHONY: bench-hosts
bench-hosts: export UCX_LOG_LEVEL ?= error
bench-hosts: deps
	GO="$(GO)" ./scripts/bench-hosts.sh

clean:
	$(GO) clean -testcache

# The NIXL engine (Config.Backend "nixl"): builds libecxnixl.so, ecxfer's
# small C ABI over NIXL's C API (nixl/libnixl/shim), against the NIXL wheel
# in a virtual environment (NIXL_VENV, default the project's .venv, which
# `make deps` fills), into $(NIXL_VENV)/lib/ecxfer/, where ecxfer finds it
# through VIRTUAL_ENV, NIXL_PREFIX=$(NIXL_VENV) or, for code run inside
# this tree, the project's .venv.
NIXL_VENV ?= $(CURDIR)/$(VENV)
NIXL_SITE  = $(firstword $(wildcard $(NIXL_VENV)/lib/python3*/site-packages))
NIXL_LIBS  = $(firstword $(wildcard $(NIXL_SITE)/.nixl_cu12.mesonpy.libs $(NIXL_SITE)/.nixl_cu13.mesonpy.libs))
NIXL_SHIM  = $(NIXL_VENV)/lib/ecxfer/libecxnixl.so

.PHONY: nixl test-nixl
nixl: $(if $(filter $(CURDIR)/$(VENV),$(NIXL_VENV)),nixl-venv)
	@test -n "$(NIXL_LIBS)" && test -f "$(NIXL_LIBS)/libnixl_capi.so" || { \
		echo "nixl: no NIXL wheel (libnixl_capi.so) under $(NIXL_VENV)/lib/python3*/site-packages;"; \
		echo "nixl: run 'make nixl-venv', or pip install --no-deps -r requirements-nixl.txt into NIXL_VENV"; exit 1; }
	@mkdir -p $(dir $(NIXL_SHIM))
	$(CC) -std=c11 -O2 -fPIC -shared -Wall -Wextra -Werror -Wno-format-truncation -o $(NIXL_SHIM) nixl/libnixl/shim/ecxnixl.c \
		-L$(NIXL_LIBS) -lnixl_capi -Wl,-rpath,$(NIXL_LIBS) \
		-ldl -Wl,--no-undefined
	@echo "nixl: built $(NIXL_SHIM)"

# The tests that need the NIXL engine (make test runs them too); a missing
# library fails them.
test-nixl: export UCX_LOG_LEVEL ?= error
test-nixl: nixl
	VIRTUAL_ENV=$(NIXL_VENV) ECXFER_REQUIRE_NIXL=1 $(GO) test -race -count=1 -run 'NIXL' .
	VIRTUAL_ENV=$(NIXL_VENV) ECXFER_REQUIRE_NIXL=1 $(GO) test -race -count=1 ./nixl/libnixl

# NIXL beside ecxfer, in one run: the harness's latency and image cells on
# ecxfer's UCX engine, then on its NIXL engine (the raw rows are NIXL's C
# API driven directly) with vLLM's error mode (peer) and with none, then
# NIXL's own Python API the way vLLM's transport calls it, with both modes
# (bench/nixl_python.py). About 3 minutes.
BENCH_NIXL_ARGS ?= --workloads latency,image --modes reactor,locked,raw --no-refs
.PHONY: bench-nixl
bench-nixl: export UCX_LOG_LEVEL ?= error
bench-nixl: nixl
	@echo "== ecxfer, UCX engine (Debian's UCX 1.13)"
	$(GO) run ./cmd/ecxfer-bench run --backend ucx $(BENCH_NIXL_ARGS)
	@echo "== ecxfer, NIXL engine (NIXL's wheel), vLLM's error mode (peer)"
	ECXFER_NIXL_PARAMS= VIRTUAL_ENV=$(NIXL_VENV) $(GO) run ./cmd/ecxfer-bench run --backend nixl $(BENCH_NIXL_ARGS)
	@echo "== ecxfer, NIXL engine (NIXL's wheel), error mode none"
	ECXFER_NIXL_PARAMS=ucx_error_handling_mode=none VIRTUAL_ENV=$(NIXL_VENV) $(GO) run ./cmd/ecxfer-bench run --backend nixl $(BENCH_NIXL_ARGS)
	@echo "== NIXL's Python API"
	NIXL_LOG_LEVEL=WARN $(NIXL_VENV)/bin/python bench/nixl_python.py --error-mode peer
	NIXL_LOG_LEVEL=WARN $(NIXL_VENV)/bin/python bench/nixl_python.py --error-mode none

# The Python package (python/, import name ecxfer): libecxfer.so, the C ABI
# of cmd/libecxfer, built into the package, where it loads it from.
PY_LIB := python/ecxfer/libecxfer.so

python: deps
	$(GO) build -buildmode=c-shared -trimpath -o $(PY_LIB) ./cmd/libecxfer
	@rm -f python/ecxfer/libecxfer.h

# The Python tests (pytest in .venv): the vLLM contract, two Python
# processes over UCX (and over the NIXL engine, hence nixl), Python <-> Go,
# the GIL, the plugin, packaging, leaks.
test-python: export UCX_LOG_LEVEL ?= error
test-python: python nixl
	cd python && env -u VIRTUAL_ENV ../$(VENV_PY) -m pytest -q -p no:cacheprovider

# Python consumer -> producer with the harness's workloads, side by side
# with NIXL's Python API (from .venv) in the same invocation.
BENCH_PY_ARGS ?=
bench-python: python
	$(VENV_PY) python/bench/bench_python.py $(BENCH_PY_ARGS)

# ecxfer inside released vLLM (requirements-vllm.txt, pinned by
# requirements-vllm.lock) in its own environment, .venv-vllm: about 9.5 GB
# and 4-15 minutes to install, so not part of `make test`. The ecxfer wheel
# is built by pip through its Go hook and installed there; the tests drive
# vLLM's own plugin loader, shared region and session code.
VLLM_VENV  := .venv-vllm
VLLM_REQS  := requirements-vllm.txt requirements-vllm.lock
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): $(VLLM_REQS) | debs
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON3) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-vllm.txt -c requirements-vllm.lock
	@cat $(VLLM_REQS) > $@

test-vllm: export UCX_LOG_LEVEL ?= error
test-vllm: python $(VLLM_STAMP)
	rm -rf .wheel && $(VENV_PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w .wheel ./python
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall .wheel/ecxfer-*.whl
	rm -rf .wheel
	cd python && ../$(VENV_PY) -m pytest -q -p no:cacheprovider tests_vllm
