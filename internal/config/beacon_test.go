package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/aaas-project/aaas/internal/config"
)

// A broker's beacons, like an edge's, must be trusted for longer than two
// heartbeats, or one late beacon lets a sandbox whose agent is waiting on
// a model call look idle.
func TestBrokerBeaconTTLOutlastsTwoHeartbeats(t *testing.T) {
	env := map[string]string{
		"NATS_ALLOW_ANONYMOUS": "true",
		"BROKER_PROVIDERS":     `[{"name":"deepseek","api":"openai","base_url":"https://api.deepseek.com","models":["deepseek-chat"]}]`,
	}
	c, err := config.LoadBroker(config.FromMap(env))
	if err != nil || c.BeaconInterval != 5*time.Second || c.BeaconTTL != 2*time.Minute {
		t.Fatalf("defaults: interval %s ttl %s, %v", c.BeaconInterval, c.BeaconTTL, err)
	}
	env["BEACON_INTERVAL"], env["BEACON_TTL"] = "10s", "15s"
	if _, err := config.LoadBroker(config.FromMap(env)); err == nil || !strings.Contains(err.Error(), "BEACON_TTL:") {
		t.Fatalf("a TTL under two intervals: %v", err)
	}
	env["BEACON_TTL"] = "20s"
	if c, err := config.LoadBroker(config.FromMap(env)); err != nil || c.BeaconTTL != 20*time.Second {
		t.Fatalf("a TTL of two intervals: %s %v", c.BeaconTTL, err)
	}
}
