package clock

import (
	"math"
	"runtime"
	"slices"
	"testing"
	"time"
)

// TestSystemCounterConversion checks the CPU counter conversion against
// the clocks of this machine. Over about a second it reads bracketed pairs
// (monotonic, counter, monotonic) and (counter, realtime, counter), then
// converts the counter readings: each converted value should fall inside
// the bracket of the clock it is compared with. Both ways the agent meets
// counter timestamps are measured: extrapolated from two calibrations
// 100 ms apart made before the readings, and interpolated between those and
// a calibration made after them.
func TestSystemCounterConversion(t *testing.T) {
	var src System
	if _, ok := src.Counter(); !ok {
		t.Skipf("no CPU counter reader on %s", runtime.GOARCH)
	}
	tr := NewTracker(src, DefaultPairs)
	time.Sleep(100 * time.Millisecond)
	tr.Recalibrate()
	conv := tr.Converter()
	f0, ok := conv.CounterFrequency()
	if !ok {
		t.Fatal("no counter frequency after two calibrations")
	}

	type monoPair struct{ m0, c, m1 int64 }
	type realPair struct{ c0, r, c1 int64 }
	var mp []monoPair
	var rp []realPair
	end := src.Monotonic() + int64(time.Second)
	for src.Monotonic() < end {
		m0 := src.Monotonic()
		c, _ := src.Counter()
		m1 := src.Monotonic()
		mp = append(mp, monoPair{m0, c, m1})
		c0, _ := src.Counter()
		r := src.Realtime()
		c1, _ := src.Counter()
		rp = append(rp, realPair{c0, r, c1})
		time.Sleep(time.Millisecond)
	}
	if len(mp) < 200 {
		t.Fatalf("only %d pairs in a second", len(mp))
	}

	measure := func(name string) {
		var monoErr, realErr, midErr []int64
		for _, p := range mp {
			m, _ := conv.CounterToMono(p.c)
			monoErr = append(monoErr, distToRange(m, p.m0, p.m1))
			midErr = append(midErr, absDiff(m, p.m0+(p.m1-p.m0)/2))
		}
		for _, p := range rp {
			lo, _ := conv.CounterToUnixNanos(p.c0)
			hi, _ := conv.CounterToUnixNanos(p.c1)
			realErr = append(realErr, distToRange(p.r, lo, hi))
		}
		t.Logf("%s: counter→monotonic error median %d ns, p99 %d ns, max %d ns; counter→unix error median %d ns, p99 %d ns, max %d ns (%d pairs each)",
			name, quantile(monoErr, 0.5), quantile(monoErr, 0.99), slices.Max(monoErr),
			quantile(realErr, 0.5), quantile(realErr, 0.99), slices.Max(realErr), len(mp))
		t.Logf("%s: |counter→monotonic − bracket midpoint| median %d ns, p99 %d ns, max %d ns", name, quantile(midErr, 0.5), quantile(midErr, 0.99), slices.Max(midErr))
		if m := quantile(monoErr, 0.5); m > 5000 {
			t.Errorf("%s: counter→monotonic median error %d ns, want ≤ 5 µs", name, m)
		}
		if m := quantile(realErr, 0.5); m > 5000 {
			t.Errorf("%s: counter→unix median error %d ns, want ≤ 5 µs", name, m)
		}
	}
	measure("extrapolated (calibrations 100 ms apart, before the readings)")
	tr.Recalibrate()
	measure("interpolated (calibrations before and after)")

	// The frequency against one measured directly over the second.
	a, b := mp[0], mp[len(mp)-1]
	direct := float64(b.c-a.c) / (float64(b.m0+b.m1)/2 - float64(a.m0+a.m1)/2)
	f1, _ := conv.CounterFrequency()
	t.Logf("counter frequency: %.6f MHz from 100 ms, %.6f MHz over the run, %.6f MHz measured directly over 1 s",
		f0*1e3, f1*1e3, direct*1e3)
	if d := math.Abs(f1/direct - 1); d > 2e-6 {
		t.Errorf("frequency %.9f ticks/ns, direct %.9f: %.2f ppm apart, want ≤ 2", f1, direct, d*1e6)
	}
	if md := tr.Metadata(); md.Clocks.Counter != CounterName || md.CounterTicksPerNs != f1 || md.Calibrations != 3 {
		t.Errorf("metadata %+v", md)
	}
}
