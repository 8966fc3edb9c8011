package clock

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestSystemMonotonicIsClockMonotonic: System.Monotonic reads the same
// clock as clock_gettime(CLOCK_MONOTONIC) (which bpf_ktime_get_ns reads).
func TestSystemMonotonicIsClockMonotonic(t *testing.T) {
	var s System
	for _, id := range []int32{unix.CLOCK_MONOTONIC, unix.CLOCK_REALTIME} {
		read := s.Monotonic
		if id == unix.CLOCK_REALTIME {
			read = s.Realtime
		}
		var worst int64
		for i := 0; i < 100; i++ {
			a := read()
			var ts unix.Timespec
			if err := unix.ClockGettime(id, &ts); err != nil {
				t.Fatal(err)
			}
			b := read()
			if v := ts.Nano(); v < a || v > b {
				t.Errorf("clock %d: clock_gettime gave %d, outside [%d, %d] read around it", id, v, a, b)
			}
			worst = max(worst, b-a)
		}
		t.Logf("clock %d: bracket around a clock_gettime system call up to %d ns", id, worst)
	}
}

func TestSystemClocksMetadata(t *testing.T) {
	tr := NewTracker(System{}, 101)
	time.Sleep(10 * time.Millisecond)
	tr.Recalibrate()
	md := tr.Metadata()
	if md.Clocks.Event != "CLOCK_MONOTONIC (bpf_ktime_get_ns)" || md.Clocks.Reference != "CLOCK_REALTIME" {
		t.Errorf("clocks %+v", md.Clocks)
	}
	if _, ok := (System{}).Counter(); ok != (md.Clocks.Counter != "") || ok != (md.CounterTicksPerNs > 0) {
		t.Errorf("counter %q at %v ticks/ns, counter available %v", md.Clocks.Counter, md.CounterTicksPerNs, ok)
	}
	for _, f := range md.Fields() {
		t.Logf("%s: %v", f.Key, f.Value)
	}
}
