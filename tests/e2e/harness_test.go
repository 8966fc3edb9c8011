// Package e2e runs the real npuprobe binary, as root, against real
// processes: fixture workloads driving the fake CANN runtime. Every check
// compares npuprobe's snapshot with the ground truth the workload recorded
// itself, and every snapshot passes the independent Python checker in
// tests/snapshotcheck.
package e2e

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

var (
	// binDir holds the npuprobe binary and the fixtures, world-readable so
	// that tests can run them as an unprivileged user too.
	binDir   string
	npuprobe string
	fixtures *fixture.Paths
	repoRoot string
)

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		fmt.Println("e2e: skipped in -short mode")
		os.Exit(0)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "e2e: these tests load eBPF programs and must run as root (or use go test -short to skip them)")
		os.Exit(1)
	}
	code, err := setup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e setup:", err)
		os.Exit(1)
	}
	code = m.Run()
	os.RemoveAll(binDir)
	os.Exit(code)
}

func setup() (int, error) {
	_, file, _, _ := runtime.Caller(0)
	repoRoot = filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
	var err error
	if binDir, err = os.MkdirTemp("", "npuprobe-e2e-"); err != nil {
		return 1, err
	}
	if err := os.Chmod(binDir, 0o755); err != nil {
		return 1, err
	}
	npuprobe = filepath.Join(binDir, "npuprobe")
	build := exec.Command("go", "build", "-o", npuprobe, "./cmd/npuprobe")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		return 1, fmt.Errorf("go build: %v\n%s", err, out)
	}
	if fixtures, err = fixture.Build(filepath.Join(binDir, "fixtures")); err != nil {
		return 1, err
	}
	return 0, nil
}

// workload is a running fixture program.
type workload struct {
	*fixture.Program
	t      *testing.T
	cmd    *exec.Cmd
	pid    int
	gtPath string
}

// startWorkload starts a fixture program with args (plus --gt) and waits
// for its "ready PID" line.
func startWorkload(t *testing.T, bin string, env []string, args ...string) *workload {
	t.Helper()
	gt := filepath.Join(t.TempDir(), "groundtruth.txt")
	return startProgram(t, bin, env, gt, append([]string{"--gt", gt}, args...)...)
}

// startProgram starts a fixture program that speaks the ready/go/done
// protocol and waits for its "ready PID" line.
func startProgram(t *testing.T, bin string, env []string, gt string, args ...string) *workload {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(append(os.Environ(), fixtures.Env()...), env...)
	cmd.Stderr = os.Stderr
	p, err := fixture.Start(cmd, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return &workload{Program: p, t: t, cmd: cmd, pid: p.PID, gtPath: gt}
}

func (w *workload) expectLine(prefix string, timeout time.Duration) string {
	w.t.Helper()
	line, err := w.Expect(prefix, timeout)
	if err != nil {
		w.t.Fatalf("workload: %v", err)
	}
	return line
}

func (w *workload) send(line string) {
	w.t.Helper()
	if err := w.Send(line); err != nil {
		w.t.Fatalf("write %q to workload: %v", line, err)
	}
}

func (w *workload) groundTruth() *fixture.GroundTruth {
	w.t.Helper()
	gt, err := fixture.ReadGroundTruth(w.gtPath)
	if err != nil {
		w.t.Fatal(err)
	}
	return gt
}

// agentProc is a running npuprobe.
type agentProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	stderr *fixture.Output
	done   chan struct{}
}

// startAgent runs npuprobe with args and waits until it reports tracing.
func startAgent(t *testing.T, args ...string) *agentProc {
	t.Helper()
	a := runAgent(t, args...)
	a.expect(regexp.MustCompile(`^npuprobe: tracing`), 30*time.Second)
	return a
}

func runAgent(t *testing.T, args ...string) *agentProc {
	t.Helper()
	cmd := exec.Command(npuprobe, args...)
	pr, pw := io.Pipe()
	a := &agentProc{t: t, cmd: cmd, stderr: fixture.WatchOutput(pr), done: make(chan struct{})}
	cmd.Stderr = pw
	cmd.Stdout = os.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		cmd.Wait()
		pw.Close()
		close(a.done)
	}()
	t.Cleanup(func() {
		select {
		case <-a.done:
		default:
			cmd.Process.Kill()
			<-a.done
		}
		if t.Failed() {
			t.Logf("npuprobe stderr:\n%s", a.log())
		}
	})
	return a
}

func (a *agentProc) log() string { return a.stderr.Log() }

// expect waits for a stderr line matching re and returns its submatches.
func (a *agentProc) expect(re *regexp.Regexp, timeout time.Duration) []string {
	a.t.Helper()
	m, err := a.stderr.Expect(re, timeout)
	if err != nil {
		a.t.Fatalf("npuprobe: %v", err)
	}
	return m
}

// wroteRE matches the line of a snapshot asked for by a signal; exitRE
// the one written when the target exits (an OOM's has its own wording).
var (
	wroteRE = regexp.MustCompile(`^npuprobe: wrote (\S+\.pickle)$`)
	exitRE  = regexp.MustCompile(`^npuprobe: process \d+ exited; wrote (\S+\.pickle)$`)
)

// snapshot sends SIGUSR1 and returns the written file.
func (a *agentProc) snapshot() string {
	a.t.Helper()
	if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		a.t.Fatal(err)
	}
	return a.expect(wroteRE, 60*time.Second)[1]
}

// quiet waits until npuprobe has printed nothing for d: it has finished
// what it was asked.
func (a *agentProc) quiet(d time.Duration) { a.stderr.Quiet(d) }

// wait waits for npuprobe to exit and returns its exit code.
func (a *agentProc) wait(timeout time.Duration) int {
	a.t.Helper()
	select {
	case <-a.done:
	case <-time.After(timeout):
		a.t.Fatalf("npuprobe did not exit within %v", timeout)
	}
	return a.cmd.ProcessState.ExitCode()
}
