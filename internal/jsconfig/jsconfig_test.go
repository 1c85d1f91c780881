package jsconfig_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/jsconfig"
)

func TestHolds(t *testing.T) {
	want := jetstream.StreamConfig{Name: "S", Subjects: []string{"a.>"}, MaxAge: time.Hour}
	server := want
	server.MaxMsgs, server.MaxBytes, server.Metadata = -1, -1, map[string]string{"_nats.level": "1"}
	if !jsconfig.Holds(server, want) {
		t.Error("server defaults count as a difference")
	}
	changed := server
	changed.MaxAge = 2 * time.Hour
	if jsconfig.Holds(changed, want) {
		t.Error("a different max age holds")
	}
	changed = server
	changed.Subjects = []string{"b.>"}
	if jsconfig.Holds(changed, want) {
		t.Error("different subjects hold")
	}
}
