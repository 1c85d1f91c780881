# aaas — see README.md. Every target installs what it needs (Go modules,
# Debian packages via apt-get, tools built once into the cache below).
SHELL := /bin/bash
include versions.env

TOOLS_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/aaas/tools
STATICCHECK := $(TOOLS_CACHE)/staticcheck-$(STATICCHECK_VERSION)/staticcheck
BIN := bin
CMDS := edge lifecycle sweeper broker setup
# Development tools: the stand-ins for DSH and the model providers, and `make run`.
DEV_CMDS := dshsim providersim devstack
# The race-enabled processes of the integration tests (internal/dev/testenv).
RACE_BIN := $(BIN)/race
RACE_CMDS := edge lifecycle sweeper broker setup
GOTEST_FLAGS ?=
# The release the binaries report (aaas_build_info, the "started" log line).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/aaas-project/aaas/internal/telemetry.Version=$(VERSION)
export AAAS_TOOLS_CACHE := $(TOOLS_CACHE)

.PHONY: all build test unit fuzz lint bench reliability soak run tools clean kind-up kind-down compose-up compose-down release

all: build

## build: compile every command into ./bin
build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 go build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(CMDS)) $(addprefix ./internal/dev/cmd/,$(DEV_CMDS))

## release: VERSION=x.y.z cuts a release into dist/vx.y.z: binaries, the multi-architecture image as an OCI
## archive, its SBOM, the chart pinning the image by digest, notes from CHANGELOG, SHA256SUMS (reproducible:
## the same commit gives the same checksums); the checkout must say the version (CHANGELOG, chart, kustomize)
release:
	@[ -n "$(VERSION)" ] && [ "$(origin VERSION)" = "command line" ] || { echo "release: say which, e.g. make release VERSION=0.2.0"; exit 2; }
	@git diff --quiet HEAD || { echo "release: the checkout has uncommitted changes; a release is cut from a commit"; exit 1; }
	go run ./hack/release -version $(VERSION) -out dist/v$(VERSION)

## tools: etcd, chromium, kube-apiserver, kube-controller-manager, agent-sandbox, staticcheck (cached)
tools:
	@hack/tools.sh all

## test: every package, race detector on, integration tests included; the aaas processes the
## integration tests start are race-enabled too, built once here for every package, and the
## integration packages share one control plane (hack/testcluster), each test in its own namespace
test: tools build lint
	CGO_ENABLED=1 go build -race -ldflags '$(LDFLAGS)' -o $(RACE_BIN)/ $(addprefix ./cmd/,$(RACE_CMDS))
	go build -o $(BIN)/testcluster ./hack/testcluster
	AAAS_RACE_BIN=$(CURDIR)/$(RACE_BIN) $(BIN)/testcluster go test -race -count=1 -timeout 40m $(GOTEST_FLAGS) ./...
	$(ALLOCATIONS)

## unit: the fast loop: every test that needs neither root nor a control plane, race detector on.
## -short makes the TestMains that start a devcluster (devclustertest.Main, testenv.Main) or a real
## node start nothing; their tests that need one skip, the rest run, and every other package runs
## whole, so a new package is in without being listed. The fuzz targets' seeds run as tests.
unit:
	@command -v node >/dev/null || { echo "make unit needs Node.js (the proxy's fuzz tests ask its URL parser where a browser goes): make tools installs it"; exit 1; }
	go test -race -short -count=1 -timeout 15m $(GOTEST_FLAGS) ./...
	$(ALLOCATIONS)

# ALLOCATIONS checks the allocation budgets (the cached proxied request's),
# which the race detector would change, without it.
ALLOCATIONS = go test -count=1 -run 'Allocations$$' ./internal/proxy/

## fuzz: each fuzz target (every func FuzzX in a _test.go file) for FUZZTIME (default 30s), one at a
## time, as go test -fuzz runs one per invocation; FUZZFLAGS passes more (-parallel 1 on a shared
## machine). An input that fails lands in the package's testdata/fuzz/FuzzX/: commit it with the fix.
FUZZTIME ?= 30s
FUZZFLAGS ?=
fuzz:
	@failed=""; \
	for f in $$(git ls-files '*_test.go' | xargs grep -l '^func Fuzz'); do \
	  for target in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
	    echo "fuzz: $$target (./$$(dirname $$f)) for $(FUZZTIME)"; \
	    go test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 10s $(FUZZFLAGS) ./$$(dirname $$f)/ || failed="$$failed $$target"; \
	  done; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: failed:$$failed"; exit 1; fi

## lint: go vet, gofmt, staticcheck
lint: tools
	go vet ./...
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(STATICCHECK) ./...

