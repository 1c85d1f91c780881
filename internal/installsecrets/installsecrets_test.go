package installsecrets_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/dev/devcluster"
	"github.com/aaas-project/aaas/internal/dev/devcluster/devclustertest"
	"github.com/aaas-project/aaas/internal/installsecrets"
	"github.com/aaas-project/aaas/internal/natsauth"
)

var cluster *devcluster.Cluster

func TestMain(m *testing.M) { os.Exit(devclustertest.Main(m, &cluster)) }

func cfg(ns string) config.Secrets {
	return config.Secrets{Namespace: ns, App: "aaas-secrets", NATS: "aaas-nats", NATSTLS: "aaas-nats-tls", CallTimeout: 10 * time.Second}
}

// TestEnsureCreatesWhatIsAbsentAndKeepsWhatExists: the first run creates
// all three Secrets, usable as the processes read them (an nkey seed per
// process kind that matches its public key, a 32-byte handshake key, a CA
// and certificate); a second run, as on every upgrade, creates nothing and
// changes no byte; a Secret the operator made is never touched.
func TestEnsureCreatesWhatIsAbsentAndKeepsWhatExists(t *testing.T) {
	ns := devclustertest.Namespace(t, cluster)
	ctx := context.Background()
	secrets := cluster.Client.CoreV1().Secrets(ns)
	own := []byte("the operator's own")
	if _, err := secrets.Create(ctx, secretOf(ns, "aaas-nats-tls", own), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := installsecrets.Ensure(ctx, cluster.Client, cfg(ns))
	if err != nil {
		t.Fatal(err)
	}
	want := []installsecrets.Outcome{{Name: "aaas-secrets", Created: true}, {Name: "aaas-nats", Created: true}, {Name: "aaas-nats-tls", Created: false}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("first run: %v, want %v", got, want)
	}
	app, err := secrets.Get(ctx, "aaas-secrets", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if k, err := base64.StdEncoding.DecodeString(string(app.Data["handshake-keys"])); err != nil || len(k) != 32 {
		t.Errorf("handshake-keys is not a base64 AES-256 key: %d bytes, %v", len(k), err)
	}
	if len(app.Data["invite-code"]) != 16 {
		t.Errorf("invite-code has %d characters", len(app.Data["invite-code"]))
	}
	nats, err := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range natsauth.Roles {
		matches(t, nats.Data, r, false)
		matches(t, nats.Data, r, true)
	}
	if tls, _ := secrets.Get(ctx, "aaas-nats-tls", metav1.GetOptions{}); !bytes.Equal(tls.Data["tls.crt"], own) {
		t.Error("the operator's aaas-nats-tls was changed")
	}

	// The upgrade: everything exists, nothing changes.
	again, err := installsecrets.Ensure(ctx, cluster.Client, cfg(ns))
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range again {
		if o.Created {
			t.Errorf("second run created %s", o.Name)
		}
	}
	after, _ := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	if after.ResourceVersion != nats.ResourceVersion || !bytes.Equal(after.Data["edge.nk"], nats.Data["edge.nk"]) {
		t.Error("a second run rewrote aaas-nats")
	}

	// The upgrade from 0.2.0, which had neither the backup identity nor
	// the staged next ones: aaas-nats gains exactly those, and every other
	// key stays as it was.
	old := after.DeepCopy()
	var missing []string
	for k := range old.Data {
		if strings.HasPrefix(k, "backup.") || strings.Contains(k, ".next.") {
			delete(old.Data, k)
			missing = append(missing, k)
		}
	}
	slices.Sort(missing)
	if _, err := secrets.Update(ctx, old, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	upgraded, err := installsecrets.Ensure(ctx, cluster.Client, cfg(ns))
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("[{aaas-secrets false []} {aaas-nats false %v} {aaas-nats-tls false []}]", missing); fmt.Sprint(upgraded) != want {
		t.Fatalf("upgrade: %v, want %s", upgraded, want)
	}
	gained, _ := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	for k, v := range after.Data {
		if !slices.Contains(missing, k) && !bytes.Equal(gained.Data[k], v) {
			t.Errorf("the upgrade changed %s", k)
		}
	}
	for _, r := range natsauth.Roles {
		matches(t, gained.Data, r, true)
	}
	matches(t, gained.Data, natsauth.Backup, false)

	// Half an identity is the operator's to mend: refused, nothing changed.
	half := gained.DeepCopy()
	delete(half.Data, "backup.pub")
	half, err = secrets.Update(ctx, half, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := installsecrets.Ensure(ctx, cluster.Client, cfg(ns)); err == nil || !strings.Contains(err.Error(), "only one of backup.nk and backup.pub") {
		t.Fatalf("half an identity: %v", err)
	}
	if now, _ := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{}); now.ResourceVersion != half.ResourceVersion {
		t.Error("a refused run changed aaas-nats")
	}
}

// TestEnsureRacingItselfCreatesEachSecretOnce: two runs at once (two
// upgrades, a retried Job) agree on one set of credentials: exactly one
// run creates each Secret, and both leave the same bytes.
func TestEnsureRacingItselfCreatesEachSecretOnce(t *testing.T) {
	ns := devclustertest.Namespace(t, cluster)
	c := cfg(ns)
	c.NATSTLS = ""
	var wg sync.WaitGroup
	results := make([][]installsecrets.Outcome, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = installsecrets.Ensure(context.Background(), cluster.Client, c)
		}()
	}
	wg.Wait()
	created := map[string]int{}
	for i, r := range results {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		for _, o := range r {
			if o.Created {
				created[o.Name]++
			}
		}
	}
	if created["aaas-secrets"] != 1 || created["aaas-nats"] != 1 || len(created) != 2 {
		t.Fatalf("creations per Secret: %v, want each once", created)
	}
	if _, err := cluster.Client.CoreV1().Secrets(ns).Get(context.Background(), "aaas-nats-tls", metav1.GetOptions{}); err == nil {
		t.Error("aaas-nats-tls was created though not asked for")
	}
}

// TestEnsureMakesAVerifiableNATSCertificate: the generated CA signs the
// NATS nodes' certificate for the names the processes dial.
func TestEnsureMakesAVerifiableNATSCertificate(t *testing.T) {
	ns := devclustertest.Namespace(t, cluster)
	c := config.Secrets{Namespace: ns, NATSTLS: "aaas-nats-tls", CallTimeout: 10 * time.Second}
	if _, err := installsecrets.Ensure(context.Background(), cluster.Client, c); err != nil {
		t.Fatal(err)
	}
	s, err := cluster.Client.CoreV1().Secrets(ns).Get(context.Background(), "aaas-nats-tls", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(s.Data["ca.crt"]) {
		t.Fatal("ca.crt holds no certificate")
	}
	block, _ := pem.Decode(s.Data["tls.crt"])
	if block == nil {
		t.Fatal("tls.crt holds no PEM block")
	}
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"nats", "nats-0.nats-headless"} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: name}); err != nil {
			t.Errorf("the certificate does not verify for %s: %v", name, err)
		}
	}
}

