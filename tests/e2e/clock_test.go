package e2e

import (
	"strconv"
	"testing"
	"time"
)

// TestTimeAccuracy: over 100,000 traced calls, time_us lies within its
// call's [before, after] CLOCK_REALTIME interval (as the workload itself
// read it) to a median of 5 µs and a 99.9th percentile of 50 µs, and the
// snapshot says which clocks were used and how well they were calibrated.
func TestTimeAccuracy(t *testing.T) {
	const calls = 100_000
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--threads", "2", "--calls", "100000", "--pre-attach", "8")
	a := startAgent(t, "--pid", itoa(w.pid), "--out", t.TempDir(), "--ring-size", "33554432")
	w.send("go")
	w.expectLine("done", 5*time.Minute)
	snap := loadSnapshot(t, a.snapshot())
	gt := w.groundTruth()

	want, _ := segmentExpectations(t, gt)
	stats := matchTrace(t, snap.DeviceTraces[0], want, 1_000_000) // match first, judge after
	n := len(stats.DistancesUs)
	median, p999, worst := stats.Quantile(0.5), stats.Quantile(0.999), stats.Quantile(1)
	t.Logf("%d calls: distance from time_us to the call's [before, after] interval: median %.2f µs, p99.9 %.2f µs, max %.2f µs",
		n, median, p999, worst)
	if n < calls-16 {
		t.Fatalf("only %d calls matched", n)
	}
	if median > 5 || p999 > 50 {
		t.Fatalf("time_us accuracy: median %.2f µs (want ≤ 5), p99.9 %.2f µs (want ≤ 50)", median, p999)
	}

	var clk struct {
		EventClock         string `json:"event_clock"`
		CalibratedAgainst  string `json:"calibrated_against"`
		CalibrationErrorNs int64  `json:"calibration_error_ns"`
		Calibrations       int    `json:"calibrations"`
	}
	snap.Setting(t, "npuprobe_clock", &clk)
	if clk.EventClock == "" || clk.CalibratedAgainst == "" || clk.Calibrations < 2 || clk.CalibrationErrorNs <= 0 || clk.CalibrationErrorNs > 50_000 {
		t.Fatalf("npuprobe_clock metadata %+v", clk)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
