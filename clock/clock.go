// Package clock puts npuprobe's event timestamps on the unix timeline.
//
// BPF programs stamp events with CLOCK_MONOTONIC (no BPF helper reads
// CLOCK_REALTIME). Snapshots need unix microseconds. A Calibration pairs one
// monotonic reading with one realtime reading and, where the architecture
// has one, a CPU counter reading (x86 TSC, arm64 CNTVCT_EL0). A Converter
// keeps the history of calibrations and converts each event with the
// calibrations around it, so neither drift nor a wall-clock step moves
// events wrongly. A Tracker takes the calibrations (at start, periodically,
// before each snapshot, and on every step notification).
//
// # Calibrating
//
// CalibrateMedian takes many bracketed samples (read monotonic, counter,
// realtime, counter, monotonic), drops the samples whose bracket is more
// than twice the median bracket width (preempted or interrupted reads), and
// keeps the sample whose realtime−monotonic offset is the median of the
// rest (the true median; the lower one for an even count). Its error bound
// ErrorNs is half that sample's bracket: realtime and both counter reads
// happened inside it. PyTorch's ApproximateClockToUnixTimeConverter also
// brackets 1001 pairs but takes the 502nd correction without sorting; here
// the median is real and outliers cannot move it. Calibrate, which keeps
// the tightest bracket, remains for callers that want it.
//
// # Conversion rule (monotonic → unix)
//
// Let c_0 … c_n be the calibrations sorted by MonoNs and o_i = RealNs−MonoNs
// their offsets. Two neighbours c_i, c_{i+1} are separated by a step when
// c_{i+1} was made on a step notification (Step), when they have the same
// MonoNs, or when
//
//	|o_{i+1} − o_i| > MaxRatePPM·10⁻⁶·(MonoNs_{i+1} − MonoNs_i) + ErrorNs_i + ErrorNs_{i+1} + 1 ns
//
// MaxRatePPM (1000) is the most the kernel's NTP interface lets a clock run
// away from a free-running one: ±500 ppm of frequency plus 500 ppm of
// adjtime slew. Steps cut the history into runs. An event at monotonic t is
// converted to t + offset(t), where:
//
//   - inside a run, between c_i and c_{i+1}, the offset is interpolated
//     between o_i and o_{i+1}: along a quadratic whose curvature is the mean
//     of the two neighbouring second differences (only those that are
//     plausibly smooth, at most 10 ppm of rate change per minute, and do
//     not touch a kink), linearly if there is none. This follows drift and
//     slew;
//   - a kink is a jump of the offset's rate inside one interval (an NTP
//     slew starting or stopping, a frequency correction). When an interval
//     has two intervals on each side in its run and the rates of its
//     neighbours, carried to its ends with the curvature on their side,
//     jump by more than 0.1 ppm plus the disagreement of those curvatures,
//     the kink is located where the two sides meet, and each side of it
//     follows its own rate;
//   - after the last calibration of a run, up to the first of the next one
//     (the interval holding a step), the offset continues the run's rate at
//     its end, with its curvature for up to two intervals, then linearly:
//     events before a step keep the pre-step timeline, events from the next
//     calibration on are on the post-step one. The same holds after the
//     last calibration of all (the agent calibrates before every snapshot,
//     so no converted event lies there);
//   - before the first calibration, the offset continues the first run's
//     rate at its start backwards (a single calibration: its offset);
//   - a run of one calibration continues the rate of the run before it (the
//     drift does not stop at a step).
//
// UnixMicros then takes floor(ns/1000), as torch's integer division does,
// and StampTrace clamps each entry of a device's trace to at least its
// predecessor.
//
// # Steps and their notification
//
// A step is only seen in the calibrations after it. The StepDetector
// (timerfd with TFD_TIMER_CANCEL_ON_SET on CLOCK_REALTIME on Linux) wakes
// the moment the wall clock is set; Tracker.StepNoticed then calibrates at
// once and records the calibration at the monotonic time of the
// notification, marked Step. The step is thereby placed at most the
// notification latency L after it happened (tens to hundreds of µs here).
// Events in that window are converted on the pre-step timeline: as
// accurately as any other event with respect to it, but off by the step's
// size from the stepped wall clock. All other events are on their own
// side's timeline.
//
// # Worst-case error
//
// Of an event in a run, against the realtime at which it happened:
//
//   - calibration: the ErrorNs of the calibrations used (half a bracket of
//     five clock reads through the vDSO: about 55 ns on this x86 VM);
//   - between calibrations Δ apart: for smooth drift, the change of
//     curvature over Δ times Δ²/8 (without usable curvature, the offset's
//     second derivative times Δ²/8: 7.9 µs at Δ = 1 min for a drift
//     swinging 400 ppm over 10 h); a rate jump too small to locate, at most
//     0.1 ppm·Δ/4 (1.5 µs at Δ = 1 min); a located kink, a few calibration
//     errors (µs if the drift's curvature changes fast as well);
//   - towards a step or past the last calibration, over τ: the error of the
//     run's end rate and curvature times τ (a few calibration errors for
//     smooth drift); a kink in the run's last two intervals is not located
//     and costs up to its rate jump times τ;
//   - between a step and its notification: the step's size, during at most
//     L. Without a detector, until the next calibration, and a step smaller
//     than MaxRatePPM·Δ (60 ms for one-minute calibrations) is spread over
//     its interval instead: an error up to its size;
//   - the µs truncation, [0, 1) µs, and StampTrace's clamp.
//
// On Linux CLOCK_REALTIME and CLOCK_MONOTONIC are slewed together by NTP,
// so between steps their offset is constant and the error is the
// calibration error. The drift, slew and kink handling matters for the CPU
// counter, which CLOCK_MONOTONIC is slewed against, and for other sources.
//
// # CPU counter
//
// Counter timestamps (the torch_npu profiler's, the approximate-clock ticks
// a torch_npu snapshot may carry) are mapped to monotonic time through the
// calibrations' counter readings by the same rule, with rates relative to
// the median counter frequency; there a step is a counter that does not
// advance or whose rate moves more than 10% from the previous interval's
// (CLOCK_MONOTONIC may be slewed by up to 10% through adjtimex's tick). A
// counter reading is converted on the latest run starting at or before it
// (if the counter went backwards, on the run whose range is nearest). Then
// monotonic → unix as above. CounterFrequency is ticks per monotonic
// nanosecond between the first and last calibrations of the latest counter
// run.
//
// Invariants:
//   - Conversion is pure arithmetic over recorded calibrations: no clock is
//     read while converting, so tests inject any history they like. Clocks
//     are read only through Source / CounterSource, and steps are learnt
//     only through a StepDetector.
//   - StampTrace output never decreases along a trace (torch's per-device
//     guarantee), whatever the calibrations did.
package clock

