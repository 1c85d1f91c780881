// Command oidcop is the deployment tier's OpenID Connect provider, the
// organisation's single sign-on that oauth2-proxy sends browsers to:
// zitadel/oidc's certified OP library with its example server's login page
// and in-memory storage, serving TLS, with the issuer, clients, users and
// groups of a JSON file. ID tokens and the userinfo endpoint carry the
// user's email, preferred_username and a groups claim, as the providers
// README names do. A test-bed part, never deployed by aaas; a separate
// module keeps zitadel/oidc's dependencies out of aaas.
//
// Usage: oidcop CONFIG.json
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"golang.org/x/text/language"

	"github.com/zitadel/oidc/v3/example/server/exampleop"
	"github.com/zitadel/oidc/v3/example/server/storage"
	"github.com/zitadel/oidc/v3/pkg/oidc"
	"github.com/zitadel/oidc/v3/pkg/op"
)

// Config is the JSON file's shape.
type Config struct {
	// Issuer is the URL browsers and oauth2-proxy both reach the OP at.
	Issuer string
	// Listen is the TLS address (":8443"); Cert and Key its PEM files.
	Listen    string
	Cert, Key string
	Clients   []struct {
		ID, Secret   string
		RedirectURIs []string
	}
	Users []User
}

// User is one account of the organisation's directory.
type User struct {
	ID, Username, Password, Email string
	Groups                        []string
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: oidcop CONFIG.json")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "oidcop:", err)
		os.Exit(1)
	}
}

func run(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var cfg Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	users := directory{byID: map[string]*User{}, byName: map[string]*User{}}
	for i := range cfg.Users {
		u := &cfg.Users[i]
		users.byID[u.ID], users.byName[u.Username] = u, u
	}
	clients := map[string]*storage.Client{}
	for _, c := range cfg.Clients {
		clients[c.ID] = storage.WebClient(c.ID, c.Secret, c.RedirectURIs...)
	}
	s := &store{Storage: storage.NewStorageWithClients(users, clients), users: users}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	router := exampleop.SetupServer(cfg.Issuer, s, log, false)
	srv := &http.Server{Addr: cfg.Listen, Handler: router, ReadHeaderTimeout: 10 * time.Second}
	log.Info("serving", "issuer", cfg.Issuer, "addr", cfg.Listen, "users", len(cfg.Users), "clients", len(cfg.Clients))
	return srv.ListenAndServeTLS(cfg.Cert, cfg.Key)
}

// directory is the example storage's UserStore over the file's users.
type directory struct{ byID, byName map[string]*User }

func (d directory) user(u *User) *storage.User {
	if u == nil {
		return nil
	}
	return &storage.User{ID: u.ID, Username: u.Username, Password: u.Password, Email: u.Email, EmailVerified: true,
		FirstName: u.Username, PreferredLanguage: language.English}
}

func (d directory) GetUserByID(id string) *storage.User         { return d.user(d.byID[id]) }
func (d directory) GetUserByUsername(name string) *storage.User { return d.user(d.byName[name]) }

// ExampleClientID names the example's JWT-profile service user, which
// this provider has no use for.
func (d directory) ExampleClientID() string { return "" }

// store is the example storage with two changes: every client asserts
// the userinfo claims in its ID tokens (oauth2-proxy reads email and
// groups from the ID token), and those claims include groups.
type store struct {
	*storage.Storage
	users directory
}

// assertingClient is a client whose ID tokens carry the userinfo claims.
type assertingClient struct{ op.Client }

func (assertingClient) IDTokenUserinfoClaimsAssertion() bool { return true }

func (s *store) GetClientByClientID(ctx context.Context, id string) (op.Client, error) {
	c, err := s.Storage.GetClientByClientID(ctx, id)
	if err != nil {
		return nil, err
	}
	return assertingClient{c}, nil
}

func (s *store) SetUserinfoFromRequest(ctx context.Context, info *oidc.UserInfo, token op.IDTokenRequest, scopes []string) error {
	if err := s.Storage.SetUserinfoFromRequest(ctx, info, token, scopes); err != nil {
		return err
	}
	s.groups(info, token.GetSubject())
	return nil
}

func (s *store) SetUserinfoFromToken(ctx context.Context, info *oidc.UserInfo, tokenID, subject, origin string) error {
	if err := s.Storage.SetUserinfoFromToken(ctx, info, tokenID, subject, origin); err != nil {
		return err
	}
	s.groups(info, subject)
	return nil
}

func (s *store) groups(info *oidc.UserInfo, subject string) {
	if u := s.users.byID[subject]; u != nil && len(u.Groups) > 0 {
		info.AppendClaims("groups", u.Groups)
	}
}
