// Command dashboards writes the Grafana dashboards manifests/monitoring
// ships (as ConfigMaps with Grafana's sidecar label, from kustomize and
// the chart): one per question operators ask, every panel a query of
// metrics the processes export. Run it after changing a panel:
//
//	go run ./hack/dashboards
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// Dir is where the dashboards are written, from the repository root.
const Dir = "manifests/monitoring/dashboards"

type panel struct {
	title, unit string
	// queries are PromQL, each a series (legend: its labels).
	queries []query
}

type query struct{ expr, legend string }

type dashboard struct {
	file, uid, title string
	panels           []panel
}

func q(expr, legend string) query { return query{expr, legend} }

// Dashboards are the shipped dashboards.
var Dashboards = []dashboard{
	{"traffic.json", "aaas-traffic", "aaas / traffic and errors", []panel{
		{"Requests by status class and source", "reqps", []query{q(`sum by (class, source) (rate(aaas_edge_requests_total[5m]))`, "{{class}} {{source}}")}},
		{"Gateway 5xx ratio (tenants' own answers excluded)", "percentunit", []query{q(`sum(rate(aaas_edge_requests_total{class="5xx",source="gateway"}[5m])) / sum(rate(aaas_edge_requests_total[5m]))`, "gateway 5xx")}},
		{"Time to the response headers", "s", []query{
			q(`histogram_quantile(0.5, sum by (le) (rate(aaas_edge_request_duration_seconds_bucket[5m])))`, "p50"),
			q(`histogram_quantile(0.99, sum by (le) (rate(aaas_edge_request_duration_seconds_bucket[5m])))`, "p99")}},
		{"Upstream errors by kind", "ops", []query{q(`sum by (kind) (rate(aaas_edge_upstream_errors_total[5m]))`, "{{kind}}")}},
		{"In flight and WebSockets open", "short", []query{q(`sum(aaas_edge_in_flight)`, "in flight"), q(`sum(aaas_edge_websockets_open)`, "WebSockets")}},
		{"Bytes proxied", "Bps", []query{q(`sum by (direction) (rate(aaas_edge_proxied_bytes_total[5m]))`, "{{direction}}")}},
		{"Edges ready", "short", []query{q(`sum(aaas_ready{process="edge"})`, "ready edges")}},
	}},
	{"wakes.json", "aaas-wakes", "aaas / wakes and queue", []panel{
		{"Wakes by outcome", "ops", []query{q(`sum by (outcome) (rate(aaas_edge_wakes_total[5m]))`, "{{outcome}}")}},
		{"Wake duration", "s", []query{
			q(`histogram_quantile(0.5, sum by (le) (rate(aaas_edge_wake_duration_seconds_bucket[15m])))`, "p50"),
			q(`histogram_quantile(0.9, sum by (le) (rate(aaas_edge_wake_duration_seconds_bucket[15m])))`, "p90")}},
		{"Wakes waiting for a place", "short", []query{q(`max(aaas_lifecycle_wake_queue)`, "queued")}},
		{"Oldest queued wake", "s", []query{q(`max(aaas_lifecycle_wake_queue_oldest_seconds)`, "oldest")}},
		{"Commands waiting for a worker", "short", []query{q(`max(aaas_lifecycle_command_backlog)`, "backlog")}},
		{"Command duration (p90) by verb", "s", []query{q(`histogram_quantile(0.9, sum by (le, verb) (rate(aaas_lifecycle_command_duration_seconds_bucket[5m])))`, "{{verb}}")}},
		{"Commands given up", "short", []query{q(`sum(increase(aaas_lifecycle_commands_dead_lettered_total[1h]))`, "last hour")}},
	}},
	{"sandboxes.json", "aaas-sandboxes", "aaas / sandboxes", []panel{
		{"Sandboxes by phase", "short", []query{q(`sum by (phase) (aaas_sandboxes)`, "{{phase}}")}},
		{"Accounts", "short", []query{q(`sum(aaas_users)`, "accounts")}},
		{"Spares ready in the warm pool", "short", []query{q(`max(aaas_lifecycle_warm_pool_ready)`, "spares")}},
		{"Suspends by outcome", "ops", []query{q(`sum by (outcome) (rate(aaas_sweeper_suspends_total[15m]))`, "{{outcome}}")}},
		{"Ended pods replaced", "short", []query{q(`sum(increase(aaas_lifecycle_pod_restarts_total[1h]))`, "last hour")}},
		{"Sandboxes due to be suspended", "short", []query{q(`max(aaas_sweeper_idle)`, "due")}},
	}},
	{"nats.json", "aaas-nats", "aaas / NATS", []panel{
		{"Streams and buckets: fill", "percentunit", []query{q(`max by (stream) (aaas_nats_stream_bytes) / max by (stream) (aaas_nats_stream_max_bytes)`, "{{stream}}")}},
		{"Streams and buckets: bytes", "bytes", []query{q(`max by (stream) (aaas_nats_stream_bytes)`, "{{stream}}")}},
		{"Streams with a leader", "short", []query{q(`max by (stream) (aaas_nats_stream_available)`, "{{stream}}")}},
		{"Reconnections to NATS by process", "short", []query{q(`sum by (job) (increase(aaas_nats_reconnects_total[15m]))`, "{{job}}")}},
		{"Messages to and from NATS", "ops", []query{q(`sum(rate(aaas_nats_out_msgs_total[5m]))`, "out"), q(`sum(rate(aaas_nats_in_msgs_total[5m]))`, "in")}},
		{"JetStream storage per node", "percentunit", []query{q(`max by (pod) (nats_varz_jetstream_stats_storage / nats_varz_jetstream_config_max_storage)`, "{{pod}}")}},
		{"Records from a newer release, cache reloads", "short", []query{q(`sum(increase(aaas_kv_newer_records_total[1h]))`, "newer records"), q(`sum(increase(aaas_kv_cache_reloads_total[1h]))`, "reloads")}},
	}},
	{"spend.json", "aaas-spend", "aaas / model spend", []panel{
		{"Cost by provider and model (USD/hour)", "currencyUSD", []query{q(`sum by (provider, model) (rate(aaas_broker_cost_micro_usd_total[1h])) * 3600 / 1e6`, "{{provider}} {{model}}")}},
		{"Cost by who pays (USD/hour)", "currencyUSD", []query{q(`sum by (paid_by) (rate(aaas_broker_cost_micro_usd_total[1h])) * 3600 / 1e6`, "{{paid_by}}")}},
		{"Tokens by kind", "short", []query{q(`sum by (kind) (rate(aaas_broker_tokens_total[5m]))`, "{{kind}}")}},
		{"Calls by provider status", "ops", []query{q(`sum by (provider, code) (rate(aaas_broker_calls_total[5m]))`, "{{provider}} {{code}}")}},
		{"Time to first byte", "s", []query{q(`histogram_quantile(0.5, sum by (le) (rate(aaas_broker_first_byte_seconds_bucket[5m])))`, "p50"), q(`histogram_quantile(0.99, sum by (le) (rate(aaas_broker_first_byte_seconds_bucket[5m])))`, "p99")}},
		{"Calls the broker answered itself", "ops", []query{q(`sum by (reason) (rate(aaas_broker_refused_total[5m]))`, "{{reason}}")}},
		{"Records waiting for NATS, dropped", "short", []query{q(`sum(aaas_broker_usage_held)`, "held"), q(`sum(increase(aaas_broker_usage_dropped_total[1h]))`, "dropped")}},
	}},
}

