// Command npuprobe traces a running process's Ascend NPU memory calls with
// eBPF and writes PyTorch memory snapshots (pytorch.org/memory_viz) with a
// correct time_us on every entry.
//
//	npuprobe --pid PID [--out DIR] [--max-entries N]   trace; SIGUSR1 writes a snapshot
//	npuprobe demo [--out FILE]                         trace the bundled demo workload
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/term"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/output"
)

// Exit codes.
const (
	exitOK    = 0
	exitError = 1 // a problem while running: the message names the fix
	exitUsage = 2 // bad command line
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, rest := args[0], args[1:]
		switch cmd {
		case "trace":
			return runTrace(rest, stdout, stderr)
		case "demo":
			return runDemo(rest, stdout, stderr)
		case "dump":
			return runDump(rest, stdout, stderr)
		case "augment":
			return runAugment(rest, stdout, stderr)
		case "merge":
			return runMerge(rest, stdout, stderr)
		case "stats":
			return runStats(rest, stdout, stderr)
		case "plot":
			return runPlot(rest, stdout, stderr)
		case "help":
			usage(stdout)
			return exitOK
		default:
			fmt.Fprintf(stderr, "npuprobe: unknown command %q (commands: trace, demo, dump, augment, merge, stats, plot; see npuprobe --help)\n", cmd)
			return exitUsage
		}
	}
	return runTrace(args, stdout, stderr)
}

func usage(w io.Writer) {
	fmt.Fprint(w, `npuprobe traces a process's Ascend NPU device-memory calls with eBPF and
writes PyTorch memory snapshots (open them at https://pytorch.org/memory_viz).

Usage:
  npuprobe [trace] (--pid PID ... | --all) [--wait] [--out DIR] [--control PATH] [--metrics-addr ADDR]
      Attach to a running process. SIGUSR1 writes a snapshot and tracing
      goes on; SIGINT/SIGTERM or the process's exit writes a final one.
  npuprobe dump [--control PATH] [--pid PID]
      Ask a running npuprobe (started with --control) for snapshots; prints
      the files written.
  npuprobe demo [--out FILE]
      Build and trace the bundled demo workload end to end (needs gcc).
  npuprobe augment --torch-snapshot FILE --recording FILE -o OUT
      Fill time_us into a torch_npu snapshot from an npuprobe recording of
      the same process.
  npuprobe merge -o OUT FILE...
      Merge per-rank snapshots into one, a device per rank.
  npuprobe stats [--json] FILE
      Summarize a snapshot per device.
  npuprobe plot FILE -o PAGE.html
      Write a self-contained HTML page of memory over time.

Run 'npuprobe trace --help' or 'npuprobe demo --help' for the flags.
Run 'npuprobe augment --help' (or merge, stats, plot) for the tools' flags.
`)
}

// newFlags returns a flag set that reports errors in one line instead of
// printing the whole usage text.
func newFlags(name string, stderr io.Writer) *pflag.FlagSet {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.SortFlags = false
	return fs
}

// parseFlags parses args, printing help on --help and one line on error.
// ok is false when the caller should exit with code.
func parseFlags(fs *pflag.FlagSet, args []string, stdout, stderr io.Writer) (code int, ok bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			fmt.Fprintf(stdout, "Usage of npuprobe %s:\n%s", fs.Name(), fs.FlagUsages())
			return exitOK, false
		}
		fmt.Fprintf(stderr, "npuprobe: %v (see npuprobe %s --help)\n", err, fs.Name())
		return exitUsage, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "npuprobe: unexpected argument %q (see npuprobe %s --help)\n", fs.Arg(0), fs.Name())
		return exitUsage, false
	}
	return 0, true
}

// fail prints err as npuprobe's one-line error and returns the exit code.
func fail(stderr io.Writer, err error) int {
	fmt.Fprintf(stderr, "npuprobe: %v\n", err)
	return exitError
}

type traceFlags struct {
	pids           []int
	all            bool
	floor          bool
	control        string
	controlHTTP    string
	metricsAddr    string
	wait           bool
	dumpOnOOM      bool
	stopOnLoad     string
	device         int
	out            string
	maxEntries     int
	ringSize       int
	statusInterval string
	level          string
	debugDirs      []string
}

func (f *traceFlags) sessionOptions() (sessionOptions, error) {
	attach, err := f.attachOptions()
	return sessionOptions{
		maxEntries: f.maxEntries,
		attach:     attach,
		wait:       f.wait,
		all:        f.all,
		dumpOnOOM:  f.dumpOnOOM,
		device:     f.device,
	}, err
}

