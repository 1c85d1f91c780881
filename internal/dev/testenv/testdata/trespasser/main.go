// Command trespasser publishes where it is told to: testenv's test starts
// it, as the sweeper and with the sweeper's identity, to check that a
// subject the server refuses a process fails the test that started it,
// though the process itself carries on and exits 0.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/aaas-project/aaas/internal/config"
	"github.com/aaas-project/aaas/internal/natsauth"
	"github.com/aaas-project/aaas/internal/natsconn"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	nc, _, err := natsconn.Connect(ctx, natsconn.Options{
		URL: os.Getenv("NATS_URL"), Name: string(natsauth.Sweeper) + "/" + os.Getenv("INSTANCE_ID"),
		Auth: config.NATSAuth{NKey: os.Getenv("NATS_NKEY")}, InboxPrefix: natsauth.Sweeper.InboxPrefix(),
	}, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer nc.Close()
	subject := os.Getenv("TRESPASS_SUBJECT")
	if err := nc.Publish(subject, []byte("{}")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// The server answers the PING after it has handled the publish.
	if err := nc.FlushWithContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("published to", subject)
}
