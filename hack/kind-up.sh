#!/usr/bin/env bash
# Creates the kind cluster for docker compose development (README, "Docker
# compose against kind"): a node of the pinned Kubernetes version
# publishing the edge ports, agent-sandbox at the pinned version, the dev
# sandbox template running dshsim from the dshsim:dev image, and what
# compose.yaml mounts: the kubeconfig and the NATS credentials. Needs
# docker, kind, kubectl and go. Run it again to update what it applied.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env
for tool in docker kind kubectl go; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is required" >&2; exit 1; }
done
cluster=aaas
node="$cluster-control-plane"
# The host ports of the two edges; compose.yaml reads the same variables
# with the same defaults.
: "${EDGE_A_PORT:=8080}" "${EDGE_B_PORT:=8081}"
# kind publishes node images per Kubernetes release; the tag is the
# version everything else here is pinned to.
image="kindest/node:${KUBERNETES_VERSION}"

# .kind holds the cluster's kubeconfig and compose's NATS credentials:
# this user's only. The files in it are 0644 (below): the containers run
# as uid 65532 and see a bind-mounted file's own mode, never the
# directory's.
if [ -d .kind/kubeconfig ]; then
  echo "kind-up: .kind/kubeconfig is a directory: docker compose made it when compose-up ran before kind-up." >&2
  echo "kind-up: remove it (Docker made it, and perhaps .kind, as root: sudo rm -r .kind) and run make kind-up again" >&2
  exit 1
fi
mkdir -p .kind
chmod 0700 .kind

if ! kind get clusters | grep -qx "$cluster"; then
  # kind.yaml is written here, not kept in the repository, because its
  # ports come from EDGE_A_PORT and EDGE_B_PORT. The edges listen on the
  # same port inside the node's network as on the host's loopback.
  cat > .kind/kind.yaml <<EOF
# Written by hack/kind-up.sh: one node that also publishes the two edge
# ports of compose.yaml (the edges run in this node's network).
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
name: $cluster
nodes:
  - role: control-plane
    extraPortMappings:
      - {containerPort: $EDGE_A_PORT, hostPort: $EDGE_A_PORT, listenAddress: "127.0.0.1"}
      - {containerPort: $EDGE_B_PORT, hostPort: $EDGE_B_PORT, listenAddress: "127.0.0.1"}
EOF
  kind create cluster --config .kind/kind.yaml --image "$image"
else
  # A cluster's ports and image are fixed when it is created: say so
  # rather than leave compose's edges on ports the node does not publish.
  for port in "$EDGE_A_PORT" "$EDGE_B_PORT"; do
    if ! docker port "$node" "$port/tcp" 2>/dev/null | grep -qx "127.0.0.1:$port"; then
      echo "kind-up: cluster $cluster does not publish port $port (made with other EDGE_A_PORT/EDGE_B_PORT?): make kind-down, then make kind-up" >&2
      exit 1
    fi
  done
  running=$(docker inspect --format '{{.Config.Image}}' "$node")
  if [ "$running" != "$image" ]; then
    echo "kind-up: warning: cluster $cluster runs $running, versions.env pins $image: make kind-down, then make kind-up to move" >&2
  fi
fi
release="https://github.com/kubernetes-sigs/agent-sandbox/releases/download/${AGENT_SANDBOX_VERSION}"
kubectl --context "kind-$cluster" apply --server-side -f "$release/sandbox-with-extensions.yaml"
kubectl --context "kind-$cluster" -n agent-sandbox-system rollout status deploy --timeout=180s

# The sandboxes' image. (aaas:dev is compose's to build: nothing in the
# cluster runs it.) kind load docker-image pipes a plain docker save into
# the node's `ctr import --all-platforms`, which fails under Docker's
# containerd image store (kind#3795): the archive lists every platform of
# the base image's index, whose other platforms' blobs were never pulled.
# So the archive holds the node's platform only (docker save --platform,
# Docker API 1.48 and later; an older daemon saves what it has) and is
# loaded as an archive.
docker build --target dshsim -t dshsim:dev .
archive=.kind/images.tar
trap 'rm -f "$archive"' EXIT
save=(docker save -o "$archive")
api=$(docker version --format '{{.Server.APIVersion}}')
if [ "$(printf '%s\n' 1.48 "$api" | sort -V | head -n1)" = 1.48 ]; then
  save+=(--platform "$(docker version --format '{{.Server.Os}}/{{.Server.Arch}}')")
fi
"${save[@]}" dshsim:dev
kind load image-archive "$archive" --name "$cluster"
kubectl --context "kind-$cluster" apply -k manifests/dev/kind

# lifecycle (uid 65532) reads the kubeconfig through its bind mount:
# written under a umask of 077 it would be 0600 and unreadable there.
kind get kubeconfig --internal --name "$cluster" > .kind/kubeconfig.new
chmod 0644 .kind/kubeconfig.new
mv .kind/kubeconfig.new .kind/kubeconfig
# Compose's NATS identities, one nkey per process kind as in production,
# and its certificate. Kept across runs: fresh ones would lock out a
# running compose (make kind-down removes them).
if [ ! -e .kind/nats ]; then
  go run ./hack/natsauth -compose .kind/nats
fi
echo "kind cluster ready; now: export HANDSHAKE_KEYS=\$(openssl rand -base64 32); make compose-up"