// attachOptions turns --level and --debug-dir into agent options.
func (f *traceFlags) attachOptions() (agent.AttachOptions, error) {
	opts := agent.AttachOptions{DebugDirs: f.debugDirs}
	switch f.level {
	case "auto":
		opts.Level = agent.LevelAuto
	case "segment":
		opts.Level = agent.LevelSegment
	case "tensor":
		opts.Level = agent.LevelTensor
	default:
		return opts, fmt.Errorf("--level must be auto, segment or tensor, not %q", f.level)
	}
	return opts, nil
}

func addCommonFlags(fs *pflag.FlagSet, f *traceFlags) {
	fs.BoolVar(&f.dumpOnOOM, "dump-on-oom", true, "write a snapshot the moment an allocation fails for lack of device memory")
	fs.IntVar(&f.device, "device", -1, "device of threads whose device was chosen before attach (default: the process's LOCAL_RANK, else 0)")
	fs.StringVar(&f.level, "level", "auto", "auto, segment or tensor: tensor level needs torch_npu's symbols (auto: tensor when they resolve)")
	fs.StringSliceVar(&f.debugDirs, "debug-dir", nil, "directory with debug files (build-id or debuglink layout) for stripped libraries; repeatable")
	fs.IntVar(&f.maxEntries, "max-entries", 1_000_000, "trace entries kept per device; the oldest are overwritten (0: keep all)")
	fs.IntVar(&f.ringSize, "ring-size", agent.DefaultRingBufferBytes, "BPF ring buffer size in bytes (a power of two)")
	fs.StringVar(&f.statusInterval, "status-interval", "auto", "how often to print the status line (auto: 1s on a terminal, 30s otherwise; 0 for never)")
}

func runTrace(args []string, stdout, stderr io.Writer) int {
	var f traceFlags
	fs := newFlags("trace", stderr)
	fs.IntSliceVar(&f.pids, "pid", nil, "PID of a process to trace; repeat for several")
	fs.BoolVar(&f.all, "all", false, "trace every process that maps the CANN runtime, including ones that start later")
	fs.BoolVar(&f.wait, "wait", false, "if a process has not loaded the CANN runtime yet, wait and attach when it does")
	fs.StringVar(&f.stopOnLoad, "stop-on-load", "auto", "stop a process for the moment it takes to attach when it loads the runtime, so no call is missed: true, false, or auto (true with --wait, false with --all)")
	fs.StringVar(&f.out, "out", ".", "directory snapshots are written to")
	fs.StringVar(&f.control, "control", "", "serve the control API on this unix socket (mode 0600), for `npuprobe dump`; e.g. "+defaultControlPath)
	fs.StringVar(&f.controlHTTP, "control-http", "", "also serve the control API over HTTP on this loopback address (127.0.0.1:PORT)")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://ADDR/metrics (e.g. :9464)")
	fs.BoolVar(&f.floor, "floor", false, "attach do-nothing programs at the same points (measures the uprobes' own cost)")
	fs.MarkHidden("floor")
	addCommonFlags(fs, &f)
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if len(f.pids) == 0 && !f.all {
		fmt.Fprintln(stderr, "npuprobe: --pid or --all is required (see npuprobe --help)")
		return exitUsage
	}
	if f.maxEntries < 0 {
		fmt.Fprintln(stderr, "npuprobe: --max-entries must be 0 (keep all) or positive")
		return exitUsage
	}
	if f.device >= allocmodel.MaxDevices {
		fmt.Fprintf(stderr, "npuprobe: --device must be below %d\n", allocmodel.MaxDevices)
		return exitUsage
	}
	status, err := newStatusLine(f.statusInterval, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "npuprobe: %v\n", err)
		return exitUsage
	}
	opts, err := f.sessionOptions()
	if err != nil {
		fmt.Fprintf(stderr, "npuprobe: %v\n", err)
		return exitUsage
	}
	// Stopping is safe for a process the user named with --wait: npuprobe
	// continues it within milliseconds. Under --all it would reach every
	// process on the node that loads the runtime, and one left stopped by
	// an npuprobe killed at the wrong moment (a container removed) would
	// hang; there the probes already on a library file catch a new
	// process's first call anyway, so only a new installation loses the
	// calls made while npuprobe attaches.
	var stopOnLoad bool
	switch f.stopOnLoad {
	case "auto":
		stopOnLoad = f.wait && !f.all
	case "true":
		stopOnLoad = f.wait || f.all
	case "false":
	default:
		fmt.Fprintf(stderr, "npuprobe: --stop-on-load must be true, false or auto, not %q\n", f.stopOnLoad)
		return exitUsage
	}
	if f.controlHTTP != "" {
		if err := requireLoopback(f.controlHTTP); err != nil {
			fmt.Fprintf(stderr, "npuprobe: %v\n", err)
			return exitUsage
		}
	}

	dir, err := openOutDir(f.out)
	if err != nil {
		return fail(stderr, err)
	}
	defer dir.Close()
	for _, pid := range f.pids {
		if err := agent.CheckProcess(pid); err != nil {
			return fail(stderr, err)
		}
	}
	tracer, err := agent.NewTracer(agent.Options{
		RingBufferBytes: f.ringSize,
		TraceAll:        f.all,
		StopOnLoad:      stopOnLoad,
		Floor:           f.floor,
	})
	if err != nil {
		return fail(stderr, err)
	}
	defer tracer.Close()

	s := newSession(tracer, dir, opts, stderr)
	s.status = status
	for _, pid := range f.pids {
		p, err := s.add(pid)
		if err != nil {
			return fail(stderr, err)
		}
		if p != nil {
			reportAttach(stderr, p.target)
		}
	}
	if f.all {
		if err := s.startAll(); err != nil {
			return fail(stderr, err)
		}
		fmt.Fprintf(stderr, "npuprobe: tracing every process that maps the CANN runtime (%d now)\n", len(s.procs))
	}
	// Listeners only where asked: nothing listens by default.
	if f.control != "" || f.controlHTTP != "" {
		c, err := startControl(s, f.control, f.controlHTTP)
		if err != nil {
			return fail(stderr, err)
		}
		defer c.close()
	}
	if f.metricsAddr != "" {
		s.publish()
		stopMetrics, err := serveMetrics(s.metrics, f.metricsAddr)
		if err != nil {
			return fail(stderr, err)
		}
		defer stopMetrics()
	}

	fmt.Fprintf(stderr, "npuprobe: tracing; kill -USR1 %d writes a snapshot to %s, Ctrl-C or kill -TERM %d stops\n",
		os.Getpid(), dir.Path(), os.Getpid())

	stop := forwardSignals(s)
	defer stop()
	if err := s.run(); err != nil {
		return fail(stderr, err)
	}
	return exitOK
}

