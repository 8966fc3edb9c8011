package agent

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// apiFunctions are the aclrt* functions of the fixtures' acl.h: what the fake
// runtime, libacl_rt.so and the compatibility forwarder each define.
var apiFunctions = []string{
	"aclrtFree", "aclrtFreePhysical", "aclrtGetDevice", "aclrtGetDeviceCount", "aclrtGetMemInfo",
	"aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached", "aclrtMallocPhysical", "aclrtMapMem",
	"aclrtMemGetAllocationGranularity", "aclrtReleaseMemAddress", "aclrtReserveMemAddress",
	"aclrtResetDevice", "aclrtSetDevice", "aclrtUnmapMem",
}

// The fixtures are built once per test binary (a build compiles the C++
// torch_npu fixture too and takes seconds), into a directory TestMain
// removes. Tests must not modify them: one that needs to (replacing a
// library) works on its own copy.
var (
	fixtureOnce  sync.Once
	fixtureDir   string
	fixturePaths *fixture.Paths
	fixtureErr   error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if fixtureDir != "" {
		os.RemoveAll(fixtureDir)
	}
	os.Exit(code)
}

func buildFixtures(t *testing.T) *fixture.Paths {
	t.Helper()
	fixtureOnce.Do(func() {
		if fixtureDir, fixtureErr = os.MkdirTemp("", "npuprobe-agent-fixtures-"); fixtureErr == nil {
			fixturePaths, fixtureErr = fixture.Build(fixtureDir)
		}
	})
	if fixtureErr != nil {
		t.Fatal(fixtureErr)
	}
	return fixturePaths
}

// compileC compiles a C source text with gcc into out.
func compileC(t *testing.T, out, src string, flags ...string) {
	t.Helper()
	srcPath := out + ".c"
	if err := os.WriteFile(srcPath, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"-O2", "-Wall", "-Werror", "-o", out, srcPath}, flags...)
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", strings.Join(args, " "), err, b)
	}
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: /proc/PID/map_files and other processes' roots need CAP_SYS_ADMIN")
	}
}

// runningWorkload is a segment_workload waiting for "go".
type runningWorkload struct {
	cmd *exec.Cmd
	pid int
}

// startWorkload starts segment_workload with env added (fixture Env or
// CompatEnv) and waits for its "ready PID" line. It stays before its run
// (waiting for "go") until the test ends, then is killed.
func startWorkload(t *testing.T, paths *fixture.Paths, env []string) *runningWorkload {
	t.Helper()
	cmd := exec.Command(paths.SegmentWorkload, "--gt", filepath.Join(t.TempDir(), "gt.txt"),
		"--threads", "2", "--calls", "100", "--pre-attach", "2")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	p, err := fixture.Start(cmd, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return &runningWorkload{cmd: cmd, pid: p.PID}
}

func sortedNames[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
