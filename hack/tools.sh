#!/usr/bin/env bash
# Installs what the tests and `make run` need, once per version, into a cache
# outside the repository (so a fresh clone in CI reuses it):
#   debian: etcd-server (Debian's etcd 3.4 serves kube-apiserver fine),
#           chromium for the browser tests, and the real node's runtime:
#           containerd, runc, the CNI plugins, iptables, ipset, conntrack;
#           nginx (the pooling front of the proxy tests), Docker's engine
#           (docker.io: the deployment tier's compose run) and Node.js
#           where the machine has none; via apt-get when missing;
#   go:     kube-apiserver, kube-controller-manager, the real node's
#           kubelet, kube-proxy and kube-scheduler, and kubectl (the
#           deployment tier runs README's commands) from k8s.io/kubernetes;
#           agent-sandbox-controller, kube-router, CoreDNS (its plugins the
#           node uses only), staticcheck, Helm, Traefik, oauth2-proxy,
#           an OpenID Connect provider (zitadel/oidc) and Docker Compose;
#           built from Go modules.
#   chp:    configurable-http-proxy (JupyterHub's proxy, a peer in
#           `make bench`) from npm into chp-$CHP_VERSION.
#   bench:  the peers `make bench` builds from Go modules: Caddy (Traefik
#           is gotools'), and chp.
# Usage: hack/tools.sh [debian|go|all|chp|bench] [extra debian packages...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=../versions.env
. ./versions.env

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/aaas/tools"
what="${1:-all}"
shift || true

debian() {
  local missing=()
  # docker.io: the engine the deployment tier runs compose.yaml on.
  local want=(etcd-server chromium containerd runc containernetworking-plugins iptables ipset conntrack nginx-light docker.io "$@")
  # The proxy tests' Node.js upstream: the machine's Node, else Debian's.
  command -v node >/dev/null || want+=(nodejs)
  command -v npm >/dev/null || want+=(npm)
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "tools: installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# build DIR MODULE_DIR PKG... builds into a temp dir and renames it into
# place, so an interrupted build never looks finished. LDFLAGS adds to the
# linker flags; RENAME="FROM TO" renames a binary go install named after
# its package's folder.
build() {
  local dir="$1" mod="$2"
  shift 2
  [ -d "$dir" ] && return 0
  echo "tools: building $(basename "$dir") (first time only; several minutes)"
  local tmp="$dir.tmp.$$" start=$SECONDS
  rm -rf "$tmp"
  mkdir -p "$tmp"
  (cd "$mod" && GOBIN="$tmp" CGO_ENABLED=0 go install -trimpath -ldflags="-s -w ${LDFLAGS:-}" "$@")
  if [ -n "${RENAME:-}" ]; then
    # shellcheck disable=SC2086
    set -- $RENAME
    mv "$tmp/$1" "$tmp/$2"
  fi
  mv "$tmp" "$dir"
  echo "tools: built $(basename "$dir") in $((SECONDS - start))s"
}

gotools() {
  build "$CACHE/agent-sandbox-$AGENT_SANDBOX_VERSION" hack/tools/agent-sandbox \
    sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller
  build "$CACHE/staticcheck-$STATICCHECK_VERSION" hack/tools/staticcheck \
    honnef.co/go/tools/cmd/staticcheck
  # Every Kubernetes binary is stamped like a release build: the API server
  # reports its version to clients (Helm checks a chart's kubeVersion
  # against it), the kubelet its own to the API server.
  local minor=${KUBERNETES_VERSION#v1.}
  local stamp="-X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*}"
  LDFLAGS="$stamp" \
    build "$CACHE/kubernetes-control-$KUBERNETES_VERSION" hack/tools/kubernetes \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
  LDFLAGS="$stamp" \
    build "$CACHE/kubernetes-node-$KUBERNETES_VERSION" hack/tools/kubernetes \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kube-scheduler
  # kubectl, which the deployment tier runs README's install commands with.
  LDFLAGS="$stamp" \
    build "$CACHE/kubectl-$KUBERNETES_VERSION" hack/tools/kubernetes k8s.io/kubernetes/cmd/kubectl
  build "$CACHE/kube-router-$KUBE_ROUTER_VERSION" hack/tools/kube-router \
    github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
  build "$CACHE/coredns-$COREDNS_VERSION" hack/tools/coredns .
  # Traefik, the deployment tier's ingress controller (test bed only).
  LDFLAGS="-X github.com/traefik/traefik/v3/pkg/version.Version=$TRAEFIK_VERSION" \
    build "$CACHE/traefik-$TRAEFIK_VERSION" hack/tools/traefik github.com/traefik/traefik/v3/cmd/traefik
  # oauth2-proxy and the OpenID Connect provider it signs users in with,
  # the gateway-sso exposure's test bed.
  LDFLAGS="-X github.com/oauth2-proxy/oauth2-proxy/v7/pkg/version.VERSION=$OAUTH2_PROXY_VERSION" \
    build "$CACHE/oauth2-proxy-$OAUTH2_PROXY_VERSION" hack/tools/oauth2-proxy github.com/oauth2-proxy/oauth2-proxy/v7
  build "$CACHE/oidcop-$ZITADEL_OIDC_VERSION" hack/tools/oidcop .
  # Docker Compose, which the deployment tier runs compose.yaml with.
  LDFLAGS="-X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" RENAME="cmd docker-compose" \
    build "$CACHE/compose-$COMPOSE_VERSION" hack/tools/compose github.com/docker/compose/v2/cmd
  # Helm, which the chart tests render and install charts/aaas with.
  LDFLAGS="-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    build "$CACHE/helm-$HELM_VERSION" hack/tools/helm helm.sh/helm/v4/cmd/helm
}

# chp installs configurable-http-proxy with npm into a temp dir and renames
# it into place, as build does.
chp() {
  local dir="$CACHE/chp-$CHP_VERSION"
  [ -x "$dir/node_modules/.bin/configurable-http-proxy" ] && return 0
  echo "tools: installing configurable-http-proxy $CHP_VERSION"
  local tmp="$dir.tmp.$$"
  rm -rf "$tmp" "$dir"
  mkdir -p "$tmp"
  npm install --prefix "$tmp" --no-audit --no-fund --loglevel=error "configurable-http-proxy@$CHP_VERSION" >/dev/null
  mv "$tmp" "$dir"
}

# benchpeers: the Go reverse proxies `make bench` measures beside nginx,
# haproxy and chp that `make test` does not need (Traefik is built by
# gotools for the deployment tier and reused).
benchpeers() {
  LDFLAGS="-X github.com/caddyserver/caddy/v2.CustomVersion=$CADDY_VERSION" \
    build "$CACHE/caddy-$CADDY_VERSION" hack/tools/caddy github.com/caddyserver/caddy/v2/cmd/caddy
  chp
}

case "$what" in
  debian) debian "$@" ;;
  go) gotools ;;
  all) debian "$@"; gotools ;;
  chp) chp ;;
  bench) benchpeers ;;
  *) echo "usage: $0 [debian|go|all|chp|bench] [packages...]" >&2; exit 2 ;;
esac
