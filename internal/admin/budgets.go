package admin

import (
	"cmp"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// maxBudgetUSD is the largest budget an administrator can set, as
// BROKER_BUDGET_DEFAULT's.
const maxBudgetUSD = 1e6

// budgetTarget is the scope and name of /_/admin/budgets/<scope>/<name>:
// a user name, or an SSO group (state.GroupName; path-escaped in the URL).
func budgetTarget(c *fiber.Ctx) (scope, name string, err error) {
	return target(c.Params("scope"), c.Params("name"))
}

func target(scope, escaped string) (string, string, error) {
	raw, uerr := url.PathUnescape(escaped)
	switch {
	case uerr != nil:
		return "", "", errors.New("the name is not a valid path segment")
	case scope == state.BudgetUser:
		if ident.ValidateUser(raw) != nil {
			return "", "", errors.New("no such user name")
		}
		return scope, raw, nil
	case scope == state.BudgetGroup:
		if name := state.GroupName(raw); name != "" {
			return scope, name, nil
		}
		return "", "", fmt.Errorf("a group name is 1 to %d characters without control characters", state.MaxGroupLen)
	}
	return "", "", fmt.Errorf("no budget scope %q; scopes are user and group", scope)
}

// budgetBody is a budget override as the API answers it.
type budgetBody struct {
	Scope string `json:"scope"`
	Name  string `json:"name"`
	// Set is false when no override exists (the user's or group's
	// budget is then the rule's: state.ApplyBudget).
	Set bool `json:"set"`
	state.Budget
	USD string `json:"usd,omitempty"`
}

func describe(scope, name string, b state.Budget, set bool) budgetBody {
	out := budgetBody{Scope: scope, Name: name, Set: set, Budget: b}
	if set && !b.Unlimited {
		out.USD = spend.USD(b.MonthlyMicros)
	}
	return out
}

func (s *Service) getBudget(c *fiber.Ctx) error {
	if _, ok, err := s.admin(c); !ok {
		return err
	}
	scope, name, err := budgetTarget(c)
	if err != nil {
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	e, ok := s.o.Spend.Budgets.Get(state.BudgetKey(scope, name))
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(describe(scope, name, e.Value, ok))
}

// parseUSD reads an amount of USD ("20", "2.50") as micro-USD.
func parseUSD(v string) (int64, error) {
	usd, err := strconv.ParseFloat(strings.TrimPrefix(strings.TrimSpace(v), "$"), 64)
	if err != nil || math.IsNaN(usd) || math.IsInf(usd, 0) || usd < 0 || usd > maxBudgetUSD {
		return 0, fmt.Errorf("%q is not an amount of USD from 0 to %d (e.g. 20 or 2.50)", v, int(maxBudgetUSD))
	}
	return int64(math.Round(usd * 1e6)), nil
}

// budget sets (PUT, or POST from the page) or clears (DELETE, or POST
// with clear=true) a budget override. Like every admin action it must
// be confirmed, naming the user or group again in "confirm", and is
// audited; a cookie-authenticated request must come from our origin.
// Bad input changes nothing.
func (s *Service) budget(c *fiber.Ctx) error {
	id, ok, err := s.admin(c)
	if !ok {
		return err
	}
	if id.Ambient() && !httpguard.SameOrigin(c) {
		return web.Fail(c, web.Refuse(fiber.StatusForbidden, "cross-origin request refused"))
	}
	f, err := web.ReadForm(c, "usd", "unlimited", "clear", "confirm", "group")
	if err != nil && c.Request().Header.ContentLength() != 0 {
		return web.Fail(c, err)
	}
	// The page's group form names the group in a field (a form cannot
	// put it in its own path).
	scope, name, err := budgetTarget(c)
	if c.Params("scope") == "" {
		scope, name, err = target(state.BudgetGroup, url.PathEscape(f["group"]))
	} else if f["group"] != "" {
		err = errors.New("the group is named in the path")
	}
	if err != nil {
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	clear := c.Method() == fiber.MethodDelete || f["clear"] == "true"
	var b state.Budget
	switch {
	case clear && (f["usd"] != "" || f["unlimited"] != ""):
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, "clear an override or set one, not both"))
	case clear:
	case f["unlimited"] == "true" && f["usd"] == "":
		b.Unlimited = true
	case f["unlimited"] != "" && f["unlimited"] != "false":
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, `unlimited is "true" (without usd) or absent`))
	default:
		if b.MonthlyMicros, err = parseUSD(f["usd"]); err != nil {
			return web.Fail(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
		}
	}
	what := "clear the budget of"
	if !clear {
		what = "set the budget of"
	}
	if f["confirm"] != name {
		if web.WantsHTML(c) {
			c.Set(fiber.HeaderCacheControl, "no-store")
			c.Type("html")
			return web.RenderAdminBudgetConfirm(c, web.AdminBudgetConfirm{Scope: scope, Name: name, Path: "/_/admin/budgets/" + scope + "/" + url.PathEscape(name),
				USD: f["usd"], Unlimited: b.Unlimited, Clear: clear, What: what + " " + scope + " " + name})
		}
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, fmt.Sprintf(`confirm: %s %s %s by sending {"confirm": %q} with it`, what, scope, name, name)))
	}
	key := state.BudgetKey(scope, name)
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	outcome := "budget cleared"
	if clear {
		err = s.o.Budgets.Purge(ctx, key)
	} else {
		b.Scope, b.Name, b.SetBy, b.At = scope, name, id.User, time.Now().UTC()
		var rev uint64
		if rev, err = s.o.Budgets.Put(ctx, key, b); err == nil {
			s.o.Spend.Budgets.Note(key, b, rev)
		}
		outcome = "budget set to " + spend.Describe(state.Applied{Micros: b.MonthlyMicros, Limited: !b.Unlimited, Scope: scope, Group: b.Name})
	}
	audit := events.AuditEvent{Kind: events.AuditAdmin, Outcome: outcome, Client: auth.ClientTag(c), RequestID: httpguard.RequestID(c), Detail: "by " + id.User + " for " + scope + " " + name}
	if scope == state.BudgetUser {
		audit.User = name
	}
	if err != nil {
		audit.Outcome = "budget: refused"
		s.o.Publisher.Audit(audit)
		return web.Fail(c, web.Unavailable(fmt.Errorf("admin budget not written: %w", err)))
	}
	s.o.Publisher.Audit(audit)
	s.o.Log.Info("admin action", "admin", id.User, "scope", scope, "name", name, "outcome", outcome)
	if web.WantsHTML(c) {
		q := url.Values{"budget": {scope + " " + name}}
		if scope == state.BudgetUser {
			q.Set("q", name)
		}
		return c.Redirect("/_/admin?"+q.Encode(), fiber.StatusSeeOther)
	}
	if clear {
		return c.JSON(describe(scope, name, state.Budget{}, false))
	}
	return c.JSON(describe(scope, name, b, true))
}