func secretOf(ns, name string, crt []byte) *corev1.Secret {
	return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Data: map[string][]byte{"tls.crt": crt}}
}

// matches is r's (next) public key in data, its seed checked.
func matches(t *testing.T, data map[string][]byte, r natsauth.Role, next bool) string {
	t.Helper()
	pub, err := r.Identity(data, next)
	if err != nil {
		t.Fatal(err)
	}
	return pub
}

// TestRotateNATSPromotesTheStagedIdentities: the roles asked for get
// their staged identity as current and a fresh one staged, in one write;
// the other roles and the route password stay. A Secret from before the
// staged identities is refused whole, and so is an unknown one.
func TestRotateNATSPromotesTheStagedIdentities(t *testing.T) {
	ns := devclustertest.Namespace(t, cluster)
	ctx := context.Background()
	secrets := cluster.Client.CoreV1().Secrets(ns)
	if _, err := installsecrets.Ensure(ctx, cluster.Client, cfg(ns)); err != nil {
		t.Fatal(err)
	}
	before, err := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rotate := []natsauth.Role{natsauth.Edge, natsauth.Broker}
	if err := installsecrets.RotateNATS(ctx, cluster.Client, cfg(ns), rotate); err != nil {
		t.Fatal(err)
	}
	after, _ := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{})
	for _, r := range natsauth.Roles {
		cur, next := matches(t, after.Data, r, false), matches(t, after.Data, r, true)
		switch {
		case !slices.Contains(rotate, r):
			if !bytes.Equal(after.Data[r.SeedKey(false)], before.Data[r.SeedKey(false)]) || next != string(before.Data[r.PublicKey(true)]) {
				t.Errorf("%s was changed", r)
			}
		case cur != string(before.Data[r.PublicKey(true)]):
			t.Errorf("%s's current key is not the one staged before", r)
		case next == cur || next == string(before.Data[r.PublicKey(false)]):
			t.Errorf("%s's staged key is not fresh", r)
		}
	}
	if !bytes.Equal(after.Data["route-password"], before.Data["route-password"]) {
		t.Error("the route password changed")
	}

	// An install from before the staged identities.
	old := after.DeepCopy()
	delete(old.Data, natsauth.Sweeper.SeedKey(true))
	delete(old.Data, natsauth.Sweeper.PublicKey(true))
	old, err = secrets.Update(ctx, old, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = installsecrets.RotateNATS(ctx, cluster.Client, cfg(ns), []natsauth.Role{natsauth.Edge, natsauth.Sweeper})
	if err == nil || !strings.Contains(err.Error(), "run setup secrets") {
		t.Fatalf("rotating without a staged identity: %v", err)
	}
	if now, _ := secrets.Get(ctx, "aaas-nats", metav1.GetOptions{}); now.ResourceVersion != old.ResourceVersion {
		t.Error("a refused rotation changed aaas-nats")
	}
	c := cfg(ns)
	c.NATS = "no-such-secret"
	if err := installsecrets.RotateNATS(ctx, cluster.Client, c, rotate); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("an absent Secret: %v", err)
	}
}