import (
	"sort"
	"sync"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// MaxRatePPM is the largest rate, in ppm, at which the realtime−monotonic
// offset is taken to drift or slew; a faster change between two
// calibrations is a step.
const MaxRatePPM = 1000

// counterMaxRate is the same for counter→monotonic: CLOCK_MONOTONIC may be
// slewed against the hardware by ±10% (adjtimex tick) plus 500 ppm.
const counterMaxRate = 0.1

// Source reads the two clocks a calibration pairs. Tests inject their own.
type Source interface {
	Monotonic() int64 // CLOCK_MONOTONIC, nanoseconds
	Realtime() int64  // CLOCK_REALTIME, nanoseconds since the unix epoch
}

// CounterSource is a Source that can also read a CPU counter (the TSC,
// CNTVCT_EL0). CalibrateMedian pairs it when the source implements this.
type CounterSource interface {
	Source
	// Counter reads the counter in ticks; ok is false when there is none.
	Counter() (ticks int64, ok bool)
}

// ClockNames names the clocks a source reads, for metadata.
type ClockNames struct {
	Event     string // the clock events are stamped with
	Reference string // the wall clock calibrated against
	Counter   string // the CPU counter, "" if none
}

// Calibration is one pairing of the monotonic and realtime clocks (and of
// the CPU counter, when HasCounter).
type Calibration struct {
	MonoNs int64 // monotonic time of the pairing (bracket midpoint)
	RealNs int64 // realtime read inside the bracket
	// ErrorNs bounds how far RealNs may be from the realtime at MonoNs,
	// and Counter from the counter at MonoNs (in time): half the bracket's
	// width.
	ErrorNs int64

	// Counter is the CPU counter at MonoNs (midpoint of two reads inside
	// the bracket), valid when HasCounter.
	Counter    int64
	HasCounter bool
	// Step marks a calibration made on a wall-clock step notification:
	// the interval ending here holds a step, whatever its size.
	Step bool
}

// OffsetNs is realtime minus monotonic.
func (c Calibration) OffsetNs() int64 { return c.RealNs - c.MonoNs }

// Calibrate pairs the clocks tries times, each reading realtime between two
// monotonic readings, and keeps the tightest bracket: the one least disturbed
// by preemption or a slow clock read. It reads no counter; CalibrateMedian
// is the calibration the agent uses.
func Calibrate(src Source, tries int) Calibration {
	if tries < 1 {
		tries = 1
	}
	var best Calibration
	bestWidth := int64(-1)
	for i := 0; i < tries; i++ {
		m0 := src.Monotonic()
		r := src.Realtime()
		m1 := src.Monotonic()
		w := m1 - m0
		if bestWidth < 0 || w < bestWidth {
			bestWidth = w
			best = Calibration{MonoNs: m0 + w/2, RealNs: r, ErrorNs: (w + 1) / 2}
		}
	}
	return best
}

// Converter converts monotonic nanoseconds (and CPU counter ticks) to unix
// time with the rule of the package documentation. It is safe for
// concurrent use.
type Converter struct {
	mu   sync.RWMutex
	cals []Calibration // sorted by MonoNs; equal MonoNs in order of Add

	real     curve   // MonoNs → RealNs
	ctr      curve   // Counter → MonoNs, over calibrations with counters
	ctrOK    bool    // ctr has at least two points
	freq     float64 // counter ticks per monotonic ns, 0 if unknown
	notified int     // calibrations marked Step
}

// NewConverter returns a converter starting from first.
func NewConverter(first Calibration) *Converter {
	c := &Converter{cals: []Calibration{first}}
	c.rebuild()
	return c
}

// Add records a new calibration.
func (c *Converter) Add(cal Calibration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := sort.Search(len(c.cals), func(i int) bool { return c.cals[i].MonoNs > cal.MonoNs })
	c.cals = append(c.cals, Calibration{})
	copy(c.cals[i+1:], c.cals[i:])
	c.cals[i] = cal
	c.rebuild()
}

// rebuild derives both curves from cals. Called with the write lock held.
func (c *Converter) rebuild() {
	c.real.nominal, c.real.maxRate = 1, MaxRatePPM*1e-6
	c.real.pts = c.real.pts[:0]
	c.ctr.pts = c.ctr.pts[:0]
	c.notified = 0
	for _, k := range c.cals {
		c.real.pts = append(c.real.pts, cpoint{x: k.MonoNs, y: k.RealNs, err: k.ErrorNs, step: k.Step})
		if k.HasCounter {
			c.ctr.pts = append(c.ctr.pts, cpoint{x: k.Counter, y: k.MonoNs, err: k.ErrorNs})
		}
		if k.Step {
			c.notified++
		}
	}
	c.real.build()

	// The counter's nominal rate (ns per tick) is the median over the
	// intervals where both clocks advanced: robust to a few counter steps.
	c.ctrOK, c.freq = false, 0
	var rates []float64
	for j := 0; j+1 < len(c.ctr.pts); j++ {
		p, q := c.ctr.pts[j], c.ctr.pts[j+1]
		if q.x > p.x && q.y > p.y {
			rates = append(rates, float64(q.y-p.y)/float64(q.x-p.x))
		}
	}
	if len(rates) == 0 {
		return
	}
	sort.Float64s(rates)
	c.ctr.nominal = rates[(len(rates)-1)/2]
	c.ctr.maxRate = counterMaxRate
	c.ctr.adaptiveRef = true
	c.ctr.build()
	c.ctrOK = true
	last := c.ctr.runs[len(c.ctr.runs)-1]
	if p, q := c.ctr.pts[last.first], c.ctr.pts[last.last]; last.last > last.first {
		c.freq = float64(q.x-p.x) / float64(q.y-p.y)
	} else {
		c.freq = 1 / c.ctr.nominal
	}
}

// Latest returns the most recent calibration.
func (c *Converter) Latest() Calibration {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.cals[len(c.cals)-1]
}

// Calibrations returns a copy of the history, sorted by MonoNs.
func (c *Converter) Calibrations() []Calibration {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return append([]Calibration(nil), c.cals...)
}

// UnixNanos converts a monotonic timestamp to unix nanoseconds.
func (c *Converter) UnixNanos(monoNs int64) int64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.real.eval(monoNs)
}

