package main

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/tests/fixture"
)

// runDemo builds the bundled workload (a fake CANN runtime and a program
// that allocates and frees device memory from several threads the way
// torch_npu does), starts it, attaches to it by PID like a user would,
// traces it to the end and writes the snapshot.
func runDemo(args []string, stdout, stderr io.Writer) int {
	var f traceFlags
	var outFile, kind string
	var steps int
	fs := newFlags("demo", stderr)
	fs.StringVar(&outFile, "out", "npuprobe-demo.pickle", "snapshot file to write (replaced if it exists)")
	fs.StringVar(&kind, "workload", "transformer", "transformer or churn (a fake torch_npu training loop, tensor level), or segments (runtime calls only)")
	fs.IntVar(&steps, "steps", 0, "steps (transformer, churn) or calls (segments) after attach; 0 for the workload's default")
	addCommonFlags(fs, &f)
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	status, err := newStatusLine(f.statusInterval, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "npuprobe: %v\n", err)
		return exitUsage
	}
	if outFile == "" || strings.HasSuffix(outFile, "/") {
		fmt.Fprintln(stderr, "npuprobe: --out must name a file")
		return exitUsage
	}
	dir, err := openOutDir(filepath.Dir(outFile))
	if err != nil {
		return fail(stderr, err)
	}
	defer dir.Close()

	// Load the BPF programs first: without privilege there is no point
	// building anything.
	tracer, err := agent.NewTracer(agent.Options{RingBufferBytes: f.ringSize})
	if err != nil {
		return fail(stderr, err)
	}
	defer tracer.Close()

	work, err := os.MkdirTemp("", "npuprobe-demo-")
	if err != nil {
		return fail(stderr, err)
	}
	defer os.RemoveAll(work)
	fmt.Fprintln(stderr, "npuprobe: building the demo workload (a fake CANN runtime, a fake libtorch_npu.so and a training-like program) with gcc and g++")
	paths, err := fixture.Build(work)
	if err != nil {
		return fail(stderr, fmt.Errorf("build the demo workload: %w", err))
	}

	wl, err := startWorkload(paths, work, kind, steps)
	if err != nil {
		return fail(stderr, err)
	}
	defer wl.Kill()
	fmt.Fprintf(stderr, "npuprobe: demo workload running as pid %d, waiting to be traced\n", wl.PID)

	opts, err := f.sessionOptions()
	if err != nil {
		fmt.Fprintf(stderr, "npuprobe: %v\n", err)
		return exitUsage
	}
	opts.finalName = filepath.Base(outFile)
	s := newSession(tracer, dir, opts, stderr)
	s.status = status
	p, err := s.add(wl.PID)
	if err != nil {
		return fail(stderr, err)
	}
	reportAttach(stderr, p.target)

	// Let the workload run; once it reports done, let it exit, which makes
	// the session write the final snapshot.
	go func() {
		if err := wl.Send("go"); err != nil {
			return
		}
		if _, err := wl.Expect("done", time.Hour); err == nil {
			wl.Send("exit")
		}
	}()
	if err := s.run(); err != nil {
		return fail(stderr, err)
	}
	if err := wl.Cmd.Wait(); err != nil {
		return fail(stderr, fmt.Errorf("demo workload: %w", err))
	}
	fmt.Fprintf(stdout, "Snapshot: %s\nOpen https://pytorch.org/memory_viz and drop the file onto the page.\n", outFile)
	return exitOK
}

// startWorkload starts the demo workload; it waits to be traced.
func startWorkload(paths *fixture.Paths, work, kind string, steps int) (*fixture.Program, error) {
	var cmd *exec.Cmd
	switch kind {
	case "transformer", "churn":
		if steps == 0 {
			steps = map[string]int{"transformer": 20, "churn": 3000}[kind]
		}
		// The unstripped fake libtorch_npu.so: tensor level.
		cmd = exec.Command(paths.TensorWorkload, "--pattern", kind, "--steps", strconv.Itoa(steps), "--pre-attach-steps", "0", "--streams", "2")
		cmd.Env = append(os.Environ(), paths.TorchEnv(paths.TorchSymtabDir)...)
	case "segments":
		if steps == 0 {
			steps = 20000
		}
		cmd = exec.Command(paths.SegmentWorkload, "--gt", filepath.Join(work, "groundtruth.txt"), "--calls", strconv.Itoa(steps), "--threads", "2")
		cmd.Env = append(os.Environ(), paths.Env()...)
	default:
		return nil, fmt.Errorf("--workload must be transformer, churn or segments, not %q", kind)
	}
	cmd.Stderr = os.Stderr
	p, err := fixture.Start(cmd, time.Minute)
	if err != nil {
		return nil, fmt.Errorf("demo workload: %w", err)
	}
	return p, nil
}
