package accounts

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/credentials"
	"github.com/aaas-project/aaas/internal/events"
	"github.com/aaas-project/aaas/internal/httpguard"
	"github.com/aaas-project/aaas/internal/kv"
	"github.com/aaas-project/aaas/internal/spend"
	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// BYOK is users' own provider keys (BROKER_BYOK): stored sealed to the
// brokers (credentials.Seal), never shown again but for their hint.
type BYOK struct {
	Credentials *kv.Bucket[state.Credential]
	// PublicKey is CREDENTIALS_PUBLIC_KEY.
	PublicKey []byte
	// Providers are BROKER_PROVIDERS' names, the only ones a key is
	// stored for.
	Providers []string
}

// usageBody is the user's model spend this month as the API answers it.
type usageBody struct {
	User  string `json:"user"`
	Month string `json:"month"`
	state.Usage
	Budget state.Applied `json:"budget"`
	// LeftMicros is what is left of a budget (never below 0); absent
	// when no budget applies.
	LeftMicros *int64 `json:"left_micros,omitempty"`
	Keys       []key  `json:"keys,omitempty"`
}

// key is a stored provider key as its owner sees it again.
type key struct {
	Provider string    `json:"provider"`
	Hint     string    `json:"hint,omitempty"`
	Set      time.Time `json:"set,omitzero"`
}

// models is user's spend, budget and stored keys now.
func (s *Service) models(ctx context.Context, user string) usageBody {
	month := state.Month(time.Now())
	b := usageBody{User: user, Month: month}
	if s.o.Spend == nil {
		return b
	}
	b.Usage, b.Budget = s.o.Spend.Spent(ctx, user, month), s.o.Spend.Budget(ctx, user)
	b.Recent = nil // the ledger's bookkeeping, not the user's
	if b.Budget.Limited {
		left := max(b.Budget.Micros-b.CostMicros, 0)
		b.LeftMicros = &left
	}
	if s.o.BYOK != nil {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		for _, p := range s.o.BYOK.Providers {
			k := key{Provider: p}
			if e, err := s.o.BYOK.Credentials.Get(ctx, state.CredentialKey(user, p)); err == nil {
				k.Hint, k.Set = e.Value.Hint, e.Value.Set
			}
			b.Keys = append(b.Keys, k)
		}
	}
	return b
}

// landingModels is models for the landing page.
func (s *Service) landingModels(ctx context.Context, user string) *web.Models {
	if s.o.Spend == nil {
		return nil
	}
	b := s.models(ctx, user)
	m := &web.Models{Month: b.Month, Spent: spend.USD(b.CostMicros), Calls: b.Calls, Budget: spend.Describe(b.Budget), BYOK: s.o.BYOK != nil}
	if b.LeftMicros != nil {
		m.Left = spend.USD(*b.LeftMicros)
	}
	if b.BYOKCalls > 0 {
		m.OwnKeys = spend.USD(b.BYOKCostMicros)
	}
	for _, k := range b.Keys {
		wk := web.ProviderKey{Provider: k.Provider, Hint: k.Hint}
		if !k.Set.IsZero() {
			wk.Set = k.Set.UTC().Format("2006-01-02 15:04 UTC")
		}
		m.Keys = append(m.Keys, wk)
	}
	return m
}

// usage answers the user's spend, budget and stored keys (GET /_/usage).
func (s *Service) usage(c *fiber.Ctx) error {
	id, err := s.identity(c)
	if err != nil {
		return s.refuse(c, err)
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(s.models(httpguard.Context(c), id.User))
}

// provider is the request's configured provider name; ok=false means the
// refusal has been written.
func (s *Service) provider(c *fiber.Ctx) (string, bool, error) {
	if s.o.BYOK == nil {
		return "", false, s.refuse(c, web.Refuse(fiber.StatusNotFound, "this gateway does not take users' own provider keys"))
	}
	p := c.Params("provider")
	if !slices.Contains(s.o.BYOK.Providers, p) {
		return "", false, s.refuse(c, web.Refuse(fiber.StatusBadRequest, "no provider of that name; the providers are those the gateway lists on your page"))
	}
	return p, true, nil
}

// storeKey seals and stores the user's own key for a provider (PUT or
// POST /_/keys/<provider>, field "key"). The key is never logged,
// audited or answered; only its hint is shown again.
func (s *Service) storeKey(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	p, ok, err := s.provider(c)
	if !ok {
		return err
	}
	f, err := web.ReadForm(c, "key")
	if err != nil {
		return s.refuse(c, err)
	}
	cred, err := credentials.Seal(s.o.BYOK.PublicKey, id.User, p, f["key"])
	if err != nil {
		return s.refuse(c, web.Refuse(fiber.StatusBadRequest, err.Error()))
	}
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	if _, err := s.o.BYOK.Credentials.Put(ctx, state.CredentialKey(id.User, p), cred); err != nil {
		return s.refuse(c, web.Unavailable(fmt.Errorf("own key not stored: %w", err)))
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditCredential, User: id.User, Outcome: "stored", Detail: "provider " + p + " by " + id.Method})
	if !web.WantsHTML(c) {
		return c.JSON(key{Provider: p, Hint: cred.Hint, Set: cred.Set})
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}

// deleteKey removes the user's own key for a provider (DELETE
// /_/keys/<provider>, or POST /_/keys/<provider>/delete from the page).
func (s *Service) deleteKey(c *fiber.Ctx) error {
	id, ok, err := s.mutation(c)
	if !ok {
		return err
	}
	p, ok, err := s.provider(c)
	if !ok {
		return err
	}
	ctx, cancel := context.WithTimeout(httpguard.Context(c), 10*time.Second)
	defer cancel()
	k := state.CredentialKey(id.User, p)
	if _, err := s.o.BYOK.Credentials.Get(ctx, k); errors.Is(err, kv.ErrNotFound) {
		return s.refuse(c, web.Refuse(fiber.StatusNotFound, "you have stored no key for "+p))
	} else if err != nil {
		return s.refuse(c, web.Unavailable(fmt.Errorf("own key not read: %w", err)))
	}
	if err := s.o.BYOK.Credentials.Purge(ctx, k); err != nil {
		return s.refuse(c, web.Unavailable(fmt.Errorf("own key not deleted: %w", err)))
	}
	s.audit(c, events.AuditEvent{Kind: events.AuditCredential, User: id.User, Outcome: "deleted", Detail: "provider " + p + " by " + id.Method})
	if !web.WantsHTML(c) {
		return c.SendStatus(fiber.StatusNoContent)
	}
	return c.Redirect("/", fiber.StatusSeeOther)
}
