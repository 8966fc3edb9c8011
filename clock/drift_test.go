package clock

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// simModel is an injected clock: monotonic is true time; realtime is
// monotonic + offset(t), where the offset drifts at a rate swinging
// between +200 and −200 ppm over ten hours, slews at an extra 500 ppm for
// a while, and steps at known times.
type simModel struct {
	t0       int64   // monotonic start of the simulation
	base     int64   // offset at t0
	driftA   float64 // drift rate amplitude (200 ppm)
	driftP   float64 // drift period, ns
	driftPhi float64
	slewRate float64
	slewFrom int64 // slew active in [slewFrom, slewTo)
	slewTo   int64
	steps    []simStep
}

type simStep struct {
	at   int64 // monotonic time of the step
	size int64 // ns added to realtime
}

func newSimModel() *simModel {
	t0 := 1000 * simSec
	return &simModel{
		t0:       t0,
		base:     simEpoch - t0,
		driftA:   200e-6,
		driftP:   float64(20 * time.Hour), // cos over half a period: +200 → −200 ppm in 10 h
		driftPhi: 0,
		slewRate: 500e-6,
		slewFrom: t0 + int64(2*time.Hour+13*time.Minute+7300*time.Millisecond),
		slewTo:   t0 + int64(2*time.Hour+41*time.Minute+55100*time.Millisecond),
		steps: []simStep{
			{at: t0 + int64(4*time.Hour+7*time.Minute+13123457*time.Microsecond), size: +2 * simSec},
			{at: t0 + int64(7*time.Hour+31*time.Minute+48500*time.Millisecond), size: -2 * simSec},
		},
	}
}

// offset returns realtime − monotonic at monotonic t, to the nanosecond.
func (m *simModel) offset(t int64) int64 {
	dt := float64(t - m.t0)
	w := 2 * math.Pi / m.driftP
	drift := m.driftA / w * (math.Sin(w*dt+m.driftPhi) - math.Sin(m.driftPhi))
	slew := m.slewRate * float64(min(max(t-m.slewFrom, 0), m.slewTo-m.slewFrom))
	off := m.base + int64(math.Round(drift+slew))
	for _, s := range m.steps {
		if t >= s.at {
			off += s.size
		}
	}
	return off
}

// rate returns d(offset)/dt at t (for the report).
func (m *simModel) rate(t int64) float64 {
	r := m.driftA * math.Cos(2*math.Pi/m.driftP*float64(t-m.t0)+m.driftPhi)
	if t >= m.slewFrom && t < m.slewTo {
		r += m.slewRate
	}
	return r
}

// simSource reads the model's clocks. Every read advances time by a
// random 15–40 ns; one read in 400 is preempted for 2–60 µs. The counter
// runs at 2.4 ticks/ns from an arbitrary origin.
type simSource struct {
	m   *simModel
	now int64
	rng *rand.Rand
}

func (s *simSource) tick() {
	s.now += 15 + s.rng.Int64N(26)
	if s.rng.IntN(400) == 0 {
		s.now += 2000 + s.rng.Int64N(58000)
	}
}

func (s *simSource) Monotonic() int64 { s.tick(); return s.now }
func (s *simSource) Realtime() int64  { s.tick(); return s.now + s.m.offset(s.now) }
func (s *simSource) Counter() (int64, bool) {
	s.tick()
	return 987_654_321 + s.now*12/5, true
}

// simRun drives a Tracker over ten simulated hours: a calibration about
// every minute, and (if notify) a step notification latency[i] after step
// i. It returns the tracker and the notification times.
func simRun(t *testing.T, m *simModel, seed uint64, notify bool, latency []time.Duration) (*Tracker, []int64) {
	t.Helper()
	src := &simSource{m: m, now: m.t0, rng: rand.New(rand.NewPCG(seed, 0x5eed))}
	tr := NewTracker(src, DefaultPairs)
	end := m.t0 + int64(10*time.Hour)
	next := src.now + 60*simSec
	var notes []int64
	si := 0
	for src.now < end {
		if notify && si < len(m.steps) && m.steps[si].at < next {
			src.now = m.steps[si].at + int64(latency[si])
			n := src.Monotonic()
			notes = append(notes, n)
			tr.StepNoticed(n)
			si++
			continue
		}
		src.now = next
		tr.Recalibrate()
		next = src.now + 60*simSec + src.rng.Int64N(200*int64(time.Millisecond))
	}
	tr.Recalibrate() // the snapshot's calibration
	return tr, notes
}

