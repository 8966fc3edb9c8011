package clock

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
	"time"
)

func TestMulDivFloor(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	check := func(a, b, c int64) {
		want := new(big.Int).Mul(big.NewInt(a), big.NewInt(b))
		// Floor division (big.Int.Div is Euclidean, which floors for c > 0).
		want.Div(want, big.NewInt(c))
		if !want.IsInt64() {
			return
		}
		if got := mulDivFloor(a, b, c); got != want.Int64() {
			t.Fatalf("mulDivFloor(%d, %d, %d) = %d, want %d", a, b, c, got, want.Int64())
		}
	}
	for _, v := range [][3]int64{{1, 1, 2}, {-1, 1, 2}, {-3, 5, 5}, {-3, 5, 4}, {7, 0, 3}, {0, 9, 3}, {math.MaxInt64, 3, 7}, {math.MinInt64 + 1, 3, 7}} {
		check(v[0], v[1], v[2])
	}
	for i := 0; i < 100000; i++ {
		a := rng.Int64() >> rng.IntN(63)
		if rng.IntN(2) == 0 {
			a = -a
		}
		b := rng.Int64() >> rng.IntN(63)
		c := max(rng.Int64()>>rng.IntN(63), 1)
		check(a, b, c)
	}
	if got := mulDivFloor(math.MaxInt64, math.MaxInt64, 1); got != math.MaxInt64 {
		t.Errorf("overflow saturates: %d", got)
	}
}

// linCals returns calibrations every minute (with a few seconds of
// jitter) from t0 over n minutes, their offset offset(mono), exact.
func linCals(t0 int64, n int, offset func(int64) int64) []Calibration {
	var cs []Calibration
	for i := 0; i <= n; i++ {
		m := t0 + int64(i)*int64(time.Minute) + int64(i*i%7)*int64(time.Second)
		cs = append(cs, Calibration{MonoNs: m, RealNs: m + offset(m), ErrorNs: 1})
	}
	return cs
}

func convFrom(cs []Calibration) *Converter {
	c := NewConverter(cs[0])
	for _, k := range cs[1:] {
		c.Add(k)
	}
	return c
}

// TestConverterKinkLocated: the offset drifts at +150 ppm, then from a
// moment between two calibrations at −250 ppm. Exact calibrations: every
// event is within a few ns, including inside the interval with the kink.
func TestConverterKinkLocated(t *testing.T) {
	t0 := int64(5000 * time.Second)
	kink := t0 + int64(7*time.Minute+23456789*time.Microsecond/1000)
	offset := func(m int64) int64 {
		d := float64(m - t0)
		o := 150e-6 * d
		if m > kink {
			o -= 400e-6 * float64(m-kink)
		}
		return 1_700_000_000_000_000_000 + int64(math.Round(o))
	}
	conv := convFrom(linCals(t0, 15, offset))
	var worst, worstAt int64
	for m := t0; m < t0+int64(15*time.Minute); m += 997_001 {
		if e := absDiff(conv.UnixNanos(m), m+offset(m)); e > worst {
			worst, worstAt = e, m
		}
	}
	t.Logf("worst %d ns at %+.3f s from the kink", worst, float64(worstAt-kink)/1e9)
	if worst > 5 {
		t.Errorf("worst error %d ns at %+.3f s from the kink, want ≤ 5 ns", worst, float64(worstAt-kink)/1e9)
	}
	if md := conv.Metadata(); md.Steps != 0 {
		t.Errorf("a 400 ppm kink counted as %d steps", md.Steps)
	}
}

// TestConverterExtrapolation: with a steady 300 ppm drift, events a minute
// before the first calibration and after the last follow the drift.
func TestConverterExtrapolation(t *testing.T) {
	t0 := int64(5000 * time.Second)
	offset := func(m int64) int64 { return 1_700_000_000_000_000_000 + (m-t0)*3/10_000 }
	conv := convFrom(linCals(t0, 10, offset))
	last := conv.Latest().MonoNs
	for _, m := range []int64{t0 - int64(time.Minute), t0 - 1, last + 1, last + int64(time.Minute), last + int64(10*time.Minute)} {
		if e := absDiff(conv.UnixNanos(m), m+offset(m)); e > 2 {
			t.Errorf("at %+.3f s from the first calibration: %d ns off", float64(m-t0)/1e9, e)
		}
	}
	// One calibration: the offset stays constant both ways.
	one := NewConverter(Calibration{MonoNs: 100, RealNs: 1000})
	if one.UnixNanos(-5000) != -4100 || one.UnixNanos(1e12) != 1e12+900 {
		t.Errorf("single calibration: %d, %d", one.UnixNanos(-5000), one.UnixNanos(1e12))
	}
}

