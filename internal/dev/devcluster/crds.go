package devcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensions "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/yaml"

	"github.com/aaas-project/aaas"
)

// CRDs returns the agent-sandbox CRDs of the pinned release, with the
// conversion webhook stanza removed: the webhook is off here, and a
// conversion strategy pointing at a missing webhook would break every read.
func CRDs() ([]*apiextensionsv1.CustomResourceDefinition, error) {
	return crdsFrom("sigs.k8s.io/agent-sandbox", aaas.Version("AGENT_SANDBOX_VERSION"), "k8s/crds")
}

// GatewayAPICRDs returns the standard-channel Gateway API CRDs of the
// pinned release, for validating the gateway-api-sso exposure.
func GatewayAPICRDs() ([]*apiextensionsv1.CustomResourceDefinition, error) {
	return crdsFrom("sigs.k8s.io/gateway-api", aaas.Version("GATEWAY_API_VERSION"), "config/crd/standard")
}

// PrometheusOperatorCRDs returns the PodMonitor and PrometheusRule CRDs
// of the pinned Prometheus Operator, for validating manifests/monitoring.
func PrometheusOperatorCRDs() ([]*apiextensionsv1.CustomResourceDefinition, error) {
	all, err := crdsFrom("github.com/prometheus-operator/prometheus-operator", aaas.Version("PROMETHEUS_OPERATOR_VERSION"), "example/prometheus-operator-crd")
	if err != nil {
		return nil, err
	}
	var crds []*apiextensionsv1.CustomResourceDefinition
	for _, c := range all {
		if c.Name == "podmonitors.monitoring.coreos.com" || c.Name == "prometheusrules.monitoring.coreos.com" {
			crds = append(crds, c)
		}
	}
	if len(crds) != 2 {
		return nil, fmt.Errorf("PodMonitor and PrometheusRule CRDs not both found (%d)", len(crds))
	}
	return crds, nil
}

// InstallPrometheusOperatorCRDs installs PrometheusOperatorCRDs.
func (c *Cluster) InstallPrometheusOperatorCRDs(ctx context.Context) error {
	return c.installFrom(ctx, PrometheusOperatorCRDs)
}

func crdsFrom(module, version, dir string) ([]*apiextensionsv1.CustomResourceDefinition, error) {
	root, err := ModuleDir(module, version)
	if err != nil {
		return nil, err
	}
	files, err := filepath.Glob(filepath.Join(root, dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("CRDs not found in %s: %v", filepath.Join(root, dir), err)
	}
	var crds []*apiextensionsv1.CustomResourceDefinition
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("read CRD: %w", err)
		}
		crd := &apiextensionsv1.CustomResourceDefinition{}
		if err := yaml.Unmarshal(b, crd); err != nil {
			return nil, fmt.Errorf("decode CRD %s: %w", filepath.Base(f), err)
		}
		if crd.Kind != "CustomResourceDefinition" {
			continue // policies shipped next to the CRDs
		}
		crd.Spec.Conversion = nil
		crds = append(crds, crd)
	}
	return crds, nil
}

// InstallGatewayAPI adds the Gateway API CRDs to the cluster.
func (c *Cluster) InstallGatewayAPI(ctx context.Context) error {
	return c.installFrom(ctx, GatewayAPICRDs)
}

// installFrom installs the CRDs source returns.
func (c *Cluster) installFrom(ctx context.Context, source func() ([]*apiextensionsv1.CustomResourceDefinition, error)) error {
	crds, err := source()
	if err != nil {
		return err
	}
	return c.install(ctx, crds)
}

func (c *Cluster) installCRDs(ctx context.Context) error { return c.installFrom(ctx, CRDs) }

// install creates CRDs and waits until they are established.
func (c *Cluster) install(ctx context.Context, crds []*apiextensionsv1.CustomResourceDefinition) error {
	client, err := apiextensions.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("apiextensions client: %w", err)
	}
	for _, crd := range crds {
		if _, err := client.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create CRD %s: %w", crd.Name, err)
		}
	}
	for _, crd := range crds {
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			got, err := client.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			for _, cond := range got.Status.Conditions {
				if cond.Type == apiextensionsv1.Established && cond.Status == apiextensionsv1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("CRD %s not established: %w", crd.Name, err)
		}
	}
	return nil
}
