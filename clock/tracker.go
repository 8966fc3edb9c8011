package clock

import (
	"fmt"
	"sync"
)

// StepDetector tells when the wall clock was set (a step). On Linux,
// NewStepDetector watches CLOCK_REALTIME with a timerfd; tests inject their
// own. The conversion logic never calls it: a Tracker turns notifications
// into calibrations.
type StepDetector interface {
	// Wait blocks until the wall clock has been set since the previous
	// Wait (or since the detector was made) and returns nil; it returns an
	// error once the detector is closed.
	Wait() error
	// Close ends a blocked Wait.
	Close() error
}

// Tracker keeps a Converter calibrated from a Source: one calibration when
// made, then Recalibrate periodically and before every snapshot, and
// StepNoticed on every step notification (WatchSteps does that for a
// StepDetector). It is safe for concurrent use; calibrations are taken one
// at a time.
type Tracker struct {
	src   Source
	pairs int
	conv  *Converter

	mu sync.Mutex // serialises calibrations
}

// NewTracker calibrates src with pairs samples (DefaultPairs if < 1) and
// returns a tracker whose converter starts from that calibration.
func NewTracker(src Source, pairs int) *Tracker {
	if pairs < 1 {
		pairs = DefaultPairs
	}
	return &Tracker{src: src, pairs: pairs, conv: NewConverter(CalibrateMedian(src, pairs))}
}

// Converter returns the converter the tracker feeds.
func (t *Tracker) Converter() *Converter { return t.conv }

// Recalibrate takes a calibration now and adds it.
func (t *Tracker) Recalibrate() Calibration {
	t.mu.Lock()
	defer t.mu.Unlock()
	cal := CalibrateMedian(t.src, t.pairs)
	t.conv.Add(cal)
	return cal
}

// StepNoticed records a wall-clock step noticed at monotonic time atMono:
// it calibrates at once and adds the calibration at atMono (the offset is
// taken as constant over the few µs in between), marked Step, so that the
// step is placed at the notification, not at the next periodic
// calibration. The calibration carries no counter reading.
func (t *Tracker) StepNoticed(atMono int64) Calibration {
	t.mu.Lock()
	defer t.mu.Unlock()
	cal := CalibrateMedian(t.src, t.pairs)
	if d := cal.MonoNs - atMono; d > 0 {
		cal.MonoNs -= d
		cal.RealNs -= d
	}
	cal.Counter, cal.HasCounter = 0, false
	cal.Step = true
	t.conv.Add(cal)
	return cal
}

// WatchSteps calls StepNoticed, with the monotonic time read as soon as d
// reports, for every step d reports, until stop is called. stop closes d
// and waits for the watcher to end.
func (t *Tracker) WatchSteps(d StepDetector) (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for d.Wait() == nil {
			t.StepNoticed(t.src.Monotonic())
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			d.Close()
			<-done
		})
	}
}

// Metadata describes the calibration for a snapshot.
type Metadata struct {
	Clocks ClockNames
	// Method says how calibrations are taken and used.
	Method string
	// Calibrations is the number of calibrations in the history.
	Calibrations int
	// LatestErrorNs and WorstErrorNs are the error bounds of the latest
	// calibration and the largest of all.
	LatestErrorNs int64
	WorstErrorNs  int64
	// Steps counts the intervals between calibrations that hold a
	// wall-clock step (notified or too large for drift and slew);
	// StepNotifications counts the notifications.
	Steps             int
	StepNotifications int
	// CounterTicksPerNs is the CPU counter's frequency (0 if unknown).
	CounterTicksPerNs float64
}

// Metadata returns what the converter knows about its calibrations; the
// clock names and method are left empty (Tracker.Metadata fills them).
func (c *Converter) Metadata() Metadata {
	c.mu.RLock()
	defer c.mu.RUnlock()
	m := Metadata{
		Calibrations:      len(c.cals),
		LatestErrorNs:     c.cals[len(c.cals)-1].ErrorNs,
		WorstErrorNs:      c.real.maxErr(),
		Steps:             c.real.steps,
		StepNotifications: c.notified,
	}
	if c.ctrOK {
		m.CounterTicksPerNs = c.freq
	}
	return m
}

// Metadata returns the converter's metadata with the source's clock names
// (if it has a Clocks() ClockNames method) and the calibration method.
func (t *Tracker) Metadata() Metadata {
	m := t.conv.Metadata()
	if n, ok := t.src.(interface{ Clocks() ClockNames }); ok {
		m.Clocks = n.Clocks()
	} else {
		m.Clocks = ClockNames{Event: "monotonic", Reference: "realtime"}
	}
	if m.CounterTicksPerNs == 0 {
		m.Clocks.Counter = ""
	}
	m.Method = fmt.Sprintf("median of %d bracketed samples per calibration; offset interpolated between calibrations, "+
		"steps placed at their notification or when the offset moves faster than %d ppm", t.pairs, MaxRatePPM)
	return m
}

// Field is one metadata entry for a snapshot.
type Field struct {
	Key   string
	Value any // string, int, int64 or float64
}

// Fields lists the metadata as snapshot entries, in a fixed order. Keys:
// event_clock, calibrated_against, counter (only with a counter),
// calibration_method, calibrations, calibration_error_ns (the latest),
// calibration_error_worst_ns, steps_detected, step_notifications,
// counter_ticks_per_ns and counter_hz (only with a counter).
func (m Metadata) Fields() []Field {
	f := []Field{
		{"event_clock", m.Clocks.Event},
		{"calibrated_against", m.Clocks.Reference},
	}
	if m.Clocks.Counter != "" {
		f = append(f, Field{"counter", m.Clocks.Counter})
	}
	f = append(f,
		Field{"calibration_method", m.Method},
		Field{"calibrations", m.Calibrations},
		Field{"calibration_error_ns", m.LatestErrorNs},
		Field{"calibration_error_worst_ns", m.WorstErrorNs},
		Field{"steps_detected", m.Steps},
		Field{"step_notifications", m.StepNotifications},
	)
	if m.CounterTicksPerNs > 0 {
		f = append(f,
			Field{"counter_ticks_per_ns", m.CounterTicksPerNs},
			Field{"counter_hz", roundNs(m.CounterTicksPerNs * 1e9)},
		)
	}
	return f
}
