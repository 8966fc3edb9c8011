package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/snapshot"
)

// TestMergeStatsPlotRecordings: two ranks (RANK=1 on device 0, RANK=0 on
// device 1), each traced by npuprobe; `npuprobe merge` puts rank 0 first
// whatever the argument order, the result passes the checker, and stats
// and plot read real recordings.
func TestMergeStatsPlotRecordings(t *testing.T) {
	type rank struct {
		rank, device int
		path         string
		snap         *snapshot.Snapshot
	}
	ranks := []*rank{{rank: 1, device: 0}, {rank: 0, device: 1}}
	for _, r := range ranks {
		env := append(fixtures.TorchEnv(fixtures.TorchSymtabDir), fmt.Sprintf("RANK=%d", r.rank), fmt.Sprintf("LOCAL_RANK=%d", r.device))
		w := startProgram(t, fixtures.TensorWorkload, env, "", "--pattern", "churn", "--steps", "1500",
			"--seed", fmt.Sprint(20+r.rank), "--device", fmt.Sprint(r.device), "--pre-attach-steps", "0")
		a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--status-interval", "100ms")
		w.send("go")
		w.expectLine("done", 5*time.Minute)
		r.path = a.snapshot()
		var err error
		if r.snap, err = snapshot.ReadFile(r.path); err != nil {
			t.Fatal(err)
		}
		if got, ok := snapshot.Rank(r.snap); !ok || got != r.rank {
			t.Fatalf("recording of rank %d names rank %d (%v)", r.rank, got, ok)
		}
	}
	dir := t.TempDir()
	merged := filepath.Join(dir, "merged.pickle")
	out, err := exec.Command(npuprobe, "merge", "-o", merged, ranks[0].path, ranks[1].path).CombinedOutput()
	if err != nil {
		t.Fatalf("npuprobe merge: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "devices in rank order") {
		t.Errorf("merge said:\n%s", out)
	}
	loadSnapshot(t, merged) // checker with --expect-time, python3 and gopickle agree, mode 0600
	m, err := snapshot.ReadFile(merged)
	if err != nil {
		t.Fatal(err)
	}
	// Rank 0 (device 1 of its process) is device 0, rank 1 device 1.
	for newDev, r := range []*rank{ranks[1], ranks[0]} {
		want := r.snap.DeviceTraces[r.device]
		got := m.DeviceTraces[newDev]
		if len(want) == 0 || len(got) != len(want) {
			t.Fatalf("device %d: %d entries, rank %d's device %d has %d", newDev, len(got), r.rank, r.device, len(want))
		}
		for i := range want {
			if got[i].Action != want[i].Action || got[i].AddrOrFree() != want[i].AddrOrFree() || got[i].TimeUs != want[i].TimeUs {
				t.Fatalf("device %d entry %d differs from rank %d's", newDev, i, r.rank)
			}
		}
		n := 0
		for _, s := range m.Segments {
			if s.Device == newDev {
				n++
			}
		}
		if n != len(r.snap.Segments) {
			t.Errorf("device %d: %d segments, rank %d has %d", newDev, n, r.rank, len(r.snap.Segments))
		}
	}

	stats, err := exec.Command(npuprobe, "stats", merged).CombinedOutput()
	if err != nil || !strings.Contains(string(stats), "device 1\n") || strings.Count(string(stats), "npuprobe loss counters (npuprobe-") != 2 {
		t.Errorf("npuprobe stats: %v\n%s", err, stats)
	}
	page := filepath.Join(dir, "merged.html")
	if out, err := exec.Command(npuprobe, "plot", merged, "-o", page).CombinedOutput(); err != nil {
		t.Fatalf("npuprobe plot: %v\n%s", err, out)
	}
	html, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	for _, label := range []string{"Device 0 — rank 0", "Device 1 — rank 1", "default-src 'none'"} {
		if !strings.Contains(string(html), label) {
			t.Errorf("page lacks %q", label)
		}
	}
}
