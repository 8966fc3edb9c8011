// Command npubench runs npuprobe's benchmarks and prints the table of
// BENCHMARKS.md. bench/run builds what it needs and runs "npubench all".
//
//	npubench all        every benchmark below, then the table
//	npubench overhead   per-call cost: no probes, floor, npuprobe, bpftrace (root)
//	npubench bpfstats   per-program BPF run time, npuprobe and floor (root)
//	npubench ingest     decode → allocmodel → ring, events/s on one core
//	npubench snapshot   WriteSnapshot vs python3 pickle.dump, time and size
//	npubench memory     peak memory per ring entry
//	npubench loss       drops at and above the zero-loss rate (root)
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/bench"
	"github.com/npuprobe/npuprobe/tests/fixture"
)

// row is one line of the results table.
type row struct {
	Metric string `json:"metric"`
	Result string `json:"result"`
	Goal   string `json:"goal,omitempty"`
	Met    string `json:"met,omitempty"`
	Cmd    string `json:"cmd"`
}

type bencher struct {
	tmp      string
	fx       *fixture.Paths
	npuprobe string
	script   string // bench/pairing.bt
	pyScript string // bench/pickle_dump.py
	python   string
	log      io.Writer
	raw      map[string]any
}

func (b *bencher) logf(format string, args ...any) {
	fmt.Fprintf(b.log, "npubench: "+format+"\n", args...)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: npubench all|overhead|bpfstats|ingest|snapshot|memory|loss [flags]")
		os.Exit(2)
	}
	sub := os.Args[1]
	fs := flag.NewFlagSet(sub, flag.ExitOnError)
	rounds := fs.Int("rounds", 5, "overhead: rounds of the four variants")
	calls := fs.Int("calls", 50000, "overhead: calls per workload run")
	threads := fs.Int("threads", 2, "overhead: workload threads")
	lossCalls := fs.Int("loss-calls", 100000, "loss: calls per workload")
	reps := fs.Int("reps", 5, "snapshot: repetitions of each writer")
	fxDir := fs.String("fixtures", "", "built fixtures (tests/fixture), default: build them")
	npuprobe := fs.String("npuprobe", "", "npuprobe binary, default: go build ./cmd/npuprobe")
	tmp := fs.String("tmp", "", "scratch directory")
	jsonOut := fs.String("json", "", "also write the rows as JSON here")
	mdOut := fs.String("md", "", "also write the table as Markdown here")
	fs.Parse(os.Args[2:])

	if sub == "memchild" {
		if err := memChild(*tmp); err != nil {
			fmt.Fprintln(os.Stderr, "memchild:", err)
			os.Exit(1)
		}
		return
	}

	root := repoRoot()
	b := &bencher{
		log:      os.Stderr,
		script:   filepath.Join(root, "bench", "pairing.bt"),
		pyScript: filepath.Join(root, "bench", "pickle_dump.py"),
		python:   "python3",
		raw:      map[string]any{},
	}
	if p, err := exec.LookPath("/usr/bin/python3"); err == nil {
		b.python = p // Debian's python3, as bench/run installs it
	}
	var err error
	if *tmp == "" {
		if *tmp, err = os.MkdirTemp("", "npubench-"); err != nil {
			fatal(err)
		}
		defer os.RemoveAll(*tmp)
	}
	b.tmp = *tmp
	needRoot := sub == "all" || sub == "overhead" || sub == "loss" || sub == "bpfstats"
	if needRoot {
		if os.Geteuid() != 0 {
			fatal(fmt.Errorf("%s loads eBPF programs: run as root", sub))
		}
		if b.fx, err = buildFixtures(*fxDir, *tmp); err != nil {
			fatal(err)
		}
		if b.npuprobe = *npuprobe; b.npuprobe == "" {
			b.npuprobe = filepath.Join(*tmp, "npuprobe")
			build := exec.Command("go", "build", "-o", b.npuprobe, "./cmd/npuprobe")
			build.Dir = root
			build.Stderr = os.Stderr
			if err := build.Run(); err != nil {
				fatal(fmt.Errorf("go build ./cmd/npuprobe: %w", err))
			}
		}
	}

	ocfg := overheadConfig{rounds: *rounds, calls: *calls, threads: *threads}
	var rows []row
	run := func(name string, f func() ([]row, error)) {
		t0 := time.Now()
		r, err := f()
		if err != nil {
			fatal(fmt.Errorf("%s: %w", name, err))
		}
		b.logf("%s done in %v", name, time.Since(t0).Round(time.Second))
		rows = append(rows, r...)
	}
	switch sub {
	case "all":
		run("ingest", b.ingest)
		run("snapshot", func() ([]row, error) { return b.snapshotWrite(*reps) })
		run("memory", b.memory)
		run("overhead", func() ([]row, error) { return b.overhead(ocfg) })
		run("bpfstats", func() ([]row, error) { return b.bpfStatsBoth(ocfg) })
		run("loss", func() ([]row, error) { return b.loss(*lossCalls) })
	case "overhead":
		run("overhead", func() ([]row, error) { return b.overhead(ocfg) })
	case "bpfstats":
		run("bpfstats", func() ([]row, error) { return b.bpfStatsBoth(ocfg) })
	case "ingest":
		run("ingest", b.ingest)
	case "snapshot":
		run("snapshot", func() ([]row, error) { return b.snapshotWrite(*reps) })
	case "memory":
		run("memory", b.memory)
	case "loss":
		run("loss", func() ([]row, error) { return b.loss(*lossCalls) })
	default:
		fatal(fmt.Errorf("unknown benchmark %q", sub))
	}

	md := table(rows)
	fmt.Print(machine() + "\n" + md)
	if *mdOut != "" {
		if err := os.WriteFile(*mdOut, []byte(machine()+"\n"+md), 0o644); err != nil {
			fatal(err)
		}
	}
	if *jsonOut != "" {
		data, _ := json.MarshalIndent(map[string]any{"machine": machine(), "rows": rows}, "", "  ")
		if err := os.WriteFile(*jsonOut, data, 0o644); err != nil {
			fatal(err)
		}
	}
}