// simEvents returns event times: every ~0.7 s over the run, every 1 µs
// from 2 ms before each step to 2 ms after its notification, and every
// 50 µs for 2 s around both ends of the slew.
func simEvents(m *simModel, notes []int64, rng *rand.Rand) []int64 {
	var ev []int64
	for t := m.t0 + 1; t < m.t0+int64(10*time.Hour); t += 700*int64(time.Millisecond) + rng.Int64N(1000) {
		ev = append(ev, t)
	}
	for i, s := range m.steps {
		to := s.at + 2*int64(time.Millisecond)
		if i < len(notes) {
			to = notes[i] + 2*int64(time.Millisecond)
		}
		for t := s.at - 2*int64(time.Millisecond); t < to; t += 1000 {
			ev = append(ev, t)
		}
	}
	for _, edge := range []int64{m.slewFrom, m.slewTo} {
		for t := edge - simSec; t < edge+simSec; t += 50_000 {
			ev = append(ev, t)
		}
	}
	slices.Sort(ev)
	return slices.Compact(ev)
}

type errStats struct {
	n        int
	abs      []int64
	worst    int64
	worstAt  int64
	inWindow int // events between a step and its notification
	oldSide  int // ... converted on the pre-step timeline
}

func (s *errStats) add(t, e int64) {
	s.n++
	e = max(e, -e)
	s.abs = append(s.abs, e)
	if e > s.worst {
		s.worst, s.worstAt = e, t
	}
}

func (s *errStats) pct(p float64) int64 {
	if len(s.abs) == 0 {
		return 0
	}
	a := slices.Clone(s.abs)
	slices.Sort(a)
	return a[int(p*float64(len(a)-1))]
}

// simCheck converts every event and compares it with the injected truth.
// Between a step and its notification either timeline is accepted.
func simCheck(m *simModel, conv *Converter, notes []int64, events []int64) *errStats {
	st := &errStats{}
	for _, t := range events {
		got := conv.UnixNanos(t)
		truth := t + m.offset(t)
		e := got - truth
		for i, s := range m.steps {
			if i < len(notes) && t >= s.at && t < notes[i] {
				st.inWindow++
				old := truth - s.size
				if d := got - old; max(d, -d) < max(e, -e) {
					e = d
					st.oldSide++
				}
			}
		}
		st.add(t, e)
	}
	return st
}

// TestSimulatedDriftStepsSlew: ten simulated hours with drift (±200 ppm),
// an NTP slew (+500 ppm for 29 minutes, starting and stopping between
// calibrations), a +2 s and a −2 s step noticed after 80 µs and 3 ms, a
// calibration every minute: every event within 10 µs of the truth (events
// between a step and its notification: of either side's truth).
func TestSimulatedDriftStepsSlew(t *testing.T) {
	const bound = 10_000 // ns
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			m := newSimModel()
			latency := []time.Duration{80 * time.Microsecond, 3 * time.Millisecond}
			tr, notes := simRun(t, m, seed, true, latency)
			conv := tr.Converter()
			events := simEvents(m, notes, rand.New(rand.NewPCG(seed, 7)))
			st := simCheck(m, conv, notes, events)
			t.Logf("%d events: |error| median %d ns, p99 %d ns, p99.9 %d ns, max %d ns at %+.6f s (drift+slew rate there %+.1f ppm)",
				st.n, st.pct(0.5), st.pct(0.99), st.pct(0.999), st.worst, float64(st.worstAt-m.t0)/1e9, m.rate(st.worstAt)*1e6)
			t.Logf("%d events between a step and its notification, %d of them on the pre-step timeline", st.inWindow, st.oldSide)
			if st.worst > bound {
				t.Errorf("worst error %d ns at t0%+.6f s, want ≤ %d ns", st.worst, float64(st.worstAt-m.t0)/1e9, bound)
			}
			if st.inWindow == 0 {
				t.Errorf("no event between a step and its notification: the window is not exercised")
			}
			if st.oldSide != st.inWindow {
				t.Errorf("%d of %d events between a step and its notification on the post-step timeline, want all on the pre-step one",
					st.inWindow-st.oldSide, st.inWindow)
			}
			for i, s := range m.steps {
				if w := notes[i] - s.at; w < int64(latency[i]) || w > int64(latency[i])+1000 {
					t.Errorf("step %d noticed %d ns after it happened, want the injected latency %v", i, w, latency[i])
				}
			}
			md := conv.Metadata()
			if md.Steps != 2 || md.StepNotifications != 2 {
				t.Errorf("metadata: %d steps, %d notifications, want 2 and 2", md.Steps, md.StepNotifications)
			}
			if md.Calibrations < 600 || md.Calibrations > 605 {
				t.Errorf("%d calibrations, want one a minute over 10 h", md.Calibrations)
			}
			if md.WorstErrorNs > 200 || md.LatestErrorNs > 200 {
				t.Errorf("calibration errors latest %d, worst %d ns: outlier brackets were kept", md.LatestErrorNs, md.WorstErrorNs)
			}
			if f := md.CounterTicksPerNs; math.Abs(f-2.4) > 1e-7 {
				t.Errorf("counter frequency %.9f ticks/ns, want 2.4", f)
			}
		})
	}
}