var monthRE = regexp.MustCompile(`^[0-9]{4}-(0[1-9]|1[0-2])$`)

// usageRow is one user's month in the export.
type usageRow struct {
	User             string `json:"user"`
	Month            string `json:"month"`
	Calls            int64  `json:"calls"`
	Estimated        int64  `json:"estimated"`
	InputTokens      int64  `json:"input_tokens"`
	OutputTokens     int64  `json:"output_tokens"`
	CachedTokens     int64  `json:"cached_tokens"`
	CacheWriteTokens int64  `json:"cache_write_tokens"`
	CostMicros       int64  `json:"cost_micros"`
	BYOKCalls        int64  `json:"byok_calls"`
	BYOKCostMicros   int64  `json:"byok_cost_micros"`
}

var usageColumns = []string{"user", "month", "calls", "estimated", "input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "cost_micros", "byok_calls", "byok_cost_micros"}

func (r usageRow) record() []string {
	out := []string{r.User, r.Month}
	for _, n := range []int64{r.Calls, r.Estimated, r.InputTokens, r.OutputTokens, r.CachedTokens, r.CacheWriteTokens, r.CostMicros, r.BYOKCalls, r.BYOKCostMicros} {
		out = append(out, strconv.FormatInt(n, 10))
	}
	return out
}

// usage exports a month's totals from the usage bucket, every user's or
// one's: GET /_/admin/usage?month=YYYY-MM[&user=ann]&format=csv|json
// (month defaults to this one, format to json); with rows=calls, the
// month's calls one by one from the usage stream instead.
func (s *Service) usage(c *fiber.Ctx) error {
	if _, ok, err := s.admin(c); !ok {
		return err
	}
	month, user, format := c.Query("month", state.Month(time.Now())), c.Query("user"), c.Query("format", "json")
	switch {
	case !monthRE.MatchString(month):
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, "month is YYYY-MM, e.g. "+state.Month(time.Now())))
	case user != "" && ident.ValidateUser(user) != nil:
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, "user is a user name"))
	case format != "csv" && format != "json":
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, "format is csv or json"))
	}
	if rows := c.Query("rows"); rows == "calls" {
		return s.exportCalls(c, month, user, format)
	} else if rows != "" && rows != "totals" {
		return web.Fail(c, web.Refuse(fiber.StatusBadRequest, "rows is totals (the default) or calls"))
	}
	rows := []usageRow{}
	spent, err := s.o.Spend.Months.Month(c.UserContext(), month)
	if err != nil {
		return web.Fail(c, web.Unavailable(err))
	}
	for _, u := range spent {
		if user != "" && u.User != user {
			continue
		}
		rows = append(rows, usageRow{User: u.User, Month: u.Month, Calls: u.Calls, Estimated: u.Estimated,
			InputTokens: u.InputTokens, OutputTokens: u.OutputTokens, CachedTokens: u.CachedTokens, CacheWriteTokens: u.CacheWriteTokens, CostMicros: u.CostMicros,
			BYOKCalls: u.BYOKCalls, BYOKCostMicros: u.BYOKCostMicros})
	}
	name := "usage-" + month
	if user != "" {
		name += "-" + user
	}
	records := make([][]string, len(rows))
	for i, r := range rows {
		records[i] = r.record()
	}
	return export(c, name, format, fiber.Map{"month": month, "users": rows}, usageColumns, records)
}

