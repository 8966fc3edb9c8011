package clock

import (
	"time"
	_ "unsafe" // go:linkname
)

// System reads the machine's clocks: the same CLOCK_MONOTONIC that
// bpf_ktime_get_ns() reads in the kernel, CLOCK_REALTIME, and the CPU
// counter (CounterName) where this architecture has a reader.
//
// Both clocks are read through the vDSO, as the Go runtime reads them
// (tens of ns, where the clock_gettime system call takes several hundred
// on a VM): calibration brackets are that much tighter.
type System struct{}

// Monotonic reads CLOCK_MONOTONIC.
func (System) Monotonic() int64 { return nanotime() }

// Realtime reads CLOCK_REALTIME.
func (System) Realtime() int64 { return time.Now().UnixNano() }

// nanotime is the runtime's vDSO read of CLOCK_MONOTONIC. The runtime keeps
// this linkname working for other packages (go.dev/issue/67401).
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64

// Counter reads the CPU counter: the TSC on amd64, CNTVCT_EL0 on arm64. ok
// is false on other architectures.
func (System) Counter() (ticks int64, ok bool) {
	if !counterAvailable() {
		return 0, false
	}
	return int64(readCounter()), true
}

// Clocks names the clocks System reads, for the snapshot's metadata.
func (System) Clocks() ClockNames {
	return ClockNames{
		Event:     "CLOCK_MONOTONIC (bpf_ktime_get_ns)",
		Reference: "CLOCK_REALTIME",
		Counter:   CounterName,
	}
}
