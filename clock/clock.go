// Package clock puts npuprobe's event timestamps on the unix timeline.
//
// BPF programs stamp events with CLOCK_MONOTONIC (no BPF helper reads
// CLOCK_REALTIME). Snapshots need unix microseconds. A Calibration pairs one
// monotonic reading with one realtime reading; a Converter keeps the history
// of calibrations and converts each event with the calibration that was in
// force when the event happened, so a later wall-clock step never moves
// events recorded before it.
//
// Invariants:
//   - Conversion is pure arithmetic over recorded calibrations: no clock is
//     read while converting, so tests inject any history they like.
//   - StampTrace output never decreases along a trace (torch's per-device
//     guarantee), whatever the calibrations did.
package clock

import (
	"sort"
	"sync"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// Source reads the two clocks a calibration pairs. Tests inject their own.
type Source interface {
	Monotonic() int64 // CLOCK_MONOTONIC, nanoseconds
	Realtime() int64  // CLOCK_REALTIME, nanoseconds since the unix epoch
}

// Calibration is one pairing of the monotonic and realtime clocks.
type Calibration struct {
	MonoNs int64 // monotonic time of the pairing (bracket midpoint)
	RealNs int64 // realtime read inside the bracket
	// ErrorNs bounds how far RealNs may be from the realtime at MonoNs:
	// half the bracket's width.
	ErrorNs int64
}

// OffsetNs is realtime minus monotonic.
func (c Calibration) OffsetNs() int64 { return c.RealNs - c.MonoNs }

// Calibrate pairs the clocks tries times, each reading realtime between two
// monotonic readings, and keeps the tightest bracket: the one least disturbed
// by preemption or a slow clock read.
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

// Converter converts monotonic nanoseconds to unix microseconds. It is safe
// for concurrent use.
type Converter struct {
	mu   sync.RWMutex
	cals []Calibration // sorted by MonoNs
}

// NewConverter returns a converter starting from first.
func NewConverter(first Calibration) *Converter {
	return &Converter{cals: []Calibration{first}}
}

// Add records a new calibration.
func (c *Converter) Add(cal Calibration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := sort.Search(len(c.cals), func(i int) bool { return c.cals[i].MonoNs > cal.MonoNs })
	c.cals = append(c.cals, Calibration{})
	copy(c.cals[i+1:], c.cals[i:])
	c.cals[i] = cal
}

// Latest returns the most recent calibration.
func (c *Converter) Latest() Calibration {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.cals[len(c.cals)-1]
}

// inForce returns the calibration in force at monoNs: the latest one made
// at or before it, or the first one for events older than every calibration.
func (c *Converter) inForce(monoNs int64) Calibration {
	i := sort.Search(len(c.cals), func(i int) bool { return c.cals[i].MonoNs > monoNs })
	if i == 0 {
		return c.cals[0]
	}
	return c.cals[i-1]
}

// UnixNanos converts a monotonic timestamp to unix nanoseconds.
func (c *Converter) UnixNanos(monoNs int64) int64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return monoNs + c.inForce(monoNs).OffsetNs()
}

// UnixMicros converts a monotonic timestamp to unix microseconds, truncating
// as torch does.
func (c *Converter) UnixMicros(monoNs int64) int64 {
	return floorDiv(c.UnixNanos(monoNs), 1000)
}

// StampTrace sets TimeUs on every entry of one device's trace (oldest
// first) and keeps it from ever decreasing: events stamped on different
// CPUs, or a clock step between calibrations, must not make time run
// backwards within one device's list.
func (c *Converter) StampTrace(entries []allocmodel.TraceEntry) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	var prev int64
	for i := range entries {
		t := floorDiv(entries[i].MonoNs+c.inForce(entries[i].MonoNs).OffsetNs(), 1000)
		if i > 0 && t < prev {
			t = prev
		}
		entries[i].TimeUs = t
		prev = t
	}
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}
