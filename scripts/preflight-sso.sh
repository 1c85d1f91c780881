#!/usr/bin/env bash
# Checks that the gateway-api-sso exposure is safe to open: with
# AUTH_PROXY_HEADER set, the edge believes X-Forwarded-User, so nothing but
# oauth2-proxy may be able to reach it. Run after applying the overlay:
#   scripts/preflight-sso.sh [namespace]
# Exits non-zero on the first failed check.
set -euo pipefail
ns="${1:-dsh-demo}"
k() { kubectl -n "$ns" "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
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
if k get httproute -o jsonpath='{range .items[*]}{.spec.rules[*].backendRefs[*].name}{"\n"}{end}' 2>/dev/null | grep -qw 'aaas-edge'; then
  fail "an HTTPRoute targets aaas-edge directly"
fi
ok "no route reaches the edge except through oauth2-proxy"

k get networkpolicy aaas-edge-from-oauth2-proxy >/dev/null || fail "NetworkPolicy aaas-edge-from-oauth2-proxy is missing"
ok "NetworkPolicy aaas-edge-from-oauth2-proxy exists"

# The policy only helps if the CNI enforces it: a pod that is not
# oauth2-proxy must not get through, spoofed header or not.
if k run aaas-preflight --rm -i --restart=Never --quiet --image=curlimages/curl:8.11.1 --command -- \
    curl -sS -m 5 -o /dev/null -w '%{http_code}' -H "$header: preflight" http://aaas-edge:8080/_/status 2>/dev/null; then
  fail "a pod that is not oauth2-proxy reached the edge: the CNI does not enforce NetworkPolicy"
fi
ok "other pods cannot reach the edge"
echo "preflight passed"