func (b *bencher) bpfStatsBoth(cfg overheadConfig) ([]row, error) {
	var rows []row
	for _, floor := range []bool{true, false} {
		r, err := b.bpfProgramStats(floor, cfg)
		if err != nil {
			return nil, err
		}
		rows = append(rows, r...)
	}
	return rows, nil
}

// ingest runs the Go benchmark's ingest loop with testing.Benchmark.
func (b *bencher) ingest() ([]row, error) {
	var rows []row
	for _, s := range []*bench.Stream{bench.NewSegmentStream(2_000_000, 1), bench.NewTensorStream(2_000_000, 1)} {
		first, second := s.Half(0), s.Half(1)
		var rates []float64
		for range 5 {
			res := testing.Benchmark(func(tb *testing.B) {
				for i := 0; i < tb.N; i++ {
					tb.StopTimer()
					m := bench.NewModel(s.Level)
					if err := bench.Ingest(m, first); err != nil {
						tb.Fatal(err)
					}
					runtime.GC()
					tb.StartTimer()
					if err := bench.Ingest(m, second); err != nil {
						tb.Fatal(err)
					}
				}
			})
			rates = append(rates, float64(second.Len())*float64(res.N)/res.T.Seconds())
		}
		med := median(rates)
		b.logf("ingest %s: %.2f M events/s (%v)", s.Name, med/1e6, rates)
		rows = append(rows, row{
			Metric: fmt.Sprintf("ingest, %s level (decode → allocmodel → full 1 M ring), one core", s.Name),
			Result: fmt.Sprintf("%.2f M events/s (%.0f ns/event; runs %s M/s)", med/1e6, 1e9/med, spread(rates, 1e6, "")),
			Goal:   "≥ 5 M/s", Met: metStr(med >= 5e6),
			Cmd: fmt.Sprintf("go test ./bench -run '^$' -bench 'Ingest/%s/steady' -count 5", s.Name),
		})
	}
	return rows, nil
}

func table(rows []row) string {
	var sb strings.Builder
	sb.WriteString("| metric | result | goal | met | reproduce |\n|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | `%s` |\n", r.Metric, r.Result, r.Goal, r.Met, r.Cmd)
	}
	return sb.String()
}

// machine describes where the numbers were taken.
func machine() string {
	cpu := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	kernel := "unknown kernel"
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		kernel = strings.TrimSpace(string(b))
	}
	var memKB int64
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		fmt.Sscanf(strings.SplitN(string(b), "\n", 2)[0], "MemTotal: %d kB", &memKB)
	}
	return fmt.Sprintf("Machine: %s, %d CPUs, %.0f GiB RAM; Linux %s; %s; %s\n",
		cpu, runtime.NumCPU(), float64(memKB)/(1<<20), kernel, runtime.Version(), time.Now().UTC().Format("2006-01-02 15:04 UTC"))
}

func repoRoot() string {
	dir, _ := os.Getwd()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && strings.Contains(string(b), "module github.com/npuprobe/npuprobe\n") {
			return d
		}
	}
	return dir
}

func buildFixtures(dir, tmp string) (*fixture.Paths, error) {
	if dir == "" {
		dir = filepath.Join(tmp, "fixtures")
	}
	return fixture.Build(dir)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "npubench:", err)
	os.Exit(1)
}
