package clock

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// distToRange returns how far v is outside [lo, hi] (0 inside).
func distToRange(v, lo, hi int64) int64 {
	switch {
	case v < lo:
		return lo - v
	case v > hi:
		return v - hi
	}
	return 0
}

func quantile(v []int64, p float64) int64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[int(p*float64(len(s)-1))]
}

// ctrModel is an injected counter: it runs at freq ticks per monotonic ns,
// times (1 + rate), where rate (the NTP correction of CLOCK_MONOTONIC
// against the hardware) is smooth but jumps by jumpPPM at jumpAt; at
// resetAt the counter restarts from resetTo at newFreq (a VM moved to
// another host).
type ctrModel struct {
	t0              int64
	freq, newFreq   float64
	jumpAt, resetAt int64
	jumpPPM         float64
	resetTo         int64
}

// ticks returns the counter at monotonic t.
func (m *ctrModel) ticks(t int64) int64 {
	if t >= m.resetAt {
		return m.resetTo + int64(math.Round(float64(t-m.resetAt)*m.newFreq))
	}
	dt := float64(t - m.t0)
	// Smooth: 20 ppm·sin over an hour; jump: jumpPPM after jumpAt.
	w := 2 * math.Pi / float64(time.Hour)
	phase := 20e-6 / w * (1 - math.Cos(w*dt))
	if t > m.jumpAt {
		phase += m.jumpPPM * 1e-6 * float64(t-m.jumpAt)
	}
	return 5_000_000_000_000 + int64(math.Round(m.freq*(dt+phase)))
}

type ctrSource struct {
	m   *ctrModel
	now int64
	rng *rand.Rand
}

func (s *ctrSource) tick()            { s.now += 15 + s.rng.Int64N(26) }
func (s *ctrSource) Monotonic() int64 { s.tick(); return s.now }
func (s *ctrSource) Realtime() int64  { s.tick(); return s.now + 1_700_000_000_000_000_000 }
func (s *ctrSource) Counter() (int64, bool) {
	s.tick()
	return s.m.ticks(s.now), true
}

// TestCounterConversionSimulated: a counter whose rate against monotonic
// time varies smoothly (±20 ppm), jumps by 40 ppm between two calibrations,
// and is reset (restarting at another frequency) an hour in; calibrations
// every minute. Counter readings convert to within 10 µs of the monotonic
// time they were taken at, except between the reset and the first
// calibration after it (where nothing tells the new rate).
func TestCounterConversionSimulated(t *testing.T) {
	t0 := 500 * int64(time.Second)
	m := &ctrModel{
		t0: t0, freq: 3.0, newFreq: 2.0, jumpPPM: 40,
		jumpAt:  t0 + int64(23*time.Minute+17300*time.Millisecond),
		resetAt: t0 + int64(61*time.Minute+5*time.Second),
		resetTo: 7_000_000,
	}
	src := &ctrSource{m: m, now: t0, rng: rand.New(rand.NewPCG(3, 4))}
	tr := NewTracker(src, 201)
	var firstAfterReset int64
	for src.now < t0+int64(90*time.Minute) {
		src.now += int64(time.Minute) + src.rng.Int64N(int64(200*time.Millisecond))
		c := tr.Recalibrate()
		if firstAfterReset == 0 && c.MonoNs > m.resetAt {
			firstAfterReset = c.MonoNs
		}
	}
	conv := tr.Converter()
	var errs []int64
	var worst, worstAt int64
	for x := t0 + 1; x < t0+int64(90*time.Minute); x += 10_000_000 + x%7 {
		if x >= m.resetAt && x < firstAfterReset {
			continue
		}
		got, ok := conv.CounterToMono(m.ticks(x))
		if !ok {
			t.Fatal("no counter conversion")
		}
		e := max(got-x, x-got)
		errs = append(errs, e)
		if e > worst {
			worst, worstAt = e, x
		}
	}
	t.Logf("%d readings: error median %d ns, p99 %d ns, max %d ns at t0%+.3f s", len(errs), quantile(errs, 0.5), quantile(errs, 0.99), worst, float64(worstAt-t0)/1e9)
	if worst > 10_000 {
		t.Errorf("worst counter→monotonic error %d ns at t0%+.3f s, want ≤ 10 µs", worst, float64(worstAt-t0)/1e9)
	}
	if f, _ := conv.CounterFrequency(); math.Abs(f-2.0) > 1e-9 {
		t.Errorf("frequency %.12f ticks/ns after the reset, want 2.0", f)
	}
	// Readings taken after the reset but before the next calibration are
	// still placed after the reset (on the new run, extrapolated back).
	mid := (m.resetAt + firstAfterReset) / 2
	if got, _ := conv.CounterToMono(m.ticks(mid)); got < m.resetAt {
		t.Errorf("reading after the reset converted to %d, before the reset at %d", got, m.resetAt)
	}
}
