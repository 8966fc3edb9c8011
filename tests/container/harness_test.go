package container

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

func docker(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(dockerBin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("docker %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

func containerName(role string) string {
	b := make([]byte, 3)
	rand.Read(b)
	return fmt.Sprintf("npuprobe-test-%s-%s-%s", runID, role, hex.EncodeToString(b))
}

// workload is a fixture program running in its own container.
type workload struct {
	t                *testing.T
	name             string // container
	*fixture.Program        // the docker client, which relays the program's stdin and stdout
	hostPID          int    // the program's PID as npuprobe sees it (host namespace)
	ctrPID           int    // its PID inside its container, as it reported it
	gtPath           string
	stderr           bytes.Buffer
}

// startWorkload runs the fixture program bin (segment_workload or
// late_workload) in a new container of the workload image, with
// `docker run -i` so that the test drives it through stdin, and waits for
// its "ready PID" line. The ground truth is written to a mounted directory.
// dockerArgs go to docker run (--user, -e).
func startWorkload(t *testing.T, bin string, dockerArgs []string, args ...string) *workload {
	t.Helper()
	return startWorkloadIn(t, workloadImages[0], bin, dockerArgs, args...)
}

// startWorkloadIn is startWorkload in a container of image.
func startWorkloadIn(t *testing.T, image, bin string, dockerArgs []string, args ...string) *workload {
	t.Helper()
	gtDir := t.TempDir()
	// Writable by a workload running as another user.
	if err := os.Chmod(gtDir, 0o777); err != nil {
		t.Fatal(err)
	}
	w := &workload{t: t, name: containerName("workload"), gtPath: filepath.Join(gtDir, "groundtruth.txt")}
	run := []string{"run", "-i", "--rm", "--name", w.name, "--network", "none", "-v", gtDir + ":/gt"}
	run = append(run, dockerArgs...)
	run = append(run, image, workloadRoot+"/bin/"+bin, "--gt", "/gt/groundtruth.txt")
	cmd := exec.Command(dockerBin, append(run, args...)...)
	cmd.Stderr = &w.stderr
	t.Cleanup(func() {
		exec.Command(dockerBin, "rm", "-f", w.name).Run()
		if w.Program != nil {
			w.Kill()
		}
		if t.Failed() && w.stderr.String() != "" {
			t.Logf("workload %s stderr:\n%s", w.name, w.stderr.String())
		}
	})
	var err error
	if w.Program, err = fixture.Start(cmd, time.Minute); err != nil {
		t.Fatalf("workload %s: %v; stderr:\n%s", w.name, err, w.stderr.String())
	}
	w.ctrPID = w.PID
	if w.hostPID, err = strconv.Atoi(docker(t, "inspect", "-f", "{{.State.Pid}}", w.name)); err != nil || w.hostPID <= 0 {
		t.Fatalf("host PID of container %s: %v", w.name, err)
	}
	// Its own PID namespace: it is its container's first process.
	if w.ctrPID != 1 || w.hostPID == 1 {
		t.Fatalf("workload has PID %d in its container and %d on the host; want 1 and another", w.ctrPID, w.hostPID)
	}
	return w
}

func (w *workload) expectLine(prefix string, timeout time.Duration) string {
	w.t.Helper()
	line, err := w.Expect(prefix, timeout)
	if err != nil {
		w.t.Fatalf("workload %s: %v; stderr:\n%s", w.name, err, w.stderr.String())
	}
	return line
}

func (w *workload) send(line string) {
	w.t.Helper()
	if err := w.Send(line); err != nil {
		w.t.Fatalf("write %q to workload: %v", line, err)
	}
}

// finish tells the workload to exit and waits for its container to end.
func (w *workload) finish() {
	w.t.Helper()
	w.send("exit")
	done := make(chan error, 1)
	go func() { done <- w.Cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			w.t.Fatalf("workload container %s: %v\n%s", w.name, err, w.stderr.String())
		}
	case <-time.After(time.Minute):
		w.t.Fatalf("workload container %s did not exit", w.name)
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

// agent is npuprobe running in a container of the image under test.
type agent struct {
	t        *testing.T
	name     string
	cmd      *exec.Cmd
	outDir   string          // host directory mounted at outMount
	outMount string          // where npuprobe writes snapshots in its container
	out      *fixture.Output // the container's stdout and stderr
	done     chan struct{}
}

// outMount is where agents write snapshots inside their container, unless
// a test says otherwise (runAgentOut).
const outMount = "/out"

// runAgent starts `docker run` of the image with dockerArgs (privileges,
// namespaces, mounts) and npuprobe's args, a host directory mounted at
// /out. The docker client stays attached: npuprobe's stderr is its stderr,
// and its exit code is npuprobe's.
func runAgent(t *testing.T, dockerArgs []string, args ...string) *agent {
	t.Helper()
	return runAgentOut(t, outMount, dockerArgs, args...)
}

// runAgentOut is runAgent with the snapshot directory mounted at out.
func runAgentOut(t *testing.T, out string, dockerArgs []string, args ...string) *agent {
	t.Helper()
	a := &agent{t: t, name: containerName("agent"), outDir: t.TempDir(), outMount: out, done: make(chan struct{})}
	run := []string{"run", "--rm", "--name", a.name, "-v", a.outDir + ":" + out}
	run = append(run, dockerArgs...)
	run = append(run, agentImage)
	a.cmd = exec.Command(dockerBin, append(run, args...)...)
	pr, pw := io.Pipe()
	a.cmd.Stdout, a.cmd.Stderr = pw, pw
	a.out = fixture.WatchOutput(pr)
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		a.cmd.Wait()
		pw.Close()
		close(a.done)
	}()
	t.Cleanup(func() {
		exec.Command(dockerBin, "rm", "-f", a.name).Run()
		<-a.done
		if t.Failed() {
			t.Logf("npuprobe container %s output:\n%s", a.name, a.output())
		}
	})
	return a
}

// startAgent runs the agent and waits until it reports tracing.
func startAgent(t *testing.T, dockerArgs []string, args ...string) *agent {
	t.Helper()
	a := runAgent(t, dockerArgs, args...)
	a.expect(regexp.MustCompile(`^npuprobe: tracing`), time.Minute)
	return a
}

func (a *agent) output() string { return a.out.Log() }

// expect waits for an output line matching re and returns its submatches.
func (a *agent) expect(re *regexp.Regexp, timeout time.Duration) []string {
	a.t.Helper()
	m, err := a.out.Expect(re, timeout)
	if err != nil {
		a.t.Fatalf("npuprobe's container: %v", err)
	}
	return m
}

// hostPath turns a path npuprobe printed (inside its container) into the
// file on this machine.
func (a *agent) hostPath(p string) string {
	a.t.Helper()
	rel, ok := strings.CutPrefix(p, a.outMount+"/")
	if !ok {
		a.t.Fatalf("npuprobe wrote %s, outside %s", p, a.outMount)
	}
	return filepath.Join(a.outDir, rel)
}

// signalSnapshot sends SIGUSR1 to the agent's container, the way an
// operator without a shell in the image does, and returns the snapshot of
// process pid it writes.
func (a *agent) signalSnapshot(pid int) string {
	a.t.Helper()
	docker(a.t, "kill", "--signal", "USR1", a.name)
	re := regexp.MustCompile(fmt.Sprintf(`^npuprobe: wrote (\S+-%d-\S*signal\.pickle)$`, pid))
	return a.hostPath(a.expect(re, time.Minute)[1])
}

// exitSnapshot waits for the snapshot npuprobe writes when process pid
// exits.
func (a *agent) exitSnapshot(pid int) string {
	a.t.Helper()
	re := regexp.MustCompile(fmt.Sprintf(`^npuprobe: process %d exited; wrote (\S+\.pickle)$`, pid))
	return a.hostPath(a.expect(re, time.Minute)[1])
}

// wait waits for the container to end and returns npuprobe's exit code.
func (a *agent) wait(timeout time.Duration) int {
	a.t.Helper()
	select {
	case <-a.done:
	case <-time.After(timeout):
		a.t.Fatalf("npuprobe's container did not exit within %v", timeout)
	}
	return a.cmd.ProcessState.ExitCode()
}

// Capabilities, numbered as in linux/capability.h, named as Docker and
// Kubernetes name them.
var capNames = []string{
	"CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
	"SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
	"IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
	"SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
	"LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
	"WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
}

// unavailableCaps lists the capabilities this machine's bounding set lacks:
// no container can be given them here (runc fails to apply them), so
// `docker run --privileged`, which asks for all, cannot start at all.
func unavailableCaps(t *testing.T) []string {
	t.Helper()
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^CapBnd:\s*([0-9a-f]+)$`).FindSubmatch(status)
	if m == nil {
		t.Fatal("no CapBnd in /proc/self/status")
	}
	bnd, err := strconv.ParseUint(string(m[1]), 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	last := len(capNames) - 1
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n < last {
			last = n
		}
	}
	var missing []string
	for c := 0; c <= last; c++ {
		if bnd&(1<<c) == 0 {
			missing = append(missing, capNames[c])
		}
	}
	return missing
}
