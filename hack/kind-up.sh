#!/usr/bin/env bash
# Creates the kind cluster for docker compose development (README, "Docker
# compose against kind"): agent-sandbox at the pinned version, the dev
# sandbox template running dshsim from the dshsim:dev image, and the
# kubeconfig compose mounts. Needs docker, kind and kubectl.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env
for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is required" >&2; exit 1; }
done
cluster=aaas
if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --config hack/kind.yaml
fi
release="https://github.com/kubernetes-sigs/agent-sandbox/releases/download/${AGENT_SANDBOX_VERSION}"
kubectl --context "kind-$cluster" apply --server-side -f "$release/sandbox-with-extensions.yaml"
kubectl --context "kind-$cluster" -n agent-sandbox-system rollout status deploy --timeout=180s

docker build -t aaas:dev .
docker build --target dshsim -t dshsim:dev .
kind load docker-image aaas:dev dshsim:dev --name "$cluster"
kubectl --context "kind-$cluster" apply -k manifests/dev/kind

mkdir -p .kind
kind get kubeconfig --internal --name "$cluster" > .kind/kubeconfig
echo "kind cluster ready; now: export HANDSHAKE_KEYS=\$(openssl rand -base64 32); make compose-up"
