// Command setup is the provisioning step of an install and of every
// upgrade: with the setup identity, the only one allowed to, it creates or
// updates the streams, buckets and the commands' consumer the other
// processes only check for, then exits. It runs as lifecycle's init
// container; see the README for its configuration. `setup
// credentials-keygen` instead prints a new key pair for BYOK
// (CREDENTIALS_KEYS for the brokers, CREDENTIALS_PUBLIC_KEY for the edges)
// and exits. `setup secrets` is the chart's pre-install hook: it creates
// the Secrets GENERATE_*_SECRET name when absent (installsecrets), with
// in-cluster credentials, and exits. `setup smoke signup|signin-redirect|
// blocked` is the chart's `helm test` (package smoke). `setup backup DIR`
// copies every stream and bucket into DIR with the backup identity;
// `setup restore [-replace] DIR` puts them back with the setup identity
// (package backup).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/installsecrets"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/process"
	"github.com/aaas-project/aaas/internal/smoke"
)

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "credentials-keygen":
			if err := credentials.WriteKeygen(os.Stdout); err != nil {
				process.Fatal("setup credentials-keygen", err)
			}
			return
		case "secrets":
			if err := secrets(); err != nil {
				process.Fatal("setup secrets", err)
			}
			return
		case "rotate-nats":
			os.Exit(rotateNATS(os.Args[2:]))
		case "smoke":
			os.Exit(smokeTest(os.Args[2:]))
		case "backup", "restore":
			os.Exit(backupOrRestore(os.Args[1], os.Args[2:]))
		}
	}
	cfg, err := config.LoadSetup(config.FromOS())
	if err == nil {
		err = process.Setup(cfg)
	}
	if err != nil {
		process.Fatal("setup", err)
	}
}

// secrets prints one line per Secret: its name and whether it was created
// or kept (never its contents).
func secrets() error {
	cfg, err := config.LoadSecrets(config.FromOS())
	if err != nil {
		return err
	}
	client, err := inCluster()
	if err != nil {
		return err
	}
	done, err := installsecrets.Ensure(context.Background(), client, cfg)
	for _, o := range done {
		verb := "kept (it exists; never replaced)"
		switch {
		case o.Created:
			verb = "created"
		case len(o.Added) > 0:
			verb = "kept, and given the keys it lacked: " + strings.Join(o.Added, ", ")
		}
		fmt.Printf("secret %s/%s %s\n", cfg.Namespace, o.Name, verb)
	}
	return err
}

// inCluster is a Kubernetes client with the pod's own ServiceAccount.
func inCluster() (kubernetes.Interface, error) {
	rc, err := rest.InClusterConfig()
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(rc)
}

// rotateNATS runs `setup rotate-nats ROLE...`: exit 0 rotated, 1 failed
// (nothing changed), 2 bad usage or configuration.
func rotateNATS(args []string) int {
	var roles []natsauth.Role
	// Roles come as arguments, or several in one (spaces or commas), as a
	// shell variable puts them into a pod's command.
	for _, a := range strings.FieldsFunc(strings.Join(args, " "), func(c rune) bool { return c == ' ' || c == ',' }) {
		r, err := natsauth.ParseRole(a)
		if err != nil {
			fmt.Fprintln(os.Stderr, "setup rotate-nats:", err)
			return 2
		}
		roles = append(roles, r)
	}
	if len(roles) == 0 {
		fmt.Fprintln(os.Stderr, "usage: setup rotate-nats ROLE... (the NATS identities to rotate; see docs/RUNBOOK.md)")
		return 2
	}
	cfg, err := config.LoadSecrets(config.FromOS())
	if err != nil {
		fmt.Fprintln(os.Stderr, "setup rotate-nats:", err)
		return 2
	}
	client, err := inCluster()
	if err == nil {
		err = installsecrets.RotateNATS(context.Background(), client, cfg, roles)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "setup rotate-nats:", err)
		return 1
	}
	for _, r := range roles {
		fmt.Printf("%s: the staged identity is now the current one, and a fresh one is staged; restart %s's processes, then NATS\n", r, r)
	}
	return 0
}

// backupOrRestore runs `setup backup DIR` or `setup restore [-replace]
// DIR`: exit 0 done, 1 failed, 2 bad usage or configuration.
func backupOrRestore(verb string, args []string) int {
	fs := flag.NewFlagSet(verb, flag.ContinueOnError)
	replace := false
	if verb == "restore" {
		fs.BoolVar(&replace, "replace", false, "delete each stream that exists before restoring it")
	}
	usage := "usage: setup backup DIR|- (NATS_NKEY: the backup identity's seed; - writes a tar archive to stdout)"
	if verb == "restore" {
		usage = "usage: setup restore [-replace] DIR|- (NATS_NKEY: the setup identity's seed; - reads a tar archive from stdin)"
	}
	if err := fs.Parse(args); err != nil || fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, usage)
		return 2
	}
	cfg, err := config.LoadSetup(config.FromOS())
	if err != nil {
		fmt.Fprintln(os.Stderr, "setup "+verb+":", err)
		return 2
	}
	// With DIR "-" the archive is stdout (or stdin), so progress goes to stderr.
	out := io.Writer(os.Stdout)
	if fs.Arg(0) == "-" {
		out = os.Stderr
	}
	if verb == "backup" {
		err = process.Backup(cfg, fs.Arg(0), out)
	} else {
		err = process.Restore(cfg, fs.Arg(0), replace, out)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "setup "+verb+":", err)
		return 1
	}
	return 0
}

// smokeTest runs one check of package smoke: exit 0 passed, 1 failed, 2
// could not test (or bad usage).
func smokeTest(args []string) int {
	checks := map[string]func(context.Context, smoke.Options, io.Writer) error{
		"signup": smoke.Signup, "signin-redirect": smoke.SignInRedirect, "blocked": smoke.Blocked,
	}
	if len(args) != 1 || checks[args[0]] == nil {
		fmt.Fprintln(os.Stderr, "usage: setup smoke signup|signin-redirect|blocked (SMOKE_URL, SMOKE_HOST, SMOKE_CA_FILE, SMOKE_INVITE)")
		return 2
	}
	cfg, err := config.LoadSmoke(config.FromOS())
	if err != nil {
		fmt.Fprintln(os.Stderr, "setup smoke:", err)
		return 2
	}
	o := smoke.Options{URL: cfg.URL, Host: cfg.Host, CAFile: cfg.CAFile, Invite: cfg.Invite, Timeout: cfg.Timeout}
	switch err := checks[args[0]](context.Background(), o, os.Stdout); {
	case errors.Is(err, smoke.ErrUntested):
		fmt.Fprintln(os.Stderr, "COULD NOT TEST:", err)
		return 2
	case err != nil:
		fmt.Fprintln(os.Stderr, "FAIL:", err)
		return 1
	}
	return 0
}