## bench: micro-benchmarks, devcluster benchmarks, the proxy benchmark (the edge beside direct
## access, nginx, haproxy, Caddy, Traefik and configurable-http-proxy) and the scale benchmark
## (an edge against a server filled with accounts) (writes docs/BENCHMARKS.md)
bench: tools build
	@hack/tools.sh debian wrk haproxy strace
	@hack/tools.sh bench
	go test -run '^$$' -bench . -benchmem -count=1 ./internal/kv/ ./internal/events/ ./internal/auth/ ./internal/httpguard/ ./internal/proxy/ ./internal/sweeper/ ./internal/broker/ ./internal/admin/ ./internal/capacity/
	go test -run '^$$' -bench WakeOverhead -benchtime 50x -count=1 ./internal/lifecycle/
	go test -run '^$$' -bench ClaimsFromWarmPool -benchtime 5x -count=1 ./internal/lifecycle/
	go test -run '^$$' -bench SignupLatency -benchtime 30x -count=1 ./test/e2e/accounts/
	go run ./hack/bench -bin $(BIN) -out docs/BENCHMARKS.md
	go run ./hack/scale -bin $(BIN) -out docs/BENCHMARKS.md
	go run ./hack/scale -nodes 3 -bin $(BIN) -out docs/BENCHMARKS.md

## reliability: the fault suite (test/e2e/faults) at full scale, printing each scenario's table
## (the figures of docs/RELIABILITY.md); make test runs it smaller
reliability: tools build
	CGO_ENABLED=1 go build -race -o $(RACE_BIN)/ $(addprefix ./cmd/,$(RACE_CMDS))
	set -o pipefail; AAAS_RACE_BIN=$(CURDIR)/$(RACE_BIN) FAULTS_SCALE=full go test -race -count=1 -timeout 60m -v ./test/e2e/faults/ | grep -v '^        [[{]'

## soak: SOAK (default 30m) of traffic from SOAK_USERS (default 200) users with a fault every few
## minutes; reports the memory slope of edges and NATS nodes (not in make test; the processes are
## built as deployed, without the race detector, whose shadow memory would hide the slope)
SOAK ?= 30m
SOAK_USERS ?= 200
soak: tools build
	@mkdir -p $(BIN)/plain
	CGO_ENABLED=0 go build -trimpath -o $(BIN)/plain/ $(addprefix ./cmd/,$(RACE_CMDS))
	AAAS_RACE_BIN=$(CURDIR)/$(BIN)/plain SOAK=$(SOAK) SOAK_USERS=$(SOAK_USERS) go test -count=1 -timeout 0 -v -run TestSoak ./test/e2e/faults/

## run: the whole system on this machine (embedded NATS, local control plane); NODE=real runs the
## documented install on a real kubelet; RUN_ARGS passes devstack flags; settings come from the environment
run: tools build
	$(BIN)/devstack $(if $(NODE),-node $(NODE)) $(RUN_ARGS)

## kind-up: a kind cluster with agent-sandbox and the dshsim template, and in .kind the kubeconfig and
## NATS credentials compose mounts (needs docker, kind, kubectl, go; EDGE_A_PORT, EDGE_B_PORT: the edges' ports)
kind-up:
	hack/kind-up.sh

## kind-down: compose's containers and NATS data, the kind cluster and .kind: the data names the
## cluster's sandboxes, and compose's edges live in the node's network
# (compose interpolates the whole file even to take it down: HANDSHAKE_KEYS
# must be set, to anything.)
kind-down:
	HANDSHAKE_KEYS=$${HANDSHAKE_KEYS:-unused} docker compose down --volumes
	kind delete cluster --name aaas
	rm -rf .kind

## compose-up: NATS, two edges, lifecycle, the sweeper and the broker in docker compose against the kind
## cluster; refuses to start before make kind-up has written what compose mounts
compose-up:
	@for f in $${KIND_KUBECONFIG:-.kind/kubeconfig} .kind/nats/nkeys.conf; do \
	  [ -f "$$f" ] || { echo "compose-up: $$f is missing or not a file: run make kind-up first (it creates the cluster, its kubeconfig and compose's NATS credentials)"; exit 1; }; \
	done
	docker compose up --build

## compose-down: stop and remove compose's containers; NATS's data (volume nats-data) stays for the
## next compose-up (make kind-down removes it with the cluster)
compose-down:
	HANDSHAKE_KEYS=$${HANDSHAKE_KEYS:-unused} docker compose down

## clean: build outputs, make run's state and test artifacts; the kind cluster and .kind (its kubeconfig,
## compose's NATS credentials) stay: make kind-down removes them
clean:
	rm -rf $(BIN) .run .run-bench test-artifacts
	@if [ -d .kind ]; then echo "clean: kept the kind cluster and .kind; make kind-down removes them"; fi
