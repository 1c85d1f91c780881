package accounts

import (
	"fmt"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/auth"
	"github.com/aaas-project/aaas/internal/ident"
	"github.com/aaas-project/aaas/internal/web"
)

// chosenProfile checks the profile a signup or recreate names for the
// user id ("": none named, which the caller reads as the default or the
// sandbox's own): a name PROFILES does not list is refused 400, one the
// user's groups do not open 403, before anything is asked of lifecycle.
func (s *Service) chosenProfile(c *fiber.Ctx, id auth.Identity, name string) (string, error) {
	if name == "" {
		return "", nil
	}
	if err := ident.ValidateProfile(name); err != nil {
		return "", web.Refuse(fiber.StatusBadRequest, err.Error())
	}
	p, ok := s.o.Profiles.Find(name)
	if !ok {
		return "", web.Refuse(fiber.StatusBadRequest, fmt.Sprintf("there is no profile %q; choose one of %s", name, s.o.Profiles.Names()))
	}
	if !p.Allows(s.o.Auth.Member(c, id)) {
		return "", web.Refuse(fiber.StatusForbidden, fmt.Sprintf("the profile %q is not open to you", name))
	}
	return name, nil
}

// profileChoices lists the profiles id may choose, for a page's select;
// nil when there is no choice to make (one profile).
func (s *Service) profileChoices(c *fiber.Ctx, id auth.Identity) []web.Profile {
	if len(s.o.Profiles) < 2 {
		return nil
	}
	member := s.o.Auth.Member(c, id)
	var out []web.Profile
	for _, p := range s.o.Profiles {
		if p.Allows(member) {
			out = append(out, web.Profile{Name: p.Name, Description: p.Description})
		}
	}
	return out
}