// TestSimulatedStepWithoutNotification is the control: without the step
// notifications a step is only seen at the next calibration, and events in
// between are a whole step off. It shows the test above can fail.
func TestSimulatedStepWithoutNotification(t *testing.T) {
	m := newSimModel()
	tr, _ := simRun(t, m, 1, false, nil)
	events := simEvents(m, nil, rand.New(rand.NewPCG(1, 7)))
	st := simCheck(m, tr.Converter(), nil, events)
	t.Logf("without notifications: max error %d ns at t0%+.3f s", st.worst, float64(st.worstAt-m.t0)/1e9)
	if st.worst < simSec {
		t.Errorf("max error %d ns without step notifications, want a whole step (≥ 1 s)", st.worst)
	}
	if md := tr.Converter().Metadata(); md.Steps != 2 || md.StepNotifications != 0 {
		t.Errorf("metadata: %d steps, %d notifications, want 2 (found by size) and 0", md.Steps, md.StepNotifications)
	}
}

// TestSimulatedSlewNeedsKinks is the control for the slew: plain linear
// interpolation between the same calibrations is milliseconds off where the
// slew starts and stops between two calibrations, so the 10 µs bound above
// really tests the kink location.
func TestSimulatedSlewNeedsKinks(t *testing.T) {
	m := newSimModel()
	tr, _ := simRun(t, m, 1, true, []time.Duration{80 * time.Microsecond, 3 * time.Millisecond})
	cals := tr.Converter().Calibrations()
	chord := func(x int64) int64 {
		i, _ := slices.BinarySearchFunc(cals, x, func(c Calibration, x int64) int { return cmpInt64(c.MonoNs, x) })
		a, b := cals[i-1], cals[i]
		return a.RealNs + mulDivFloor(b.RealNs-a.RealNs, x-a.MonoNs, b.MonoNs-a.MonoNs)
	}
	var worstChord, worstConv int64
	for _, edge := range []int64{m.slewFrom, m.slewTo} {
		for x := edge - 30*simSec; x < edge+30*simSec; x += 100_000 {
			truth := x + m.offset(x)
			worstChord = max(worstChord, absDiff(chord(x), truth))
			worstConv = max(worstConv, absDiff(tr.Converter().UnixNanos(x), truth))
		}
	}
	t.Logf("around the slew's ends: linear interpolation off by up to %d ns, the converter by %d ns", worstChord, worstConv)
	if worstChord < int64(time.Millisecond) {
		t.Errorf("linear interpolation only %d ns off: the slew does not stress the rule", worstChord)
	}
	if worstConv > 10_000 {
		t.Errorf("converter %d ns off around the slew's ends", worstConv)
	}
}

func cmpInt64(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func absDiff(a, b int64) int64 {
	if a > b {
		return a - b
	}
	return b - a
}

const (
	simEpoch = int64(1_767_225_600_000_000_000) // 2026-01-01T00:00:00Z, ns
	simSec   = int64(time.Second)
)
