#!/usr/bin/env bash
# Checks that the gateway-api-sso exposure is safe to open: with
# AUTH_PROXY_HEADER set, the edge believes X-Forwarded-User, so nothing but
# oauth2-proxy may be able to reach it. Run after applying the install:
#   scripts/preflight-sso.sh [control-plane namespace] [sandbox namespace]
# (default aaas and aaas-sandboxes). The network check runs a probe pod
# (curl, PREFLIGHT_IMAGE, default curlimages/curl) that passes Pod Security
# `restricted` in the sandbox namespace, in the control plane's and in a
# namespace of its own, and sends the edge a spoofed identity header.
# Exit status: 0 all checks passed; 1 a check failed (the edge is reachable
# other than through oauth2-proxy, or the install is not the SSO variant);
# 2 the network check could not be made (the probe pod was refused, its
# image could not be pulled, or curl failed for another reason than a
# blocked connection), which proves nothing either way.
set -euo pipefail
ns="${1:-aaas}"
sandbox_ns="${2:-aaas-sandboxes}"
image="${PREFLIGHT_IMAGE:-curlimages/curl:8.11.1}"
timeout="${PREFLIGHT_TIMEOUT:-120}"
k() { kubectl -n "$ns" "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
untested() { echo "COULD NOT TEST: $*" >&2; exit 2; }
ok() { echo "ok:   $*"; }

header=$(k get deploy aaas-edge -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name=="AUTH_PROXY_HEADER")].value}')
[ -n "$header" ] || fail "aaas-edge has no AUTH_PROXY_HEADER: this is not the SSO variant"
ok "edge trusts $header"

type=$(k get svc aaas-edge -o jsonpath='{.spec.type}')
[ "$type" = "ClusterIP" ] || fail "Service aaas-edge is $type; it must stay ClusterIP"
ok "Service aaas-edge is ClusterIP"

if k get ingress -o jsonpath='{range .items[*]}{.spec.rules[*].http.paths[*].backend.service.name}{"\n"}{end}' 2>/dev/null | grep -qx 'aaas-edge'; then
  fail "an Ingress routes to aaas-edge: a second path around oauth2-proxy (remove exposure/ingress)"
fi
# One route may target the edge: the sandboxes' wildcard and nothing else
# (the edge takes no identity from a header on those hosts), so no request
# for the gateway's own host reaches the edge but through oauth2-proxy.
domain=$(k get configmap dsh-web -o jsonpath='{.data.sandbox-domain}' 2>/dev/null || true)
routes=$(k get httproute -o jsonpath='{range .items[*]}{.metadata.name}{"\t"}{.spec.hostnames[*]}{"\t"}{.spec.rules[*].backendRefs[*].name}{"\n"}{end}' 2>/dev/null || true)
while IFS=$'\t' read -r route hosts backends; do
  [ -n "$route" ] || continue
  grep -qw 'aaas-edge' <<<"$backends" || continue
  [ -n "$domain" ] || fail "HTTPRoute $route targets aaas-edge directly, and there is no SANDBOX_DOMAIN (ConfigMap dsh-web, key sandbox-domain) it could be for"
  [ "$hosts" = "*.$domain" ] || fail "HTTPRoute $route targets aaas-edge for hosts '$hosts'; only '*.$domain' (the sandboxes' origins) may"
done <<<"$routes"
ok "no route reaches the edge for the gateway's host except through oauth2-proxy"

k get networkpolicy aaas-edge-from-oauth2-proxy >/dev/null || fail "NetworkPolicy aaas-edge-from-oauth2-proxy is missing"
ok "NetworkPolicy aaas-edge-from-oauth2-proxy exists"

# The policy only helps if the CNI enforces it: a pod that is not
# oauth2-proxy must not get through, spoofed header or not. Only curl's own
# exit status says so: 7 (connection refused) or 28 (timed out) is a
# blocked connection; 0 reached the edge; anything else (no DNS, a pod
# that never ran) tested nothing.
probe_ns="aaas-preflight-$(printf '%04x%04x' "$RANDOM" "$RANDOM")"
pod=aaas-preflight
created_ns=""
cleanup() {
  for n in "$sandbox_ns" "$ns"; do
    kubectl -n "$n" delete pod "$pod" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  done
  [ -z "$created_ns" ] || kubectl delete namespace "$created_ns" --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT
kubectl create namespace "$probe_ns" >/dev/null || untested "cannot create namespace $probe_ns for the probe"
created_ns="$probe_ns"
kubectl label namespace "$probe_ns" pod-security.kubernetes.io/enforce=restricted >/dev/null
# Pods are admitted only once the namespace's default ServiceAccount exists.
for _ in $(seq 30); do
  kubectl -n "$probe_ns" get serviceaccount default >/dev/null 2>&1 && break
  sleep 1
done

url="http://aaas-edge.$ns.svc:8080/_/status"
probe() {
  local in="$1" phase="" code="" reason=""
  if ! out=$(kubectl -n "$in" create -f - 2>&1 <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $pod, labels: {app.kubernetes.io/name: aaas-preflight}}
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile: {type: RuntimeDefault}
  containers:
    - name: probe
      image: $image
      command: ["curl", "-sS", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}", "-H", "$header: preflight", "$url"]
      securityContext:
        allowPrivilegeEscalation: false
        capabilities: {drop: ["ALL"]}
EOF
  ); then
    untested "the probe pod was refused in namespace $in: $out"
  fi
  for _ in $(seq "$timeout"); do
    IFS='|' read -r phase code reason < <(kubectl -n "$in" get pod "$pod" -o jsonpath='{.status.phase}|{.status.containerStatuses[0].state.terminated.exitCode}|{.status.containerStatuses[0].state.waiting.reason}{"\n"}') || true
    case "$phase" in Succeeded | Failed) break ;; esac
    case "$reason" in ErrImagePull | ImagePullBackOff | ErrImageNeverPull | InvalidImageName | CreateContainerConfigError | CreateContainerError)
      untested "the probe pod in namespace $in cannot run: $reason (image $image)" ;;
    esac
    sleep 1
  done
  case "$phase" in Succeeded | Failed) ;; *) untested "the probe pod in namespace $in did not finish within ${timeout}s (phase ${phase:-unknown})" ;; esac
  log=$(kubectl -n "$in" logs "$pod" 2>&1 || true)
  kubectl -n "$in" delete pod "$pod" --wait=true >/dev/null 2>&1 || true
  case "$code" in
    0) fail "a pod in namespace $in that is not oauth2-proxy reached the edge (HTTP $log): the CNI does not enforce NetworkPolicy" ;;
    7 | 28) ok "a pod in namespace $in cannot reach the edge (blocked: curl exit $code)" ;;
    *) untested "the probe in namespace $in ended with curl exit ${code:-unknown}, which is not a blocked connection: $log" ;;
  esac
}
for in in "$sandbox_ns" "$ns" "$probe_ns"; do
  probe "$in"
done
echo "preflight passed"
