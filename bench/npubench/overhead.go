package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// Variants of the per-call overhead benchmark, in the order of a round.
var variants = []string{"none", "floor", "npuprobe", "bpftrace"}

// Function kinds whose per-call cost is reported: the runtime mallocs
// (uprobe + uretprobe) and aclrtFree (uprobe at entry only).
var kinds = []string{"malloc", "free"}

func kindOf(c fixture.Call) string {
	switch {
	case c.IsMalloc():
		return "malloc"
	case c.Func == fixture.FuncFree:
		return "free"
	}
	return ""
}

// runResult is one workload run under one variant.
type runResult struct {
	variant  string
	medianNs map[string]float64 // per kind: median call duration
	calls    int                // run-phase calls
	spanS    float64            // first call start to last call end
	tracerS  float64            // tracer CPU seconds while the workload ran
	lines    int                // bpftrace: output lines
}

type overheadConfig struct {
	rounds, calls, threads int
}

// runVariant runs the workload once under variant v.
func (b *bencher) runVariant(v string, cfg overheadConfig) (*runResult, error) {
	dir, err := os.MkdirTemp(b.tmp, "run-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	w, err := startWorkload(b.fx, dir, "--threads", strconv.Itoa(cfg.threads), "--calls", strconv.Itoa(cfg.calls), "--no-oom", "--no-wait-exit")
	if err != nil {
		return nil, err
	}
	defer w.Kill()
	var t *tracer
	switch v {
	case "floor":
		t, err = startNpuprobe(b.npuprobe, dir, []int{w.pid}, "--floor")
	case "npuprobe":
		t, err = startNpuprobe(b.npuprobe, dir, []int{w.pid})
	case "bpftrace":
		t, err = startBpftrace(b.script, b.fx.Runtime, filepath.Join(dir, "bpftrace.out"), w.pid)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", v, err)
	}
	if t != nil {
		defer t.stop()
	}
	cpu0 := 0.0
	if t != nil {
		cpu0 = procCPU(t.cmd.Process.Pid)
	}
	if err := w.Send("go"); err != nil {
		return nil, err
	}
	if _, err := w.Expect("done", 10*time.Minute); err != nil {
		return nil, err
	}
	res := &runResult{variant: v}
	if t != nil {
		// The tracer's CPU time while the workload ran (not its start-up
		// or its final snapshot).
		res.tracerS = procCPU(t.cmd.Process.Pid) - cpu0
	}
	w.Cmd.Wait()
	switch v {
	case "floor", "npuprobe":
		// npuprobe writes its final snapshot when the process exits.
		if err := t.wait(2 * time.Minute); err != nil {
			return nil, fmt.Errorf("%s: %w\n%s", v, err, t.log())
		}
	case "bpftrace":
		time.Sleep(200 * time.Millisecond) // let it print what is buffered
		if err := t.interrupt(time.Minute); err != nil {
			return nil, err
		}
		out, _ := os.ReadFile(t.outFile)
		res.lines = bytes.Count(out, []byte("\n")) - 1
	}
	gt, err := w.groundTruth()
	if err != nil {
		return nil, err
	}
	durs := map[string][]int64{}
	first, last := int64(1<<62), int64(0)
	for _, c := range gt.Calls {
		if c.Phase != fixture.PhaseRun {
			continue
		}
		res.calls++
		first, last = min(first, c.BeforeNs), max(last, c.AfterNs)
		if k := kindOf(c); k != "" && c.RC == fixture.ACLSuccess {
			durs[k] = append(durs[k], c.AfterNs-c.BeforeNs)
		}
	}
	res.spanS = float64(last-first) / 1e9
	res.medianNs = map[string]float64{}
	for k, d := range durs {
		res.medianNs[k] = medianInt(d)
	}
	if v == "bpftrace" && res.lines < res.calls {
		return nil, fmt.Errorf("bpftrace printed %d events for %d calls", res.lines, res.calls)
	}
	return res, nil
}

func medianInt(v []int64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return float64(s[n/2])
	}
	return float64(s[n/2-1]+s[n/2]) / 2
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	sort.Float64s(s)
	n := len(s)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// overhead runs cfg.rounds rounds of the four variants, interleaved (the
// round's order rotates so that no variant always runs first), and
// reports per kind the median added cost of each variant over no probes
// and the ratios.
func (b *bencher) overhead(cfg overheadConfig) ([]row, error) {
	var results [][]*runResult // [round][variant index]
	for r := range cfg.rounds {
		round := make([]*runResult, len(variants))
		for i := range variants {
			vi := (i + r) % len(variants)
			res, err := b.runVariant(variants[vi], cfg)
			if err != nil {
				return nil, err
			}
			round[vi] = res
			b.logf("overhead round %d %-8s: %d calls in %.2fs, malloc %.0f ns, free %.0f ns, tracer CPU %.2fs",
				r+1, res.variant, res.calls, res.spanS, res.medianNs["malloc"], res.medianNs["free"], res.tracerS)
		}
		results = append(results, round)
	}
	b.raw["overhead"] = results

	var rows []row
	cmd := fmt.Sprintf("sudo go run ./bench/npubench overhead --rounds %d --calls %d --threads %d", cfg.rounds, cfg.calls, cfg.threads)
	for _, k := range kinds {
		added := map[string][]float64{}
		var ratioFloor, ratioBpf []float64
		for _, round := range results {
			base := round[0].medianNs[k]
			for vi, v := range variants[1:] {
				added[v] = append(added[v], round[vi+1].medianNs[k]-base)
			}
			n := len(added["floor"]) - 1
			ratioFloor = append(ratioFloor, added["npuprobe"][n]/added["floor"][n])
			ratioBpf = append(ratioBpf, added["npuprobe"][n]/added["bpftrace"][n])
		}
		baseMed := median(collect(results, 0, k))
		for _, v := range variants[1:] {
			rows = append(rows, row{
				Metric: fmt.Sprintf("per-call cost added, %s (%s)", k, v),
				Result: fmt.Sprintf("%.2f µs (runs %s; unprobed call %.0f ns)", median(added[v])/1e3, spread(added[v], 1e3, "µs"), baseMed),
				Cmd:    cmd,
			})
		}
		rf, rb := median(ratioFloor), median(ratioBpf)
		rows = append(rows, row{
			Metric: fmt.Sprintf("npuprobe ÷ floor, added cost, %s", k),
			Result: fmt.Sprintf("%.3f (runs %s)", rf, spread(ratioFloor, 1, "")),
			Goal:   "≤ 1.10", Met: metStr(rf <= 1.10), Cmd: cmd,
		}, row{
			Metric: fmt.Sprintf("npuprobe ÷ bpftrace, added cost, %s", k),
			Result: fmt.Sprintf("%.3f (runs %s)", rb, spread(ratioBpf, 1, "")),
			Goal:   "< 1", Met: metStr(rb < 1), Cmd: cmd,
		})
	}
	// Tracer CPU per event: what each consumer costs in user space + its
	// own kernel time (npuprobe: reading the ring buffer, model; bpftrace:
	// perf buffer, formatting).
	for vi, v := range variants[1:] {
		var per []float64
		for _, round := range results {
			res := round[vi+1]
			per = append(per, res.tracerS/float64(res.calls)*1e9)
		}
		rows = append(rows, row{
			Metric: fmt.Sprintf("tracer process CPU per event (%s)", v),
			Result: fmt.Sprintf("%.0f ns (runs %s)", median(per), spread(per, 1, "ns")),
			Cmd:    cmd,
		})
	}
	return rows, nil
}

func collect(results [][]*runResult, vi int, k string) []float64 {
	var out []float64
	for _, round := range results {
		out = append(out, round[vi].medianNs[k])
	}
	return out
}

// spread formats the min–max of v (divided by div) as "a–b unit".
func spread(v []float64, div float64, unit string) string {
	lo, hi := slices.Min(v)/div, slices.Max(v)/div
	prec := 2
	if div == 1 && unit != "" {
		prec = 0
	}
	if div == 1 && unit == "" {
		prec = 3
	}
	s := fmt.Sprintf("%.*f–%.*f", prec, lo, prec, hi)
	if unit != "" {
		s += " " + unit
	}
	return s
}

func metStr(ok bool) string {
	if ok {
		return "yes"
	}
	return "**no**"
}

// bpfProgramStats runs the npuprobe (or floor) variant once with the
// kernel's BPF statistics on (kernel.bpf_stats_enabled) and returns, per
// attached program, its run count and mean run time: how much of the
// per-call cost is the programs' own work rather than the uprobe trap.
func (b *bencher) bpfProgramStats(floor bool, cfg overheadConfig) ([]row, error) {
	const sysctl = "/proc/sys/kernel/bpf_stats_enabled"
	old, err := os.ReadFile(sysctl)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(sysctl, []byte("1"), 0); err != nil {
		return nil, err
	}
	defer os.WriteFile(sysctl, old, 0)
	dir, err := os.MkdirTemp(b.tmp, "stats-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	w, err := startWorkload(b.fx, dir, "--threads", strconv.Itoa(cfg.threads), "--calls", strconv.Itoa(cfg.calls), "--no-oom")
	if err != nil {
		return nil, err
	}
	defer w.Kill()
	var extra []string
	name := "npuprobe"
	if floor {
		extra, name = []string{"--floor"}, "floor"
	}
	t, err := startNpuprobe(b.npuprobe, dir, []int{w.pid}, extra...)
	if err != nil {
		return nil, err
	}
	defer t.stop()
	w.Send("go")
	if _, err := w.Expect("done", 10*time.Minute); err != nil {
		return nil, err
	}
	ids, err := progIDs(t.cmd.Process.Pid)
	if err != nil {
		return nil, err
	}
	var rows []row
	var total time.Duration
	var calls uint64
	for _, id := range ids {
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue
		}
		info, err := p.Info()
		if err != nil {
			p.Close()
			continue
		}
		stats, err := p.Stats()
		p.Close()
		if err != nil {
			continue
		}
		n, rt := stats.RunCount, stats.Runtime
		if n == 0 {
			continue
		}
		total += rt
		calls += n
		rows = append(rows, row{
			Metric: fmt.Sprintf("BPF program %s (%s): mean run time", info.Name, name),
			Result: fmt.Sprintf("%.0f ns × %d runs", float64(rt.Nanoseconds())/float64(n), n),
			Cmd:    "sudo go run ./bench/npubench bpfstats",
		})
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Metric < rows[j].Metric })
	w.Send("exit")
	t.wait(time.Minute)
	b.logf("bpf stats (%s): %d program runs, %.0f ns mean", name, calls, float64(total.Nanoseconds())/float64(max(calls, 1)))
	return rows, nil
}

// progIDs lists the BPF programs a process holds open (its fdinfo).
func progIDs(pid int) ([]ebpf.ProgramID, error) {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fdinfo", pid))
	if err != nil {
		return nil, err
	}
	seen := map[ebpf.ProgramID]bool{}
	var ids []ebpf.ProgramID
	for _, fd := range fds {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, fd.Name()))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "prog_id:"); ok {
				id, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32)
				if err == nil && !seen[ebpf.ProgramID(id)] {
					seen[ebpf.ProgramID(id)] = true
					ids = append(ids, ebpf.ProgramID(id))
				}
			}
		}
	}
	return ids, nil
}

// procCPU is a process's user+system CPU seconds so far (/proc/PID/stat,
// in clock ticks of 1/100 s).
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100
}
