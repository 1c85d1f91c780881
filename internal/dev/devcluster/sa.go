package devcluster

import (
	"context"
	"fmt"
	"path/filepath"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// ServiceAccountKubeconfig mints a token for the ServiceAccount
// namespace/name (which must exist) and writes a kubeconfig that
// authenticates as it, so a process runs with exactly that account's RBAC.
func (c *Cluster) ServiceAccountKubeconfig(ctx context.Context, namespace, name string) (string, *rest.Config, error) {
	exp := int64(24 * 3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", nil, fmt.Errorf("token for %s/%s: %w", namespace, name, err)
	}
	path := filepath.Join(c.Dir, "sa-"+namespace+"-"+name+".kubeconfig")
	if err := writeKubeconfig(path, c.server, c.pki.caPEM(), &clientcmdapi.AuthInfo{Token: tr.Status.Token}); err != nil {
		return "", nil, err
	}
	cfg := &rest.Config{
		Host: c.server, BearerToken: tr.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.caPEM()},
	}
	return path, cfg, nil
}
