package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/tests/fixture"
)

// lossCase is one load: several 2-thread workloads traced by one npuprobe
// with the given ring size, optionally with the reader stopped (SIGSTOP)
// for stall while they run, as a long snapshot write or a descheduled
// agent would.
type lossCase struct {
	workloads int
	ringSize  int // 0: default
	stall     time.Duration
}

func (c lossCase) String() string {
	s := fmt.Sprintf("%d×2 threads", c.workloads)
	if c.ringSize != 0 {
		s += fmt.Sprintf(", ring %d KiB", c.ringSize>>10)
	} else {
		s += ", default ring (8 MiB)"
	}
	if c.stall > 0 {
		s += fmt.Sprintf(", reader stopped %v", c.stall)
	}
	return s
}

type lossResult struct {
	events   int     // run-phase calls, all workloads
	rate     float64 // events/s over the run
	dropped  uint64
	segsOK   bool
	segsNote string
}

// runLoss runs one case and checks every workload's final segments
// against its ground truth.
func (b *bencher) runLoss(c lossCase, calls int) (*lossResult, error) {
	dir, err := os.MkdirTemp(b.tmp, "loss-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	var ws []*workload
	defer func() {
		for _, w := range ws {
			w.Kill()
		}
	}()
	var pids []int
	for range c.workloads {
		w, err := startWorkload(b.fx, dir, "--threads", "2", "--calls", strconv.Itoa(calls), "--no-oom")
		if err != nil {
			return nil, err
		}
		ws = append(ws, w)
		pids = append(pids, w.pid)
	}
	var extra []string
	if c.ringSize != 0 {
		extra = append(extra, "--ring-size", strconv.Itoa(c.ringSize))
	}
	t, err := startNpuprobe(b.npuprobe, dir, pids, extra...)
	if err != nil {
		return nil, err
	}
	defer t.stop()
	for _, w := range ws {
		if err := w.Send("go"); err != nil {
			return nil, err
		}
	}
	if c.stall > 0 {
		time.Sleep(50 * time.Millisecond)
		t.cmd.Process.Signal(syscall.SIGSTOP)
		time.Sleep(c.stall)
		t.cmd.Process.Signal(syscall.SIGCONT)
	}
	for _, w := range ws {
		if _, err := w.Expect("done", 10*time.Minute); err != nil {
			return nil, err
		}
	}
	// A snapshot of every process once all is done.
	t.cmd.Process.Signal(syscall.SIGUSR1)
	wrote := regexp.MustCompile(`^npuprobe: wrote (\S+\.pickle)$`)
	paths := map[int]string{}
	for range ws {
		m, err := t.expect(wrote, 2*time.Minute)
		if err != nil {
			return nil, fmt.Errorf("%v\n%s", err, t.log())
		}
		paths[pidOfSnapshot(m[1])] = m[1]
	}
	res := &lossResult{segsOK: true}
	var first, last int64 = 1 << 62, 0
	for _, w := range ws {
		gt, err := w.groundTruth()
		if err != nil {
			return nil, err
		}
		for _, call := range gt.Calls {
			if call.Phase == fixture.PhaseRun {
				res.events++
				first, last = min(first, call.BeforeNs), max(last, call.AfterNs)
			}
		}
		path, ok := paths[w.pid]
		if !ok {
			return nil, fmt.Errorf("no snapshot of pid %d among %v", w.pid, paths)
		}
		snap, err := snapshot.ReadFile(path)
		if err != nil {
			return nil, err
		}
		if v, ok := snap.Setting("npuprobe_dropped_events"); ok {
			// The counter is npuprobe's, for all processes: take it once.
			if n, ok := v.(int64); ok && uint64(n) > res.dropped {
				res.dropped = uint64(n)
			}
		}
		if note := compareSegments(gt, snap); note != "" {
			res.segsOK = false
			res.segsNote += fmt.Sprintf("pid %d: %s; ", w.pid, note)
		}
	}
	res.rate = float64(res.events) / (float64(last-first) / 1e9)
	for _, w := range ws {
		w.Send("exit")
	}
	t.wait(time.Minute)
	return res, nil
}

// pidOfSnapshot reads the PID out of npuprobe-<host>-<pid>-<time>-<reason>.pickle:
// the part before the UTC time (host names may hold dashes and digits).
func pidOfSnapshot(path string) int {
	parts := strings.Split(filepath.Base(path), "-")
	for i := 2; i < len(parts); i++ {
		if timeRE.MatchString(parts[i]) {
			n, _ := strconv.Atoi(parts[i-1])
			return n
		}
	}
	return 0
}

var timeRE = regexp.MustCompile(`^\d{8}T\d{6}\.\d+Z$`)

// compareSegments checks the snapshot's segments against the allocations
// the workload made after attach and still holds ("" if equal).
func compareSegments(gt *fixture.GroundTruth, snap *snapshot.Snapshot) string {
	var want []fixture.Live
	for _, l := range gt.Live {
		if l.Phase == fixture.PhaseRun {
			want = append(want, l)
		}
	}
	sort.Slice(want, func(i, j int) bool { return want[i].Address < want[j].Address })
	segs := snap.Segments
	sort.Slice(segs, func(i, j int) bool { return segs[i].Address < segs[j].Address })
	if len(segs) != len(want) {
		return fmt.Sprintf("%d segments, the workload holds %d", len(segs), len(want))
	}
	for i, s := range segs {
		if uint64(s.Address) != want[i].Address || uint64(s.TotalSize) != want[i].Size || s.Device != want[i].Device {
			return fmt.Sprintf("segment %d = {dev %d %#x %d}, workload has {dev %d %#x %d}",
				i, s.Device, s.Address, s.TotalSize, want[i].Device, want[i].Address, want[i].Size)
		}
	}
	return ""
}

// loss runs the cases and reports the highest zero-drop rate and what
// happens above it.
func (b *bencher) loss(calls int) ([]row, error) {
	cases := []lossCase{
		{workloads: 1}, {workloads: 2}, {workloads: 4}, {workloads: 8},
		{workloads: 1, stall: 2 * time.Second},
		{workloads: 4, stall: 2 * time.Second},
		{workloads: 1, ringSize: 64 << 10},
		{workloads: 4, ringSize: 64 << 10},
	}
	cmd := fmt.Sprintf("sudo go run ./bench/npubench loss --loss-calls %d", calls)
	var rows []row
	bestZero := 0.0
	for _, c := range cases {
		res, err := b.runLoss(c, calls)
		if err != nil {
			return nil, fmt.Errorf("loss %v: %w", c, err)
		}
		frac := float64(res.dropped) / float64(res.events)
		state := "segments = ground truth"
		if !res.segsOK {
			state = "**segments differ**: " + res.segsNote
		}
		b.logf("loss %-45s %7d events at %8.0f/s, %d dropped (%.2f%%), %s", c, res.events, res.rate, res.dropped, 100*frac, state)
		if res.dropped == 0 && c.ringSize == 0 && c.stall == 0 {
			bestZero = max(bestZero, res.rate)
		}
		rows = append(rows, row{
			Metric: "loss: " + c.String(),
			Result: fmt.Sprintf("%.0f events/s, %d of %d dropped (%.2f %%), %s", res.rate, res.dropped, res.events, 100*frac, state),
			Met:    metStr(res.segsOK),
			Goal:   "drops counted, state right",
			Cmd:    cmd,
		})
	}
	rows = append([]row{{
		Metric: "loss: highest event rate with zero drops, default ring",
		Result: fmt.Sprintf("%.0f events/s", bestZero),
		Cmd:    cmd,
	}}, rows...)
	return rows, nil
}
