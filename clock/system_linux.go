package clock

import "golang.org/x/sys/unix"

// System reads the machine's clocks: the same CLOCK_MONOTONIC that
// bpf_ktime_get_ns() reads in the kernel, and CLOCK_REALTIME.
type System struct{}

func (System) Monotonic() int64 { return read(unix.CLOCK_MONOTONIC) }
func (System) Realtime() int64  { return read(unix.CLOCK_REALTIME) }

func read(id int32) int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(id, &ts); err != nil {
		// Both clocks exist on every Linux this runs on; failing here
		// means a broken kernel, and a wrong time would be worse than none.
		panic("clock_gettime: " + err.Error())
	}
	return ts.Nano()
}
