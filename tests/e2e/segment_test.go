package e2e

import (
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
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

// checkWorkloadShape makes sure the ground truth exercises what the test
// claims: enough calls, several threads, pre-attach frees, one OOM.
func checkWorkloadShape(t *testing.T, gt *fixture.GroundTruth, threads, calls int) {
	t.Helper()
	run, ooms, preFrees := 0, 0, 0
	tids := make(map[int]bool)
	sizes := allocationSizesAtFree(gt)
	for _, c := range gt.Calls {
		if c.Phase != fixture.PhaseRun {
			continue
		}
		run++
		tids[c.Tid] = true
		if c.RC == fixture.ACLErrorRTMemoryAllocation {
			ooms++
		}
		if c.Func == fixture.FuncFree {
			if l := sizes[callKey{c.Tid, c.Seq}]; l.Phase == fixture.PhasePre {
				preFrees++
			}
		}
	}
	if run < 10000 || run != calls {
		t.Fatalf("workload made %d calls after attach, want %d (at least 10,000)", run, calls)
	}
	if len(tids) < 2 || len(tids) != threads {
		t.Fatalf("calls came from %d threads, want %d", len(tids), threads)
	}
	if ooms != 1 {
		t.Fatalf("workload had %d OOMs, want 1", ooms)
	}
	if preFrees == 0 {
		t.Fatal("workload freed no pre-attach allocation")
	}
}

func checkSegmentSnapshot(t *testing.T, gt *fixture.GroundTruth, snap *Snapshot) {
	t.Helper()
	var level string
	snap.setting(t, "npuprobe_level", &level)
	if level != "segment" {
		t.Errorf("npuprobe_level = %q, want segment", level)
	}
	var dropped uint64
	snap.setting(t, "npuprobe_dropped_events", &dropped)
	if dropped != 0 {
		t.Errorf("%d events dropped", dropped)
	}

	// Every run-phase call exactly once, per-thread order, exact values,
	// time within 50 µs of the call.
	if len(snap.DeviceTraces) != 1 {
		t.Fatalf("%d device traces, want 1 (device 0)", len(snap.DeviceTraces))
	}
	want, unknownFrees := segmentExpectations(t, gt)
	stats := matchTrace(t, snap.DeviceTraces[0], want, 50)
	t.Logf("%d entries matched; time_us distance to the call interval: median %.1f µs, p99.9 %.1f µs, max %.1f µs",
		len(stats.distancesUs), stats.quantile(0.5), stats.quantile(0.999), stats.quantile(1))

	var model struct {
		SegmentFreesSizeUnknown int `json:"segment_frees_size_unknown"`
		OOMs                    int `json:"ooms"`
		OOMDeviceFreeInferred   int `json:"oom_device_free_inferred"`
	}
	snap.setting(t, "npuprobe_model", &model)
	if model.SegmentFreesSizeUnknown != unknownFrees {
		t.Errorf("metadata counts %d frees of unknown size, workload freed %d pre-attach allocations",
			model.SegmentFreesSizeUnknown, unknownFrees)
	}
	if model.OOMs != 1 || model.OOMDeviceFreeInferred != 0 {
		t.Errorf("metadata: %d OOMs, %d with inferred device_free; want 1 and 0", model.OOMs, model.OOMDeviceFreeInferred)
	}

	// Live segments: exactly the workload's live allocations made after
	// attach (those made before are invisible to a tracer that was not there).
	var wantLive []fixture.Live
	for _, l := range gt.Live {
		if l.Phase == fixture.PhaseRun {
			wantLive = append(wantLive, l)
		}
	}
	sort.Slice(wantLive, func(i, j int) bool { return wantLive[i].Address < wantLive[j].Address })
	if len(snap.Segments) != len(wantLive) {
		t.Fatalf("%d live segments, workload holds %d allocated after attach", len(snap.Segments), len(wantLive))
	}
	for i, s := range snap.Segments {
		l := wantLive[i]
		if s.Address != l.Address || s.TotalSize != l.Size || s.Device != l.Device {
			t.Fatalf("segment %d = {dev %d %#x size %d}, workload has {dev %d %#x size %d}",
				i, s.Device, s.Address, s.TotalSize, l.Device, l.Address, l.Size)
		}
		wantType := "large"
		if l.Size == 2<<20 {
			wantType = "small"
		}
		if s.SegmentType != wantType || len(s.Blocks) != 1 || s.Blocks[0].State != "inactive" || s.Blocks[0].Size != s.TotalSize {
			t.Fatalf("segment %d: type %s, blocks %+v; want %s with one inactive block of the full size", i, s.SegmentType, s.Blocks, wantType)
		}
	}
}