// exportCalls answers the month's calls (rows=calls).
func (s *Service) exportCalls(c *fiber.Ctx, month, user, format string) error {
	calls, err := s.calls(httpguard.Context(c), month, user)
	switch {
	case errors.Is(err, errTooManyCalls):
		return web.Fail(c, web.Refuse(fiber.StatusRequestEntityTooLarge, err.Error()))
	case err != nil:
		return web.Fail(c, web.Unavailable(fmt.Errorf("usage stream not read: %w", err)))
	}
	records := make([][]string, len(calls))
	for i, e := range calls {
		records[i] = callRecord(e)
	}
	name := "calls-" + month
	if user != "" {
		name += "-" + user
	}
	return export(c, name, format, fiber.Map{"month": month, "calls": calls}, callColumns, records)
}

// export answers doc as a JSON attachment, or columns and records as a
// CSV one.
func export(c *fiber.Ctx, name, format string, doc any, columns []string, records [][]string) error {
	c.Set(fiber.HeaderCacheControl, "no-store")
	if format == "json" {
		c.Set(fiber.HeaderContentDisposition, `attachment; filename="`+name+`.json"`)
		b, err := json.Marshal(doc)
		if err != nil {
			return err
		}
		c.Set(fiber.HeaderContentType, fiber.MIMEApplicationJSONCharsetUTF8)
		return c.Send(b)
	}
	c.Set(fiber.HeaderContentType, "text/csv; charset=utf-8")
	c.Set(fiber.HeaderContentDisposition, `attachment; filename="`+name+`.csv"`)
	w := csv.NewWriter(c)
	_ = w.Write(columns)
	_ = w.WriteAll(records)
	return w.Error()
}

// spendOrder is up to limit names after after ("": from the first) in
// the order of month's spend, most first, then by name, for the list's
// sort=spend: the users who spent (month's usage, read by the month,
// those in the list) sorted, then everyone else by name, read from the
// name list where the page starts. A page costs the month's spenders and
// the page, not every account.
func (s *Service) spendOrder(ctx context.Context, month, after string, limit int) ([]string, error) {
	spent, err := s.o.Spend.Months.Month(ctx, month)
	if err != nil {
		return nil, err
	}
	top := make([]state.Usage, 0, len(spent))
	for _, u := range spent {
		if u.CostMicros > 0 && s.o.Names.Has(u.User) {
			top = append(top, u)
		}
	}
	slices.SortStableFunc(top, func(x, y state.Usage) int { return cmp.Compare(y.CostMicros, x.CostMicros) }) // by name within a cost
	spenders := make(map[string]bool, len(top))
	for _, u := range top {
		spenders[u.User] = true
	}
	out := make([]string, 0, limit)
	i, from := 0, ""
	if after != "" {
		if j := slices.IndexFunc(top, func(u state.Usage) bool { return u.User == after }); j >= 0 {
			i = j + 1
		} else {
			i, from = len(top), after+"\x00"
		}
	}
	for ; i < len(top) && len(out) < limit; i++ {
		out = append(out, top[i].User)
	}
	for len(out) < limit {
		want := limit - len(out)
		chunk := s.o.Names.Range(from, want+len(spenders))
		for _, n := range chunk {
			if !spenders[n] && len(out) < limit {
				out = append(out, n)
			}
		}
		if len(chunk) < want+len(spenders) {
			break
		}
		from = chunk[len(chunk)-1] + "\x00"
	}
	return out, nil
}