// UnixMicros converts a monotonic timestamp to unix microseconds, truncating
// as torch does.
func (c *Converter) UnixMicros(monoNs int64) int64 {
	return floorDiv(c.UnixNanos(monoNs), 1000)
}

// CounterFrequency returns the CPU counter's frequency in ticks per
// monotonic nanosecond, estimated over the latest run of calibrations with
// counter readings; ok is false until two such calibrations exist.
func (c *Converter) CounterFrequency() (ticksPerNs float64, ok bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.freq, c.ctrOK
}

// CounterToMono converts a CPU counter reading to CLOCK_MONOTONIC
// nanoseconds; ok is false until two calibrations with counter readings
// exist.
func (c *Converter) CounterToMono(ticks int64) (monoNs int64, ok bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if !c.ctrOK {
		return 0, false
	}
	return c.ctr.eval(ticks), true
}

// CounterToUnixNanos converts a CPU counter reading to unix nanoseconds:
// counter → monotonic → unix.
func (c *Converter) CounterToUnixNanos(ticks int64) (unixNs int64, ok bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if !c.ctrOK {
		return 0, false
	}
	return c.real.eval(c.ctr.eval(ticks)), true
}

// CounterToUnixMicros is CounterToUnixNanos truncated to microseconds.
func (c *Converter) CounterToUnixMicros(ticks int64) (unixUs int64, ok bool) {
	ns, ok := c.CounterToUnixNanos(ticks)
	return floorDiv(ns, 1000), ok
}

// StampTrace sets TimeUs on every entry of one device's trace (oldest
// first) and keeps it from ever decreasing: events stamped on different
// CPUs, or a clock step between calibrations, must not make time run
// backwards within one device's list.
func (c *Converter) StampTrace(entries []allocmodel.TraceEntry) {
	st := c.NewStamper()
	for i := range entries {
		entries[i].TimeUs = st.Stamp(entries[i].MonoNs)
	}
}

// Stamper converts one trace's timestamps in trace order, keeping them from
// ever decreasing: StampTrace one entry at a time, for a writer that
// streams entries rather than holding a copy of the trace.
type Stamper struct {
	c       *Converter
	prev    int64
	started bool
}

// NewStamper returns a Stamper for one trace.
func (c *Converter) NewStamper() *Stamper { return &Stamper{c: c} }

// Stamp returns the unix-microsecond time of the trace's next entry.
func (s *Stamper) Stamp(monoNs int64) int64 {
	s.c.mu.RLock()
	t := floorDiv(s.c.real.eval(monoNs), 1000)
	s.c.mu.RUnlock()
	if s.started && t < s.prev {
		t = s.prev
	}
	s.prev, s.started = t, true
	return t
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}
