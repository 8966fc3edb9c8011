package e2e

import (
	"fmt"
	"testing"
	"time"
)

// TestSegmentLevelEndToEnd is the vertical slice: the workload starts
// first, allocates, and waits; npuprobe attaches by PID; the workload makes
// its calls from several threads (allocations, frees, frees of pre-attach
// allocations, one OOM); SIGUSR1 writes a snapshot, which must match the
// workload's own record call for call.
func TestSegmentLevelEndToEnd(t *testing.T) {
	const threads, calls = 3, 12000
	w := startWorkload(t, fixtures.SegmentWorkload, nil,
		"--threads", fmt.Sprint(threads), "--calls", fmt.Sprint(calls), "--pre-attach", "24")
	out := t.TempDir()
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", out, "--status-interval", "1s")

	w.send("go")
	w.expectLine("done", 2*time.Minute)
	path := a.snapshot()

	gt := w.groundTruth()
	checkWorkloadShape(t, gt, threads, calls)
	snap := loadSnapshot(t, path)
	checkSegmentSnapshot(t, gt, snap)

	// The target's exit gives a final snapshot with the same content, and
	// npuprobe exits 0 on its own.
	w.send("exit")
	final := a.expect(exitRE, time.Minute)[1]
	if code := a.wait(30 * time.Second); code != 0 {
		t.Fatalf("npuprobe exited %d after the target exited", code)
	}
	checkSegmentSnapshot(t, gt, loadSnapshot(t, final))
}