// budgetRoutes mounts the budget and usage API.
func (s *Service) budgetRoutes(app *fiber.App) {
	app.Get("/_/admin/usage", s.usage)
	app.Get("/_/admin/budgets/:scope/:name", s.getBudget)
	app.Post("/_/admin/budgets/group", s.budget)
	app.Put("/_/admin/budgets/:scope/:name", s.budget)
	app.Post("/_/admin/budgets/:scope/:name", s.budget)
	app.Delete("/_/admin/budgets/:scope/:name", s.budget)
}

// MaxCallRows bounds a per-call export (rows=calls): one month of one
// busy deployment's calls is more than a browser wants at once; beyond
// it, the export asks for one user's.
const MaxCallRows = 50_000

var callColumns = []string{"id", "at", "user", "provider", "model", "status", "stream", "input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "estimated", "cost_micros", "byok", "duration_ms", "broker"}

func callRecord(e events.UsageEvent) []string {
	return []string{e.ID, e.At.UTC().Format(time.RFC3339Nano), e.User, e.Provider, e.Model, strconv.Itoa(e.Status), strconv.FormatBool(e.Stream),
		strconv.FormatInt(e.InputTokens, 10), strconv.FormatInt(e.OutputTokens, 10), strconv.FormatInt(e.CachedTokens, 10), strconv.FormatInt(e.CacheWriteTokens, 10),
		strconv.FormatBool(e.Estimated), strconv.FormatInt(e.CostMicros, 10), strconv.FormatBool(e.BYOK),
		strconv.FormatInt(e.Duration.Milliseconds(), 10), e.Broker}
}

// errTooManyCalls is a per-call export over MaxCallRows.
var errTooManyCalls = fmt.Errorf("more than %d calls in that month; export one user's (user=…) or the totals", MaxCallRows)

// calls reads month's model calls (of user, or everyone's) from the
// usage stream, in the order the brokers recorded them. The stream keeps
// events.DefaultStreamsConfig's UsageMaxAge; older months have totals
// only.
func (s *Service) calls(ctx context.Context, month, user string) ([]events.UsageEvent, error) {
	start, err := time.Parse("2006-01", month)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	subject := events.UsageSubjectsAll
	if user != "" {
		subject = events.UsageSubject(user)
	}
	// A call is counted in the month it was made (its At), which a broker
	// may record a moment after the month ended.
	out, more, err := read(ctx, s.o.JS, events.StreamUsage, subject, start, start.AddDate(0, 1, 0).Add(time.Hour), MaxCallRows,
		func(e events.UsageEvent) bool { return state.Month(e.At) == month && (user == "" || e.User == user) })
	if more {
		return nil, errTooManyCalls
	}
	return out, err
}

// read is the messages of stream on subject stored from start until end,
// decoded, those keep accepts, oldest first: at most max, and more says
// there were others.
func read[T events.UsageEvent | events.AuditEvent](ctx context.Context, js jetstream.JetStream, stream, subject string, start, end time.Time, max int, keep func(T) bool) (out []T, more bool, err error) {
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subject}, DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &start,
	})
	if err != nil {
		return nil, false, err
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return nil, false, err
	}
	out = []T{}
	for pending := info.NumPending; pending > 0; {
		m, err := next(ctx, cons)
		if err != nil {
			return nil, false, err
		}
		meta, err := m.Metadata()
		if err != nil {
			return nil, false, err
		}
		pending = meta.NumPending
		if meta.Timestamp.After(end) {
			break
		}
		e, err := events.Decode[T](m.Data())
		if err != nil || !keep(e) {
			continue
		}
		if len(out) == max {
			return out, true, nil
		}
		out = append(out, e)
	}
	return out, false, nil
}

// next is the consumer's next message. In a cluster the ordered consumer
// lives on one node, and a pull sent through another node before it has
// heard of the consumer meets no responders (seen on the real node's
// three NATS pods: the audit view failed on two of them); the pull is
// sent again shortly, until ctx ends.
func next(ctx context.Context, cons jetstream.Consumer) (jetstream.Msg, error) {
	for {
		m, err := cons.Next(jetstream.FetchContext(ctx))
		if !errors.Is(err, nats.ErrNoResponders) {
			return m, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(50 * time.Millisecond):
		}
	}
}
