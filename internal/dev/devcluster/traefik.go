package devcluster

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/aaas-project/aaas"
)

// TraefikBinary is Traefik at TRAEFIK_VERSION, which `make tools` builds
// from its Go module (the real node runs it from an image of it).
func TraefikBinary() string {
	return filepath.Join(toolsCache(), "traefik-"+aaas.Version("TRAEFIK_VERSION"), "traefik")
}

// TraefikNamespace is where InstallTraefik runs the controller, labelled
// as an operator's Traefik is (app.kubernetes.io/name: traefik), so the
// install's exposure policies select it by values, not by a fixed name.
const TraefikNamespace = "traefik"

// TraefikGatewayClass is the GatewayClass InstallTraefik makes, whose
// Gateways Traefik's Gateway API provider serves. Traefik matches a
// Gateway's listener to the entry point of the same port, so the
// gateway-sso exposure's listeners say 8443 (websecure), not 443.
const TraefikGatewayClass = "traefik"

// traefikManifest is Traefik as an operator runs it in front of aaas: its
// Kubernetes Ingress provider for IngressClass traefik and its Gateway
// API provider for GatewayClass traefik, an entry point websecure on 8443
// (TLS) and web on 8000, as a non-root, read-only pod with the rights its
// providers need (Traefik's documented Gateway RBAC less the OTel and
// experimental-channel rules), and a Service on 443 and 80.
const traefikManifest = `
apiVersion: v1
kind: Namespace
metadata:
  name: traefik
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: traefik, namespace: traefik}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: traefik}
rules:
  - apiGroups: [""]
    resources: [services, secrets, nodes, endpoints]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [ingresses, ingressclasses]
    verbs: [get, list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [ingresses/status]
    verbs: [update]
  - apiGroups: [""]
    resources: [namespaces]
    verbs: [list, watch]
  - apiGroups: [""]
    resources: [configmaps]
    verbs: [get, list, watch]
  - apiGroups: [gateway.networking.k8s.io]
    resources: [gatewayclasses, gateways, httproutes, grpcroutes, referencegrants, backendtlspolicies]
    verbs: [get, list, watch]
  - apiGroups: [gateway.networking.k8s.io]
    resources: [gatewayclasses/status, gateways/status, httproutes/status, grpcroutes/status, backendtlspolicies/status]
    verbs: [update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: traefik}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: traefik}
subjects: [{kind: ServiceAccount, name: traefik, namespace: traefik}]
---
apiVersion: networking.k8s.io/v1
kind: IngressClass
metadata: {name: traefik}
spec: {controller: traefik.io/ingress-controller}
---
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {name: traefik}
spec: {controllerName: traefik.io/gateway-controller}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: traefik, namespace: traefik}
spec:
  replicas: 1
  selector: {matchLabels: {app.kubernetes.io/name: traefik}}
  template:
    metadata: {labels: {app.kubernetes.io/name: traefik}}
    spec:
      serviceAccountName: traefik
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        seccompProfile: {type: RuntimeDefault}
      containers:
        - name: traefik
          image: IMAGE
          args:
            - --entrypoints.web.address=:8000
            - --entrypoints.websecure.address=:8443
            - --entrypoints.websecure.http.tls=true
            - --entrypoints.traefik.address=:9000
            - --ping=true
            - --providers.kubernetesingress=true
            - --providers.kubernetesingress.ingressclass=traefik
            - --providers.kubernetesgateway=true
            - --log.level=INFO
          ports:
            - {name: web, containerPort: 8000}
            - {name: websecure, containerPort: 8443}
            - {name: traefik, containerPort: 9000}
          readinessProbe:
            httpGet: {path: /ping, port: traefik}
            periodSeconds: 2
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
---
apiVersion: v1
kind: Service
metadata: {name: traefik, namespace: traefik}
spec:
  selector: {app.kubernetes.io/name: traefik}
  ports:
    - {name: websecure, port: 443, targetPort: websecure}
    - {name: web, port: 80, targetPort: web}
`

// InstallTraefik runs Traefik from image (an image of TraefikBinary the
// node holds), after the Gateway API CRDs its Gateway provider watches,
// and returns the address of its websecure entry point, once it is ready:
// what the install's DNS records would point at.
func (c *Cluster) InstallTraefik(ctx context.Context, image string) (string, error) {
	if err := c.InstallGatewayAPI(ctx); err != nil {
		return "", err
	}
	objs, err := objects(traefikManifest, image)
	if err != nil {
		return "", fmt.Errorf("traefik manifest: %w", err)
	}
	if err := c.Apply(ctx, "", objs...); err != nil {
		return "", err
	}
	if err := c.WaitRollout(ctx, TraefikNamespace, 3*time.Minute); err != nil {
		return "", err
	}
	return c.runningPod(ctx, TraefikNamespace, "app.kubernetes.io/name=traefik", "8443")
}

// objects is manifest's YAML documents, IMAGE replaced by image.
func objects(manifest, image string) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, doc := range strings.Split(strings.Replace(manifest, "IMAGE", image, 1), "\n---\n") {
		o := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &o.Object); err != nil {
			return nil, err
		}
		objs = append(objs, o)
	}
	return objs, nil
}
