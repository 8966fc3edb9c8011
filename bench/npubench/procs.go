package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
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
	f, err := os.Open(w.gt)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return fixture.ParseGroundTruth(f)
}

// tracer is a running npuprobe or bpftrace.
type tracer struct {
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	out  bytes.Buffer // npuprobe: stderr; bpftrace: stderr
	// lines: npuprobe's stderr lines.
	lines chan string
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
	t := &tracer{cmd: cmd, done: make(chan struct{}), lines: make(chan string, 4096)}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			t.mu.Lock()
			t.out.WriteString(sc.Text() + "\n")
			t.mu.Unlock()
			select {
			case t.lines <- sc.Text():
			default:
			}
		}
	}()
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
	t := &tracer{cmd: cmd, done: make(chan struct{}), outFile: outFile}
	cmd.Stderr = &lockedWriter{t: t}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		cmd.Wait()
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

type lockedWriter struct{ t *tracer }

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.t.mu.Lock()
	defer w.t.mu.Unlock()
	return w.t.out.Write(p)
}

func (t *tracer) log() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.out.String()
}

func (t *tracer) expect(re *regexp.Regexp, timeout time.Duration) ([]string, error) {
	deadline := time.After(timeout)
	for {
		select {
		case line := <-t.lines:
			if m := re.FindStringSubmatch(line); m != nil {
				return m, nil
			}
		case <-t.done:
			// Drain what was printed before exiting.
			for {
				select {
				case line := <-t.lines:
					if m := re.FindStringSubmatch(line); m != nil {
						return m, nil
					}
				default:
					return nil, fmt.Errorf("tracer exited before printing a line matching %q", re)
				}
			}
		case <-deadline:
			return nil, fmt.Errorf("no line matching %q within %v", re, timeout)
		}
	}
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
