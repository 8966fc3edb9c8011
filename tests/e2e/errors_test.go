package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// runOnce runs npuprobe to completion and returns its exit code and stderr.
func runOnce(t *testing.T, cmd *exec.Cmd) (int, string) {
	t.Helper()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("%v did not exit", cmd.Args)
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// exitedPID returns the PID of a process that has exited and been reaped.
func exitedPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid
}

// readOnlyDir mounts a read-only tmpfs: root ignores permission bits, so a
// read-only filesystem is how a root process meets an unwritable directory.
func readOnlyDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount read-only tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// TestUserErrors checks each error a user can meet: one line on stderr
// naming the problem and the fix, and a non-zero exit.
func TestUserErrors(t *testing.T) {
	sleeper := exec.Command("sleep", "300")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "100", "--pre-attach", "1")

	cases := []struct {
		name string
		cmd  func() *exec.Cmd
		code int
		want string // regexp the single stderr line must match
	}{
		{
			name: "no such PID",
			cmd: func() *exec.Cmd {
				return exec.Command(npuprobe, "--pid", fmt.Sprint(exitedPID(t)), "--out", t.TempDir())
			},
			code: 1,
			want: `^npuprobe: no process with PID \d+ \(check the PID`,
		},
		{
			name: "no CANN runtime mapped",
			cmd: func() *exec.Cmd {
				return exec.Command(npuprobe, "--pid", fmt.Sprint(sleeper.Process.Pid), "--out", t.TempDir())
			},
			code: 1,
			want: `^npuprobe: process \d+ \(sleep\) has no CANN runtime mapped: .*\(check the PID is the training process`,
		},
		{
			name: "not enough privilege",
			cmd: func() *exec.Cmd {
				// An ordinary user without capabilities, writing to a
				// directory it may write to.
				out := t.TempDir()
				os.Chmod(out, 0o777)
				os.Chmod(filepath.Dir(out), 0o755)
				return exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
					npuprobe, "--pid", fmt.Sprint(w.pid), "--out", out)
			},
			code: 1,
			want: `^npuprobe: not enough privilege to load and attach eBPF programs: missing \[CAP_BPF CAP_PERFMON CAP_SYS_PTRACE\] \(run as root, or grant CAP_SYS_ADMIN and CAP_SYS_PTRACE`,
		},
		{
			name: "output directory not writable",
			cmd: func() *exec.Cmd {
				return exec.Command(npuprobe, "--pid", fmt.Sprint(w.pid), "--out", readOnlyDir(t))
			},
			code: 1,
			want: `^npuprobe: cannot write snapshots to .*: read-only file system \(create it or choose another --out\)$`,
		},
		{
			name: "output directory missing",
			cmd: func() *exec.Cmd {
				return exec.Command(npuprobe, "--pid", fmt.Sprint(w.pid), "--out", filepath.Join(t.TempDir(), "nope"))
			},
			code: 1,
			want: `^npuprobe: cannot write snapshots to .*nope: no such file or directory \(create it or choose another --out\)$`,
		},
		{
			name: "PID of a thread",
			cmd: func() *exec.Cmd {
				return exec.Command(npuprobe, "--pid", fmt.Sprint(threadOf(t, w.pid)), "--out", t.TempDir())
			},
			code: 1,
			want: fmt.Sprintf(`^npuprobe: \d+ is a thread of process %d, not a process \(use --pid %d\)$`, w.pid, w.pid),
		},
		{
			name: "missing --pid",
			cmd:  func() *exec.Cmd { return exec.Command(npuprobe, "--out", t.TempDir()) },
			code: 2,
			want: `^npuprobe: --pid or --all is required`,
		},
		{
			name: "unknown flag",
			cmd:  func() *exec.Cmd { return exec.Command(npuprobe, "--pidd", "1") },
			code: 2,
			want: `^npuprobe: unknown flag: --pidd \(see npuprobe trace --help\)$`,
		},
		{
			name: "bad flag value",
			cmd:  func() *exec.Cmd { return exec.Command(npuprobe, "--pid", "one") },
			code: 2,
			want: `^npuprobe: invalid argument "one" for "--pid" flag`,
		},
		{
			name: "bad ring size",
			cmd: func() *exec.Cmd {
				return exec.Command(npuprobe, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--ring-size", "1000")
			},
			code: 1,
			want: `^npuprobe: ring buffer size 1000 is not a power of two`,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stderr := runOnce(t, c.cmd())
			lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
			if code != c.code {
				t.Errorf("exit code %d, want %d", code, c.code)
			}
			if len(lines) != 1 {
				t.Errorf("stderr has %d lines, want 1:\n%s", len(lines), stderr)
			}
			if !regexp.MustCompile(c.want).MatchString(lines[0]) {
				t.Errorf("stderr %q does not match %q", lines[0], c.want)
			}
		})
	}
}

// threadOf returns the TID of a thread of pid other than its main thread.
func threadOf(t *testing.T, pid int) int {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		var tid int
		fmt.Sscan(e.Name(), &tid)
		if tid != pid {
			return tid
		}
	}
	t.Fatalf("process %d has no second thread", pid)
	return 0
}
