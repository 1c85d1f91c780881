package admin

import (
	"context"
	"errors"
	"fmt"
	"html/template"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/web"
)

// Bounds of the audit view: a page (and JSON without format=json) holds
// AuditPage events, an export (format=csv or json) MaxAuditRows, unless
// limit asks for fewer or more, up to MaxAuditRows; since defaults to a
// day back.
const (
	AuditPage    = 200
	MaxAuditRows = 10_000
	auditSince   = 24 * time.Hour
)

var auditColumns = []string{"at", "kind", "user", "outcome", "source", "request_id", "client", "detail"}

func auditRecord(e events.AuditEvent) []string {
	return []string{e.At.UTC().Format(time.RFC3339Nano), string(e.Kind), e.User, e.Outcome, e.Source, e.RequestID, e.Client, e.Detail}
}

// auditQuery is the view's filter, read from the query string.
type auditQuery struct {
	user         string
	kind         events.AuditKind
	since, until time.Time
	limit        int
	format       string
}

// parseAuditQuery reads and checks the filter; the error says what is
// wrong, for a 400.
func parseAuditQuery(c *fiber.Ctx, now time.Time) (auditQuery, error) {
	q := auditQuery{user: c.Query("user"), kind: events.AuditKind(c.Query("kind")), limit: AuditPage, format: c.Query("format")}
	if q.format != "" {
		// An export asked for by name holds everything up to the cap, not
		// a page.
		q.limit = MaxAuditRows
	} else {
		q.format = "json"
		if web.WantsHTML(c) {
			q.format = "html"
		}
	}
	var err error
	switch {
	case q.user != "" && ident.ValidateUser(q.user) != nil:
		return q, errors.New("user is a user name")
	case q.kind != "" && !slices.Contains(events.AuditKinds, q.kind):
		return q, errors.New("kind is one of " + kinds())
	case q.format != "html" && q.format != "json" && q.format != "csv":
		return q, errors.New("format is html, json or csv")
	}
	if q.since, err = when(c.Query("since"), now, now.Add(-auditSince)); err != nil {
		return q, errors.New("since is a time (RFC 3339) or an age back from now (90m, 24h, 7d)")
	}
	if q.until, err = when(c.Query("until"), now, now); err != nil {
		return q, errors.New("until is a time (RFC 3339) or an age back from now (90m, 24h, 7d)")
	}
	if !q.until.After(q.since) {
		return q, errors.New("until must be after since")
	}
	if l := c.Query("limit"); l != "" {
		if q.limit, err = strconv.Atoi(l); err != nil || q.limit < 1 || q.limit > MaxAuditRows {
			return q, errors.New("limit is 1 to " + strconv.Itoa(MaxAuditRows))
		}
	}
	return q, nil
}

// when reads a time: RFC 3339, or an age back from now in Go's duration
// syntax or whole days ("7d"); "" is def.
func when(s string, now, def time.Time) (time.Time, error) {
	if s == "" {
		return def, nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 3650 {
			return time.Time{}, errors.New("bad age")
		}
		return now.AddDate(0, 0, -n), nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return time.Time{}, errors.New("bad age")
	}
	return now.Add(-d), nil
}

func kinds() string {
	names := make([]string, len(events.AuditKinds))
	for i, k := range events.AuditKinds {
		names[i] = string(k)
	}
	return strings.Join(names, ", ")
}

// audit serves /_/admin/audit: the audit trail filtered by user, kind
// and time, oldest first, as a page, JSON or CSV. The stream keeps
// AUDIT_MAX_AGE.
func (s *Service) audit(c *fiber.Ctx) error {
	if _, ok, err := s.admin(c); !ok {
		return err
	}
	q, err := parseAuditQuery(c, time.Now())
	if err != nil {
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 30*time.Second)
	defer cancel()
	evs, more, err := read(ctx, s.o.JS, events.StreamAudit, events.AuditFilter(q.kind, q.user), q.since, q.until, q.limit,
		func(events.AuditEvent) bool { return true })
	if err != nil {
		return web.Fail(c, web.Unavailable(fmt.Errorf("audit stream not read: %w", err)))
	}
	if q.format == "html" {
		d := web.AdminAudit{User: q.user, Kind: string(q.kind), Since: q.since.UTC().Format(time.RFC3339), Until: q.until.UTC().Format(time.RFC3339),
			Kinds: strings.Split(kinds(), ", "), More: more}
		for _, e := range evs {
			d.Events = append(d.Events, web.AuditRow{At: e.At.UTC().Format(time.RFC3339), Kind: string(e.Kind), User: e.User, Outcome: e.Outcome,
				Source: e.Source, RequestID: e.RequestID, Detail: e.Detail})
		}
		filter := func(since time.Time) url.Values {
			v := url.Values{"since": {since.UTC().Format(time.RFC3339Nano)}, "until": {d.Until}}
			if q.user != "" {
				v.Set("user", q.user)
			}
			if q.kind != "" {
				v.Set("kind", string(q.kind))
			}
			return v
		}
		// Encoded here: the template puts them after "?" as they are.
		d.ExportQuery = template.URL(filter(q.since).Encode())
		if more {
			// The next page starts after the last event shown.
			d.NextQuery = template.URL(filter(evs[len(evs)-1].At.Add(time.Nanosecond)).Encode())
		}
		c.Set(fiber.HeaderCacheControl, "no-store")
		c.Type("html")
		return web.RenderAdminAudit(c, d)
	}
	records := make([][]string, len(evs))
	for i, e := range evs {
		records[i] = auditRecord(e)
	}
	return export(c, "audit", q.format, fiber.Map{"since": q.since, "until": q.until, "events": evs, "more": more}, auditColumns, records)
}
