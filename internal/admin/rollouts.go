package admin

import (
	"cmp"
	"slices"

	"github.com/gofiber/fiber/v2"

	"github.com/aaas-project/aaas/internal/state"
	"github.com/aaas-project/aaas/internal/web"
)

// Rollouts are the profiles' rollouts in PROFILES order, as lifecycle last
// counted them (a profile it has not counted yet is left out): the
// counts of every sandbox, which the list, reading a page at a time,
// cannot give.
func (s *Service) Rollouts() []state.Rollout {
	out := []state.Rollout{}
	if s.o.Rollouts == nil {
		return out
	}
	for _, p := range s.o.Profiles {
		if e, ok := s.o.Rollouts.Get(p.Name); ok && e.Value.Profile == p.Name {
			out = append(out, e.Value)
		}
	}
	return out
}

// rollouts serves GET /_/admin/rollouts.
func (s *Service) rollouts(c *fiber.Ctx) error {
	if _, ok, err := s.admin(c); !ok {
		return err
	}
	c.Set(fiber.HeaderCacheControl, "no-store")
	return c.JSON(fiber.Map{"rollouts": s.Rollouts()})
}

// rolloutRows are ro as the page shows it: each revision its sandboxes
// are of, or were rolled back from, the template's first, then the most
// used. Only revisions' shapes reach the page: the record is lifecycle's,
// but a revision is a link's query.
func rolloutRows(ro state.Rollout) web.AdminRollout {
	out := web.AdminRollout{Profile: ro.Profile, Target: ro.Target}
	seen := map[string]bool{}
	for _, m := range []map[string]int{ro.Sandboxes, ro.Halted} {
		for rev := range m {
			if seen[rev] || rev != "" && !state.ValidRevision(rev) {
				continue
			}
			seen[rev] = true
			out.Revisions = append(out.Revisions, web.AdminRevision{Revision: rev, Sandboxes: ro.Sandboxes[rev], Halted: ro.Halted[rev], Target: ro.Target != "" && rev == ro.Target})
		}
	}
	for _, r := range out.Revisions {
		out.Total += r.Sandboxes
		if r.Target {
			out.Done = r.Sandboxes
		}
	}
	slices.SortFunc(out.Revisions, func(a, b web.AdminRevision) int {
		switch {
		case a.Target != b.Target:
			if a.Target {
				return -1
			}
			return 1
		case a.Sandboxes != b.Sandboxes:
			return cmp.Compare(b.Sandboxes, a.Sandboxes)
		}
		return cmp.Compare(a.Revision, b.Revision)
	})
	return out
}
