package devcluster

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas"
)

// OAuth2ProxyBinary is oauth2-proxy at OAUTH2_PROXY_VERSION, which `make
// tools` builds from its Go module (the real node runs it from an image
// of it, in place of the chart's quay.io image).
func OAuth2ProxyBinary() string {
	return filepath.Join(toolsCache(), "oauth2-proxy-"+aaas.Version("OAUTH2_PROXY_VERSION"), "oauth2-proxy")
}

// OIDCProviderBinary is hack/tools/oidcop, zitadel/oidc's OpenID
// Connect provider at ZITADEL_OIDC_VERSION, which `make tools` builds.
func OIDCProviderBinary() string {
	return filepath.Join(toolsCache(), "oidcop-"+aaas.Version("ZITADEL_OIDC_VERSION"), "oidcop")
}

// OIDCNamespace and OIDCService name where InstallOIDCProvider runs the
// provider: its issuer is https://oidc.sso.svc.cluster.local, a name
// every pod resolves (browsers on the machine are pointed at the pod).
const (
	OIDCNamespace = "sso"
	OIDCService   = "oidc"
	OIDCIssuer    = "https://" + OIDCService + "." + OIDCNamespace + ".svc.cluster.local"
)

// oidcManifest is the organisation's identity provider as a non-root,
// read-only pod serving TLS on 8443 behind a Service on 443, its
// configuration (hack/tools/oidcop's JSON) and certificate in a Secret.
const oidcManifest = `
apiVersion: v1
kind: Namespace
metadata: {name: sso}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: oidc, namespace: sso}
spec:
  replicas: 1
  selector: {matchLabels: {app.kubernetes.io/name: oidc}}
  template:
    metadata: {labels: {app.kubernetes.io/name: oidc}}
    spec:
      automountServiceAccountToken: false
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        seccompProfile: {type: RuntimeDefault}
      containers:
        - name: oidc
          image: IMAGE
          args: [/etc/oidcop/config.json]
          ports:
            - {name: https, containerPort: 8443}
          readinessProbe:
            httpGet: {path: /.well-known/openid-configuration, port: https, scheme: HTTPS}
            periodSeconds: 2
          volumeMounts:
            - {name: config, mountPath: /etc/oidcop, readOnly: true}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
      volumes:
        - name: config
          secret: {secretName: oidc}
---
apiVersion: v1
kind: Service
metadata: {name: oidc, namespace: sso}
spec:
  selector: {app.kubernetes.io/name: oidc}
  ports:
    - {name: https, port: 443, targetPort: https}
`

// InstallOIDCProvider runs the provider from image (an image of
// OIDCProviderBinary the node holds) with config, the provider's JSON
// whose Listen is ":8443" and whose Cert and Key are
// /etc/oidcop/tls.crt and tls.key, and that certificate and key (PEM,
// for the issuer's name). It returns the pod's address once the provider
// serves its discovery document: where a browser's name for the issuer
// points.
func (c *Cluster) InstallOIDCProvider(ctx context.Context, image string, config, cert, key []byte) (string, error) {
	objs, err := objects(oidcManifest, image)
	if err != nil {
		return "", fmt.Errorf("oidc manifest: %w", err)
	}
	if err := c.Apply(ctx, "", objs[0]); err != nil {
		return "", err
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "oidc", Namespace: OIDCNamespace},
		Data:       map[string][]byte{"config.json": config, "tls.crt": cert, "tls.key": key},
	}
	if _, err := c.Client.CoreV1().Secrets(OIDCNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		return "", fmt.Errorf("oidc Secret: %w", err)
	}
	if err := c.Apply(ctx, "", objs[1:]...); err != nil {
		return "", err
	}
	if err := c.WaitRollout(ctx, OIDCNamespace, 3*time.Minute); err != nil {
		return "", err
	}
	return c.runningPod(ctx, OIDCNamespace, "app.kubernetes.io/name=oidc", "8443")
}

// runningPod is host:port of a running, not terminating pod matching
// selector in ns.
func (c *Cluster) runningPod(ctx context.Context, ns, selector, port string) (string, error) {
	var addr string
	err := waitFor(ctx, nil, ns+"'s pod", time.Minute, func() error {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" && p.DeletionTimestamp == nil {
				addr = net.JoinHostPort(p.Status.PodIP, port)
				return nil
			}
		}
		return fmt.Errorf("no running pod %s in %s", selector, ns)
	})
	return addr, err
}