// JSON is d as Grafana's dashboard model: a Prometheus datasource
// variable, time series panels two to a row.
func (d dashboard) JSON() ([]byte, error) {
	var panels []map[string]any
	for i, p := range d.panels {
		var targets []map[string]any
		for j, q := range p.queries {
			targets = append(targets, map[string]any{"refId": string(rune('A' + j)), "expr": q.expr, "legendFormat": q.legend,
				"datasource": map[string]any{"type": "prometheus", "uid": "${datasource}"}})
		}
		panels = append(panels, map[string]any{
			"id": i + 1, "type": "timeseries", "title": p.title,
			"datasource":  map[string]any{"type": "prometheus", "uid": "${datasource}"},
			"gridPos":     map[string]any{"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i / 2)},
			"fieldConfig": map[string]any{"defaults": map[string]any{"unit": p.unit}, "overrides": []any{}},
			"options":     map[string]any{"legend": map[string]any{"displayMode": "list", "placement": "bottom"}},
			"targets":     targets,
		})
	}
	doc := map[string]any{
		"uid": d.uid, "title": d.title, "tags": []string{"aaas"}, "schemaVersion": 39, "version": 1,
		"editable": true, "refresh": "30s", "time": map[string]any{"from": "now-6h", "to": "now"},
		"templating": map[string]any{"list": []any{map[string]any{
			"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
		}}},
		"panels": panels,
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	return append(b, '\n'), err
}

func main() {
	for _, d := range Dashboards {
		b, err := d.JSON()
		if err == nil {
			err = os.WriteFile(filepath.Join(Dir, d.file), b, 0o644)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "dashboards:", err)
			os.Exit(1)
		}
	}
}
