package clock

import (
	"errors"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// TestStepDetectorRealClock really steps this machine's wall clock: 1 s
// forward, then back to where it belongs, and checks that the timerfd
// detector reports both steps at once and that a Tracker watching another
// detector places both steps at their notifications. The clock is restored
// from CLOCK_MONOTONIC and the offset measured before the test (the offset
// is constant here: nothing else sets the clock), whatever happens.
func TestStepDetectorRealClock(t *testing.T) {
	// Setting the machine's clock would disturb every other test running
	// at the same time (go test runs packages in parallel), so tests/run
	// runs this test on its own, with the variable set.
	if os.Getenv("NPUPROBE_TEST_SET_CLOCK") != "1" {
		t.Skip("moves the wall clock: run alone with NPUPROBE_TEST_SET_CLOCK=1 (tests/run does)")
	}
	var src System
	base := CalibrateMedian(src, DefaultPairs)
	restore := func() error {
		ts := unix.NsecToTimespec(src.Monotonic() + base.OffsetNs())
		return unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
	}
	// Setting the clock to where it already is tells whether we may.
	if err := restore(); err != nil {
		if errors.Is(err, unix.EPERM) {
			t.Skipf("cannot set CLOCK_REALTIME (%v): run as root / with CAP_SYS_TIME to test step detection", err)
		}
		t.Fatalf("clock_settime: %v", err)
	}
	// After the test (detectors closed), put the clock back precisely:
	// clock_settime lands a little after monotonic was read, so correct
	// the residual it leaves.
	stepped := false
	t.Cleanup(func() {
		if !stepped {
			return
		}
		adj, res := int64(0), int64(0)
		for i := 0; i < 6; i++ {
			ts := unix.NsecToTimespec(src.Monotonic() + base.OffsetNs() + adj)
			if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
				t.Errorf("RESTORING THE WALL CLOCK FAILED: %v", err)
				return
			}
			res = CalibrateMedian(src, DefaultPairs).OffsetNs() - base.OffsetNs()
			if res >= -500 && res <= 500 {
				break
			}
			adj -= res
		}
		t.Logf("wall clock restored to %+d ns of its offset before the test", res)
		if res < -int64(time.Millisecond) || res > int64(time.Millisecond) {
			t.Errorf("wall clock not restored: %+d ns off", res)
		}
	})

	det, err := NewStepDetector()
	if err != nil {
		t.Fatal(err)
	}
	notes := make(chan int64, 8)
	waitDone := make(chan struct{})
	go func() {
		defer close(waitDone)
		for det.Wait() == nil {
			notes <- src.Monotonic()
		}
	}()
	defer func() { det.Close(); <-waitDone }()

	tr := NewTracker(src, DefaultPairs)
	conv := tr.Converter()
	det2, err := NewStepDetector()
	if err != nil {
		t.Fatal(err)
	}
	defer tr.WatchSteps(det2)()

	// No notification without a step.
	select {
	case n := <-notes:
		t.Fatalf("notification at %d without a step", n)
	case <-time.After(50 * time.Millisecond):
	}

	waitNote := func(what string, after int64) int64 {
		t.Helper()
		select {
		case n := <-notes:
			t.Logf("%s: noticed %.1f µs after clock_settime returned", what, float64(n-after)/1e3)
			return n
		case <-time.After(2 * time.Second):
			t.Fatalf("%s: no notification within 2 s", what)
		}
		return 0
	}
	waitTracker := func(what string, want int) Calibration {
		t.Helper()
		deadline := time.Now().Add(2 * time.Second)
		for conv.Metadata().StepNotifications < want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the tracker recorded %d step calibrations, want %d", what, conv.Metadata().StepNotifications, want)
			}
			time.Sleep(time.Millisecond)
		}
		var last Calibration
		for _, c := range conv.Calibrations() {
			if c.Step {
				last = c
			}
		}
		return last
	}
	// near asserts that converting mono gives want within 10 µs.
	near := func(what string, mono, want int64) {
		t.Helper()
		if got := conv.UnixNanos(mono); absDiff(got, want) > 10_000 {
			t.Errorf("%s: UnixNanos = %d, want %d (off by %d ns)", what, got, want, got-want)
		}
	}

	// Forward by 1 s.
	const step = int64(time.Second)
	setAt := src.Monotonic()
	ts := unix.NsecToTimespec(src.Realtime() + step)
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		t.Fatalf("clock_settime forward: %v", err)
	}
	stepped = true
	setDone := src.Monotonic()
	waitNote("forward step", setDone)
	fwd := waitTracker("forward step", 1)
	// The step actually made: 1 s less the time between reading realtime
	// and the clock being set, measured independently of the tracker.
	moved := CalibrateMedian(src, DefaultPairs).OffsetNs() - base.OffsetNs()
	if moved < step-int64(time.Millisecond) || moved > step {
		t.Fatalf("wall clock moved by %d ns, want 1 s", moved)
	}
	t.Logf("forward: step calibration at +%.1f µs after clock_settime returned, error %d ns", float64(fwd.MonoNs-setDone)/1e3, fwd.ErrorNs)
	if fwd.MonoNs < setAt {
		t.Errorf("step calibration at %d, before the step was made (%d)", fwd.MonoNs, setAt)
	}
	near("before the forward step", setAt, setAt+base.OffsetNs())
	near("at the forward step's calibration", fwd.MonoNs, fwd.MonoNs+base.OffsetNs()+moved)
	m0 := src.Monotonic()
	r := src.Realtime()
	m1 := src.Monotonic()
	near("after the forward step", m0+(m1-m0)/2, r)
	between := m1

	// Back to where it belongs.
	backAt := src.Monotonic()
	if err := restore(); err != nil {
		t.Fatalf("clock_settime back: %v", err)
	}
	backDone := src.Monotonic()
	waitNote("backward step", backDone)
	back := waitTracker("backward step", 2)
	restored := CalibrateMedian(src, DefaultPairs).OffsetNs() - base.OffsetNs()
	if restored < -int64(time.Millisecond) || restored > int64(time.Millisecond) {
		t.Errorf("wall clock %d ns from where it belongs after restoring", restored)
	}
	t.Logf("stepped by %+d ns, restored to %+d ns of the original offset", moved, restored)
	t.Logf("backward: step calibration at +%.1f µs after clock_settime returned, error %d ns", float64(back.MonoNs-backDone)/1e3, back.ErrorNs)
	near("between the steps", between, between+base.OffsetNs()+moved)
	near("just before the backward step", backAt, backAt+base.OffsetNs()+moved)
	near("at the backward step's calibration", back.MonoNs, back.MonoNs+base.OffsetNs()+restored)
	m0 = src.Monotonic()
	r = src.Realtime()
	m1 = src.Monotonic()
	near("after the backward step", m0+(m1-m0)/2, r)

	md := tr.Metadata()
	if md.Steps != 2 || md.StepNotifications != 2 {
		t.Errorf("metadata: %d steps, %d notifications, want 2 and 2", md.Steps, md.StepNotifications)
	}
	// A device trace across both steps: time_us never decreases, so the
	// entries after the backward step are held at the last one before it.
	trace := []allocmodel.TraceEntry{{MonoNs: setAt}, {MonoNs: fwd.MonoNs}, {MonoNs: between}, {MonoNs: backAt}, {MonoNs: back.MonoNs}, {MonoNs: m1}}
	conv.StampTrace(trace)
	for i := 1; i < len(trace); i++ {
		if trace[i].TimeUs < trace[i-1].TimeUs {
			t.Errorf("time_us decreases at entry %d: %d after %d", i, trace[i].TimeUs, trace[i-1].TimeUs)
		}
	}
	if trace[4].TimeUs != trace[3].TimeUs {
		t.Errorf("entry after the backward step: time_us %d, want it held at %d", trace[4].TimeUs, trace[3].TimeUs)
	}
}
