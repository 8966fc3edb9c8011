package clock

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// timerfdDetector is a timerfd on CLOCK_REALTIME armed with an absolute
// expiry far in the future and TFD_TIMER_CANCEL_ON_SET: whenever the wall
// clock is set (clock_settime, settimeofday, adjtimex ADJ_SETOFFSET, a leap
// second), the kernel cancels it and a read returns ECANCELED, once per
// change; the timer stays armed for the next one.
type timerfdDetector struct {
	f *os.File
}

// NewStepDetector returns a StepDetector for this machine's wall clock.
func NewStepDetector() (StepDetector, error) {
	fd, err := unix.TimerfdCreate(unix.CLOCK_REALTIME, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("timerfd_create(CLOCK_REALTIME): %w", err)
	}
	// Expire in ~35,000 years (the kernel saturates it): only
	// cancellations ever wake a reader.
	spec := unix.ItimerSpec{Value: unix.Timespec{Sec: 1 << 40}}
	if err := unix.TimerfdSettime(fd, unix.TFD_TIMER_ABSTIME|unix.TFD_TIMER_CANCEL_ON_SET, &spec, nil); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("timerfd_settime(TFD_TIMER_CANCEL_ON_SET): %w", err)
	}
	// Non-blocking, so reads wait in the runtime's poller and Close ends
	// them.
	return &timerfdDetector{f: os.NewFile(uintptr(fd), "timerfd(CLOCK_REALTIME)")}, nil
}

func (d *timerfdDetector) Wait() error {
	var buf [8]byte
	for {
		_, err := d.f.Read(buf[:])
		switch {
		case err == nil:
			// The far-future expiry passed (the clock was set beyond
			// it, which also cancels): keep waiting.
		case errors.Is(err, unix.ECANCELED):
			return nil
		default:
			return err
		}
	}
}

func (d *timerfdDetector) Close() error { return d.f.Close() }
