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
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// workload is a running segment_workload (ready/go/done protocol, see
// tests/fixture/workload/segwork.c).
type workload struct {
	cmd   *exec.Cmd
	pid   int
	gt    string
	stdin io.WriteCloser
	lines chan string
}

func startWorkload(fx *fixture.Paths, dir string, args ...string) (*workload, error) {
	gt := filepath.Join(dir, fmt.Sprintf("gt-%d.txt", time.Now().UnixNano()))
	cmd := exec.Command(fx.SegmentWorkload, append([]string{"--gt", gt}, args...)...)
	cmd.Env = append(os.Environ(), fx.Env()...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	w := &workload{cmd: cmd, gt: gt, stdin: stdin, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			w.lines <- sc.Text()
		}
		close(w.lines)
	}()
	line, err := w.expect("ready ", 30*time.Second)
	if err != nil {
		w.kill()
		return nil, err
	}
	if w.pid, err = strconv.Atoi(strings.TrimPrefix(line, "ready ")); err != nil {
		w.kill()
		return nil, fmt.Errorf("workload said %q", line)
	}
	return w, nil
}

func (w *workload) expect(prefix string, timeout time.Duration) (string, error) {
	deadline := time.After(timeout)
	for {
		select {
		case line, ok := <-w.lines:
			if !ok {
				return "", fmt.Errorf("workload ended before printing %q", prefix)
			}
			if strings.HasPrefix(line, prefix) {
				return line, nil
			}
		case <-deadline:
			return "", fmt.Errorf("workload did not print %q within %v", prefix, timeout)
		}
	}
}

func (w *workload) send(line string) error {
	_, err := io.WriteString(w.stdin, line+"\n")
	return err
}

func (w *workload) kill() {
	if w.cmd.ProcessState == nil {
		w.cmd.Process.Kill()
		w.cmd.Wait()
	}
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