// openOutDir refuses a missing or unwritable directory at start, with the fix.
func openOutDir(path string) (*output.Dir, error) {
	dir, err := output.OpenDir(path)
	if err != nil {
		return nil, fmt.Errorf("cannot write snapshots to %s: %w (create it or choose another --out)", path, errors.Unwrap(err))
	}
	return dir, nil
}

func reportAttach(w io.Writer, t *agent.Target) {
	w_ := w
	if t.TensorUnavailable != "" {
		fmt.Fprintf(w, "npuprobe: %s\n", t.TensorUnavailable)
	}
	byFile := make(map[string][]string)
	var files []string
	for sym, file := range t.Attached {
		if byFile[file] == nil {
			files = append(files, file)
		}
		byFile[file] = append(byFile[file], sym)
	}
	for _, file := range files {
		fmt.Fprintf(w, "npuprobe: attached to pid %d (%s): %d functions in %s\n", t.PID, t.Name, len(byFile[file]), file)
	}
	if len(t.Missing) > 0 {
		fmt.Fprintf(w, "npuprobe: not defined by the runtime, not traced: %s\n", strings.Join(t.Missing, ", "))
	}
	for _, w := range t.Warnings {
		fmt.Fprintf(w_, "npuprobe: warning: %s\n", w)
	}
	if t.Level == allocmodel.LevelTensor {
		fmt.Fprintf(w, "npuprobe: tensor level: torch_npu's allocator symbols from %s\n", t.TorchSymbols)
	}
	for sym, others := range t.AlsoDefined {
		fmt.Fprintf(w, "npuprobe: %s is also defined in %s; traced once, where the process binds it (%s)\n",
			sym, strings.Join(others, ", "), t.Attached[sym])
	}
}

// forwardSignals turns SIGUSR1 into a snapshot and SIGINT/SIGTERM into a
// final snapshot and exit. Snapshots are written by the event loop, never in
// the signal path.
func forwardSignals(s *session) (stop func()) {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			case sig := <-sigs:
				r := request{reason: "signal", at: s.clk.Monotonic()}
				if sig != syscall.SIGUSR1 {
					r.reason, r.stop = "final", true
				}
				select {
				case s.requests <- r:
				case <-done:
					return
				}
			}
		}
	}()
	return func() {
		signal.Stop(sigs)
		close(done)
	}
}

func newStatusLine(spec string, w io.Writer) (*statusLine, error) {
	l := &statusLine{w: w}
	if f, ok := w.(*os.File); ok {
		l.tty = term.IsTerminal(int(f.Fd()))
	}
	switch spec {
	case "auto":
		l.interval = 30e9
		if l.tty {
			l.interval = 1e9
		}
	default:
		d, err := time.ParseDuration(spec)
		if err != nil {
			return nil, fmt.Errorf("bad --status-interval %q: %v", spec, err)
		}
		l.interval = d
	}
	return l, nil
}
