{{/* The aaas image, by digest when one is given. */}}
{{- define "aaas.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* Labels on every object; selectors use app.kubernetes.io/name only, so
they never change between releases. */}}
{{- define "aaas.labels" -}}
app.kubernetes.io/part-of: aaas
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "aaas.secretsName" -}}
{{ .Values.secrets.existingSecret | default .Values.secrets.generatedName }}
{{- end -}}
{{- define "aaas.natsSecret" -}}
{{ .Values.nats.existingSecret | default "aaas-nats" }}
{{- end -}}
{{- define "aaas.natsTLSSecret" -}}
{{ .Values.nats.tls.existingSecret | default "aaas-nats-tls" }}
{{- end -}}

{{/* The NATS URL every process dials. */}}
{{- define "aaas.natsURL" -}}
{{- if .Values.nats.bundled -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.nats.replicas) -}}
{{- $urls = append $urls (printf "nats://nats-%d.nats-headless:4222" $i) -}}
{{- end -}}
{{ join "," $urls }}
{{- else -}}
{{ required "nats.external.url is required with nats.bundled=false" .Values.nats.external.url }}
{{- end -}}
{{- end -}}

{{/* The pod security context of every aaas process (the image's user, by
number: the kubelet can only check runAsNonRoot against a numeric user). */}}
{{- define "aaas.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile: {type: RuntimeDefault}
{{- end -}}
{{- define "aaas.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: ["ALL"]}
{{- end -}}

{{/* One process kind's NATS identity and the CA, as env entries. */}}
{{- define "aaas.natsEnv" -}}
- name: NATS_NKEY
  value: /etc/aaas/nats/{{ . }}.nk
- name: NATS_CA
  value: /etc/aaas/nats-ca/ca.crt
- name: INSTANCE_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}
{{- define "aaas.natsMounts" -}}
- {name: nats-identity, mountPath: /etc/aaas/nats, readOnly: true}
- {name: nats-ca, mountPath: /etc/aaas/nats-ca, readOnly: true}
{{- end -}}
{{/* The volumes of natsMounts: dict "ctx" $ "role" "edge". */}}
{{- define "aaas.natsVolumes" -}}
- name: nats-identity
  secret:
    secretName: {{ include "aaas.natsSecret" .ctx }}
    defaultMode: 0440
    items: [{key: {{ .role }}.nk, path: {{ .role }}.nk}]
- name: nats-ca
  secret:
    secretName: {{ include "aaas.natsTLSSecret" .ctx }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end -}}

{{/* Scheduling of one process: its values block. */}}
{{- define "aaas.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Anti-affinity spreading a process's replicas over nodes, unless the
values give an affinity of their own. */}}
{{- define "aaas.affinity" -}}
{{- if .values.affinity -}}
{{ toYaml .values.affinity }}
{{- else -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            app.kubernetes.io/name: {{ .name }}
{{- end -}}
{{- end -}}

{{/* The checksum annotations that roll a pod when what it reads changes. */}}
{{- define "aaas.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/config.yaml") . | sha256sum }}
{{- end -}}

{{/* Render-time checks: what cannot be said in values.schema.json. */}}
{{- define "aaas.validate" -}}
{{- if and .Values.ingress.enabled .Values.gatewaySSO.enabled -}}
{{- fail "choose one exposure: ingress.enabled and gatewaySSO.enabled are both true (set one to false; both false exposes only the edge Service)" -}}
{{- end -}}
{{- if and .Values.gatewaySSO.enabled (not .Values.gatewaySSO.gatewayClassName) -}}
{{- fail "gatewaySSO.gatewayClassName is required with gatewaySSO.enabled: the GatewayClass of your Gateway API implementation" -}}
{{- end -}}
{{- if and .Values.gatewaySSO.enabled (not .Values.gatewaySSO.allow) -}}
{{- fail "gatewaySSO.allow is required with gatewaySSO.enabled (AUTH_PROXY_ALLOW): the logins and group:<name> entries SSO admits, or * for everyone oauth2-proxy admits" -}}
{{- end -}}
{{- if not .Values.hosts.public -}}
{{- fail "hosts.public needs at least one host name" -}}
{{- end -}}
{{- if eq .Release.Namespace .Values.sandboxNamespace.name -}}
{{- fail (printf "sandboxNamespace.name (%s) must differ from the release's namespace: tenants never share the control plane's namespace" .Values.sandboxNamespace.name) -}}
{{- end -}}
{{- $seen := dict -}}
{{- $objects := dict -}}
{{- range $i, $p := .Values.sandbox.profiles -}}
{{- if hasKey $seen $p.name -}}
{{- fail (printf "sandbox.profiles names %q twice: each profile is one warm pool and template" $p.name) -}}
{{- end -}}
{{- $_ := set $seen $p.name true -}}
{{- range $kind, $name := dict "warm pool" (include "aaas.profilePool" $p) "template" (include "aaas.profileTemplate" $p) -}}
{{- if hasKey $objects (printf "%s %s" $kind $name) -}}
{{- fail (printf "sandbox.profiles: two profiles are of %s %s: each profile is one warm pool and template of its own" $kind $name) -}}
{{- end -}}
{{- $_ := set $objects (printf "%s %s" $kind $name) true -}}
{{- end -}}
{{- if and (eq $i 0) $p.groups -}}
{{- fail (printf "sandbox.profiles[0] (%s) is the default every user may get: it names no groups (put a profile open to all first)" $p.name) -}}
{{- end -}}
{{- if and $p.groups (not $.Values.gatewaySSO.enabled) -}}
{{- fail (printf "sandbox.profiles %q names groups, which need gatewaySSO.enabled: groups come from the SSO proxy" $p.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Label selectors the operator names (their ingress controller's,
Gateway's and Prometheus's pods and namespaces): each value replaces its
default, which lives here, not in values.yaml, because Helm merges a
values file's maps into the chart's, so a default label there could never
be taken away, only joined by the operator's (and a null, the one way to
remove it, fails the schema on every later --reuse-values upgrade). */}}
{{- define "aaas.monitoringNamespaceLabels" -}}
{{ toYaml (.Values.monitoring.namespaceLabels | default (dict "kubernetes.io/metadata.name" "monitoring")) }}
{{- end -}}
{{- define "aaas.ingressNamespaceLabels" -}}
{{ toYaml (.Values.ingress.controller.namespaceLabels | default (dict "kubernetes.io/metadata.name" "traefik")) }}
{{- end -}}
{{- define "aaas.ingressPodLabels" -}}
{{ toYaml (.Values.ingress.controller.podLabels | default (dict "app.kubernetes.io/name" "traefik")) }}
{{- end -}}
{{- define "aaas.gatewayNamespaceLabels" -}}
{{ toYaml (.Values.gatewaySSO.gateway.namespaceLabels | default (dict "kubernetes.io/metadata.name" "gateway-system")) }}
{{- end -}}
{{- define "aaas.gatewayPodLabels" -}}
{{ toYaml (.Values.gatewaySSO.gateway.podLabels | default (dict "gateway.networking.k8s.io/gateway-name" "aaas")) }}
{{- end -}}

{{/* A profile's warm pool and SandboxTemplate: dsh-<name> and
dsh-web-<name>, unless it names its own (warmPool, template), as the
first profile of an install that had none does to keep its dsh-pool and
dsh-web, and the sandboxes and spares made of them. */}}
{{- define "aaas.profilePool" -}}
{{- .warmPool | default (printf "dsh-%s" .name) -}}
{{- end -}}
{{- define "aaas.profileTemplate" -}}
{{- .template | default (printf "dsh-web-%s" .name) -}}
{{- end -}}
