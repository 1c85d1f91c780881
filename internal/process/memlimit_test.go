package process

import (
	"io/fs"
	"runtime/debug"
	"testing"
)

func TestLimitMemoryFromTheContainersLimit(t *testing.T) {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1))
	files := func(m map[string]string) func(string) ([]byte, error) {
		return func(name string) ([]byte, error) {
			if v, ok := m[name]; ok {
				return []byte(v), nil
			}
			return nil, fs.ErrNotExist
		}
	}
	env := func(v string) func(string) string { return func(string) string { return v } }
	v2, v1 := cgroupLimitFiles[0], cgroupLimitFiles[1]
	for _, tc := range []struct {
		name  string
		env   string
		files map[string]string
		want  int64
	}{
		{"cgroup v2", "", map[string]string{v2: "536870912\n"}, 483183820},
		{"cgroup v1", "", map[string]string{v1: "1073741824\n"}, 966367641},
		{"v2 without a limit", "", map[string]string{v2: "max\n", v1: "1073741824"}, 0},
		{"v1 without a limit", "", map[string]string{v1: "9223372036854771712\n"}, 0},
		{"not in a container", "", nil, 0},
		{"unreadable figure", "", map[string]string{v2: "lots"}, 0},
		{"GOMEMLIMIT set", "400MiB", map[string]string{v2: "536870912"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			debug.SetMemoryLimit(1 << 40)
			got := limitMemory(env(tc.env), files(tc.files))
			if got != tc.want {
				t.Fatalf("limit %d, want %d", got, tc.want)
			}
			now := debug.SetMemoryLimit(-1)
			if tc.want != 0 && now != tc.want || tc.want == 0 && now != 1<<40 {
				t.Fatalf("the runtime's limit is %d after limit %d", now, got)
			}
		})
	}
}
