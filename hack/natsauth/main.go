// Command natsauth writes what the NATS identities of an install need.
//
//	go run ./hack/natsauth -secret [-namespace aaas] | kubectl apply -f -
//
// prints the aaas-nats Secret with fresh credentials: an nkey per process
// kind (edge, lifecycle, sweeper, broker, setup) and the NATS route password; and
// the aaas-nats-tls Secret (internal/natstls): a fresh CA and the NATS
// nodes' certificate for TLS on the client and route ports, in
// cert-manager's layout (with cert-manager, pass -tls=false and let a
// Certificate fill that Secret).
//
//	go run ./hack/natsauth -permissions > manifests/base/nats/permissions.conf
//
// prints the NATS permission table (internal/natsauth) in the server's
// configuration syntax; a test keeps the committed file equal to it, as it
// keeps README.md's table equal to what -table prints.
package main

import (
	"encoding/base64"
	"flag"
	"fmt"
	"os"
	"slices"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natstls"
)

func main() {
	secret := flag.Bool("secret", false, "print the aaas-nats Secret with fresh credentials (and aaas-nats-tls, see -tls)")
	withTLS := flag.Bool("tls", true, "with -secret: also print Secret aaas-nats-tls with a fresh CA and NATS certificate")
	permissions := flag.Bool("permissions", false, "print the permission table as NATS configuration")
	table := flag.Bool("table", false, "print the permission table for README.md")
	namespace := flag.String("namespace", config.DefaultControlPlaneNamespace, "namespace of the Secret (the control plane's)")
	flag.Parse()
	switch {
	case *permissions:
		fmt.Print(natsauth.ServerConfig())
	case *table:
		fmt.Print(natsauth.Table())
	case *secret:
		data, err := natsauth.SecretData()
		if err != nil {
			fmt.Fprintln(os.Stderr, "natsauth:", err)
			os.Exit(1)
		}
		printSecret("aaas-nats", *namespace, data)
		if *withTLS {
			tls, err := natstls.SecretData(*namespace)
			if err != nil {
				fmt.Fprintln(os.Stderr, "natsauth:", err)
				os.Exit(1)
			}
			fmt.Println("---")
			printSecret(natstls.SecretName, *namespace, tls)
		}
	default:
		flag.Usage()
		os.Exit(2)
	}
}

// printSecret writes an Opaque Secret as YAML, its keys sorted.
func printSecret(name, namespace string, data map[string][]byte) {
	keys := make([]string, 0, len(data))
	for k := range data {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	fmt.Printf("apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\ntype: Opaque\ndata:\n", name, namespace)
	for _, k := range keys {
		fmt.Printf("  %s: %s\n", k, base64.StdEncoding.EncodeToString(data[k]))
	}
}
