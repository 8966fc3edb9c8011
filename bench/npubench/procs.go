package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// workload is a running segment_workload (ready/go/done protocol, see
// tests/fixture/workload/segwork.c).
type workload struct {
	*fixture.Program
	pid int
	gt  string
}

func startWorkload(fx *fixture.Paths, dir string, args ...string) (*workload, error) {
	gt := filepath.Join(dir, fmt.Sprintf("gt-%d.txt", time.Now().UnixNano()))
	cmd := exec.Command(fx.SegmentWorkload, append([]string{"--gt", gt}, args...)...)
	cmd.Env = append(os.Environ(), fx.Env()...)
	cmd.Stderr = os.Stderr
	p, err := fixture.Start(cmd, 30*time.Second)
	if err != nil {
		return nil, err
	}
	return &workload{Program: p, pid: p.PID, gt: gt}, nil
}

func (w *workload) groundTruth() (*fixture.GroundTruth, error) {
	return fixture.ReadGroundTruth(w.gt)
}

// tracer is a running npuprobe or bpftrace.
type tracer struct {
	cmd  *exec.Cmd
	done chan struct{}
	// stderr: npuprobe's (which Expect waits on) or bpftrace's.
	stderr *fixture.Output
	// outFile: bpftrace's stdout.
	outFile string
}

// startNpuprobe runs npuprobe on pids and waits until it traces.
func startNpuprobe(bin, outDir string, pids []int, extra ...string) (*tracer, error) {
	args := []string{"--out", outDir, "--status-interval", "0"}
	for _, pid := range pids {
		args = append(args, "--pid", strconv.Itoa(pid))
	}
	args = append(args, extra...)
	cmd := exec.Command(bin, args...)
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	t := &tracer{cmd: cmd, done: make(chan struct{}), stderr: fixture.WatchOutput(pr)}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		cmd.Wait()
		pw.Close()
		close(t.done)
	}()
	if _, err := t.expect(regexp.MustCompile(`^npuprobe: tracing`), 30*time.Second); err != nil {
		t.stop()
		return nil, fmt.Errorf("%v\n%s", err, t.log())
	}
	return t, nil
}

// startBpftrace runs bench/pairing.bt on pid and waits until its probes
// are attached (it prints "ready" from BEGIN, which runs after attaching).
func startBpftrace(script, lib, outFile string, pid int) (*tracer, error) {
	f, err := os.Create(outFile)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd := exec.Command("bpftrace", "-p", strconv.Itoa(pid), script, lib)
	cmd.Stdout = f
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	t := &tracer{cmd: cmd, done: make(chan struct{}), stderr: fixture.WatchOutput(pr), outFile: outFile}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		cmd.Wait()
		pw.Close()
		close(t.done)
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		b, _ := os.ReadFile(outFile)
		if bytes.Contains(b, []byte("ready\n")) {
			return t, nil
		}
		select {
		case <-t.done:
			return nil, fmt.Errorf("bpftrace exited: %s", t.log())
		default:
		}
		if time.Now().After(deadline) {
			t.stop()
			return nil, fmt.Errorf("bpftrace did not attach within 60s: %s", t.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (t *tracer) log() string { return t.stderr.Log() }

// expect waits for a line of npuprobe's stderr matching re.
func (t *tracer) expect(re *regexp.Regexp, timeout time.Duration) ([]string, error) {
	return t.stderr.Expect(re, timeout)
}

// wait waits for the tracer to exit by itself.
func (t *tracer) wait(timeout time.Duration) error {
	select {
	case <-t.done:
		return nil
	case <-time.After(timeout):
		t.stop()
		return errors.New("tracer did not exit in time")
	}
}

// interrupt sends SIGINT and waits.
func (t *tracer) interrupt(timeout time.Duration) error {
	t.cmd.Process.Signal(syscall.SIGINT)
	return t.wait(timeout)
}

func (t *tracer) stop() {
	select {
	case <-t.done:
	default:
		t.cmd.Process.Kill()
		<-t.done
	}
}