// TestConverterSmallStepNotified: a 50 µs step is far below what drift
// could explain over a minute, so only its notification makes it a step;
// without it, it is spread over the interval.
func TestConverterSmallStepNotified(t *testing.T) {
	const O = int64(1_700_000_000_000_000_000)
	t0 := int64(100 * time.Second)
	at := t0 + int64(90*time.Second)
	truth := func(m int64) int64 {
		if m >= at {
			return m + O + 50_000
		}
		return m + O
	}
	var cs []Calibration
	for _, m := range []int64{t0, t0 + 60*int64(time.Second), t0 + 120*int64(time.Second), t0 + 180*int64(time.Second)} {
		cs = append(cs, Calibration{MonoNs: m, RealNs: truth(m), ErrorNs: 20})
	}
	plain := convFrom(cs)
	if plain.Metadata().Steps != 0 {
		t.Fatalf("a 50 µs change over a minute counted as a step")
	}
	if e := absDiff(plain.UnixNanos(at-1), truth(at-1)); e < 20_000 {
		t.Errorf("without the notification the step should be spread (error %d ns)", e)
	}
	notified := Calibration{MonoNs: at + 30_000, RealNs: truth(at + 30_000), ErrorNs: 20, Step: true}
	conv := convFrom(append(cs, notified))
	md := conv.Metadata()
	if md.Steps != 1 || md.StepNotifications != 1 {
		t.Errorf("metadata %+v, want one step, one notification", md)
	}
	for _, m := range []int64{t0, at - 1, at + 29_999, at + 30_000, at + int64(time.Second), t0 + 170*int64(time.Second)} {
		want := truth(m)
		if m >= at && m < notified.MonoNs {
			want = m + O // between the step and its notification: pre-step timeline
		}
		if e := absDiff(conv.UnixNanos(m), want); e > 1 {
			t.Errorf("at %+d ns from the step: %d ns off", m-at, e)
		}
	}
}

// trackSource is a source for Tracker tests: time advances 10 ns a read,
// realtime is monotonic + off, the counter runs at 2 ticks/ns.
type trackSource struct{ now, off int64 }

func (s *trackSource) Monotonic() int64       { s.now += 10; return s.now }
func (s *trackSource) Realtime() int64        { s.now += 10; return s.now + s.off }
func (s *trackSource) Counter() (int64, bool) { s.now += 10; return 2 * s.now, true }

func TestTrackerAndMetadata(t *testing.T) {
	src := &trackSource{now: 1_000_000, off: 1_700_000_000_000_000_000}
	tr := NewTracker(src, 11)
	conv := tr.Converter()
	if _, ok := conv.CounterToMono(12345); ok {
		t.Errorf("counter conversion with one calibration")
	}
	if _, ok := conv.CounterFrequency(); ok {
		t.Errorf("counter frequency with one calibration")
	}
	src.now += int64(time.Minute)
	tr.Recalibrate()
	if f, ok := conv.CounterFrequency(); !ok || f != 2 {
		t.Errorf("frequency %v %v, want 2 ticks/ns", f, ok)
	}
	if m, ok := conv.CounterToMono(2 * 5_000_000_000); !ok || m != 5_000_000_000 {
		t.Errorf("CounterToMono = %d %v", m, ok)
	}
	if u, ok := conv.CounterToUnixMicros(2 * 5_000_000_000); !ok || u != (5_000_000_000+src.off)/1000 {
		t.Errorf("CounterToUnixMicros = %d %v", u, ok)
	}

	// A step of +3 s noticed at atMono: the calibration is placed there.
	src.now += int64(time.Minute)
	atMono := src.now
	src.off += 3 * int64(time.Second)
	src.now += 5000 // the notification's latency is not the tracker's business
	c := tr.StepNoticed(atMono)
	if c.MonoNs != atMono || c.OffsetNs() != src.off || !c.Step || c.HasCounter {
		t.Errorf("StepNoticed = %+v, want at %d with offset %d, Step, no counter", c, atMono, src.off)
	}
	if got := conv.UnixNanos(atMono - 1); got != atMono-1+src.off-3*int64(time.Second) {
		t.Errorf("just before the notification: %d", got)
	}
	if got := conv.UnixNanos(atMono); got != atMono+src.off {
		t.Errorf("at the notification: %d", got)
	}

	md := tr.Metadata()
	want := Metadata{
		Clocks:            ClockNames{Event: "monotonic", Reference: "realtime"},
		Calibrations:      3,
		LatestErrorNs:     20,
		WorstErrorNs:      20,
		Steps:             1,
		StepNotifications: 1,
		CounterTicksPerNs: 2,
	}
	md.Method = ""
	if md != want {
		t.Errorf("Metadata = %+v, want %+v", md, want)
	}
	fields := tr.Metadata().Fields()
	var keys []string
	for _, f := range fields {
		keys = append(keys, f.Key)
		switch f.Value.(type) {
		case string, int, int64, float64:
		default:
			t.Errorf("field %s has type %T", f.Key, f.Value)
		}
	}
	wantKeys := []string{"event_clock", "calibrated_against", "calibration_method", "calibrations", "calibration_error_ns",
		"calibration_error_worst_ns", "steps_detected", "step_notifications", "counter_ticks_per_ns", "counter_hz"}
	if len(keys) != len(wantKeys) {
		t.Fatalf("keys %v, want %v", keys, wantKeys)
	}
	for i := range keys {
		if keys[i] != wantKeys[i] {
			t.Errorf("keys %v, want %v", keys, wantKeys)
			break
		}
	}
	if fields[len(fields)-1].Value != int64(2_000_000_000) {
		t.Errorf("counter_hz = %v", fields[len(fields)-1].Value)
	}
}
