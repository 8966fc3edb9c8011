package clock_test

import (
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/clock"
)

// fakeSource replays scripted readings. Calibrate reads monotonic, realtime,
// monotonic per try, so each try is one bracket {m0, r, m1}.
type fakeSource struct {
	t     *testing.T
	mono  []int64
	real  []int64
	calls []string
}

func newFakeSource(t *testing.T, brackets [][3]int64) *fakeSource {
	s := &fakeSource{t: t}
	for _, b := range brackets {
		s.mono = append(s.mono, b[0], b[2])
		s.real = append(s.real, b[1])
	}
	return s
}

func (s *fakeSource) Monotonic() int64 {
	s.calls = append(s.calls, "m")
	if len(s.mono) == 0 {
		s.t.Fatal("unscripted Monotonic read")
	}
	v := s.mono[0]
	s.mono = s.mono[1:]
	return v
}

func (s *fakeSource) Realtime() int64 {
	s.calls = append(s.calls, "r")
	if len(s.real) == 0 {
		s.t.Fatal("unscripted Realtime read")
	}
	v := s.real[0]
	s.real = s.real[1:]
	return v
}

func TestCalibrate(t *testing.T) {
	tests := []struct {
		name     string
		tries    int
		brackets [][3]int64 // {mono before, realtime, mono after}
		want     clock.Calibration
	}{
		{
			name:     "one try, even width",
			tries:    1,
			brackets: [][3]int64{{1000, 5_000_000, 1100}},
			want:     clock.Calibration{MonoNs: 1050, RealNs: 5_000_000, ErrorNs: 50},
		},
		{
			name:     "odd width: midpoint rounds down, error rounds up",
			tries:    1,
			brackets: [][3]int64{{1000, 5_000_000, 1007}},
			want:     clock.Calibration{MonoNs: 1003, RealNs: 5_000_000, ErrorNs: 4},
		},
		{
			name:     "zero width",
			tries:    1,
			brackets: [][3]int64{{1000, 5_000_000, 1000}},
			want:     clock.Calibration{MonoNs: 1000, RealNs: 5_000_000, ErrorNs: 0},
		},
		{
			name:  "tightest bracket in the middle",
			tries: 3,
			brackets: [][3]int64{
				{1000, 7_000_000, 1400},
				{2000, 7_001_100, 2040},
				{3000, 7_002_000, 3300},
			},
			want: clock.Calibration{MonoNs: 2020, RealNs: 7_001_100, ErrorNs: 20},
		},
		{
			name:  "tightest bracket last",
			tries: 4,
			brackets: [][3]int64{
				{1000, 7_000_000, 1400},
				{2000, 7_001_100, 2040},
				{3000, 7_002_000, 3300},
				{4000, 7_003_000, 4010},
			},
			want: clock.Calibration{MonoNs: 4005, RealNs: 7_003_000, ErrorNs: 5},
		},
		{
			name:  "ties keep the first",
			tries: 3,
			brackets: [][3]int64{
				{1000, 7_000_000, 1030},
				{2000, 7_001_000, 2030},
				{3000, 7_002_000, 3100},
			},
			want: clock.Calibration{MonoNs: 1015, RealNs: 7_000_000, ErrorNs: 15},
		},
		{
			name:     "tries below 1 mean 1",
			tries:    0,
			brackets: [][3]int64{{1000, 5_000_000, 1100}},
			want:     clock.Calibration{MonoNs: 1050, RealNs: 5_000_000, ErrorNs: 50},
		},
		{
			name:     "negative tries mean 1",
			tries:    -4,
			brackets: [][3]int64{{-100, -5_000_000, 100}},
			want:     clock.Calibration{MonoNs: 0, RealNs: -5_000_000, ErrorNs: 100},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src := newFakeSource(t, tt.brackets)
			got := clock.Calibrate(src, tt.tries)
			if got != tt.want {
				t.Errorf("Calibrate = %+v, want %+v", got, tt.want)
			}
			if len(src.mono) != 0 || len(src.real) != 0 {
				t.Errorf("readings left unread: mono %v, real %v", src.mono, src.real)
			}
			// Each try is monotonic, realtime, monotonic, in that order.
			var wantCalls []string
			for range tt.brackets {
				wantCalls = append(wantCalls, "m", "r", "m")
			}
			if !reflect.DeepEqual(src.calls, wantCalls) {
				t.Errorf("read order %v, want %v", src.calls, wantCalls)
			}
		})
	}
}

func TestCalibrationOffset(t *testing.T) {
	c := clock.Calibration{MonoNs: 1_000, RealNs: 1_767_225_600_000_000_000}
	if got := c.OffsetNs(); got != 1_767_225_599_999_999_000 {
		t.Errorf("OffsetNs = %d", got)
	}
}

const (
	jan2026 = int64(1_767_225_600_000_000_000) // 2026-01-01T00:00:00Z, ns
	sec     = int64(time.Second)
)

// cal returns a calibration at mono whose realtime is mono+offset.
func cal(mono, offset int64) clock.Calibration {
	return clock.Calibration{MonoNs: mono, RealNs: mono + offset}
}

func TestConverterCalibrationInForce(t *testing.T) {
	// Three calibrations with distinct offsets, added out of order.
	c1 := cal(100*sec, jan2026)        // offset jan2026
	c2 := cal(200*sec, jan2026+5*sec)  // clock stepped forward 5 s
	c3 := cal(300*sec, jan2026-10*sec) // then back 15 s
	conv := clock.NewConverter(c2)
	conv.Add(c3)
	conv.Add(c1)
	if got := conv.Latest(); got != c3 {
		t.Errorf("Latest = %+v, want %+v", got, c3)
	}
	tests := []struct {
		mono int64
		want int64 // unix ns
	}{
		{0, jan2026},                         // before every calibration: the first
		{-50 * sec, jan2026 - 50*sec},        // negative monotonic values too
		{100*sec - 1, jan2026 + 100*sec - 1}, // just before c1: still c1
		{100 * sec, jan2026 + 100*sec},       // exactly at c1
		{200*sec - 1, jan2026 + 200*sec - 1}, // c1
		{200 * sec, jan2026 + 205*sec},       // at c2: c2 is in force
		{250 * sec, jan2026 + 255*sec},       // c2
		{300*sec - 1, jan2026 + 305*sec - 1}, // c2
		{300 * sec, jan2026 + 290*sec},       // c3
		{1000 * sec, jan2026 + 990*sec},      // after the last: the last
	}
	for _, tt := range tests {
		if got := conv.UnixNanos(tt.mono); got != tt.want {
			t.Errorf("UnixNanos(%d) = %d, want %d (off by %d)", tt.mono, got, tt.want, got-tt.want)
		}
		if got, want := conv.UnixMicros(tt.mono), tt.want/1000; got != want {
			t.Errorf("UnixMicros(%d) = %d, want %d", tt.mono, got, want)
		}
	}
}

// TestConverterAddOutOfOrder adds calibrations in scrambled orders and checks
// the history stays sorted by MonoNs.
func TestConverterAddOutOfOrder(t *testing.T) {
	orders := [][]int64{
		{5, 4, 3, 2, 1},
		{1, 2, 3, 4, 5},
		{3, 1, 5, 2, 4},
		{2, 5, 1, 4, 3},
	}
	// Calibration m is at m s with offset m s: every neighbour pair differs
	// by a wall-clock step, so each offset holds until the next calibration.
	offset := func(m int64) int64 { return m * sec }
	for _, order := range orders {
		conv := clock.NewConverter(cal(order[0]*sec, offset(order[0])))
		for _, m := range order[1:] {
			conv.Add(cal(m*sec, offset(m)))
		}
		// Before every calibration: the earliest (offset 1 s), not the first added.
		if got := conv.UnixNanos(0); got != offset(1) {
			t.Errorf("order %v: UnixNanos(0) = %d, want %d", order, got, offset(1))
		}
		for m := int64(1); m <= 5; m++ {
			for _, at := range []int64{m * sec, m*sec + sec/2, m*sec + sec - 1} {
				if got, want := conv.UnixNanos(at), at+offset(m); got != want {
					t.Errorf("order %v: UnixNanos(%d) = %d, want %d (offset of calibration %d)", order, at, got, want, m)
				}
			}
		}
		if got := conv.Latest(); got.MonoNs != 5*sec {
			t.Errorf("order %v: Latest at %d", order, got.MonoNs)
		}
	}
}

// TestConverterEqualMonoLaterAddWins: a calibration added at the same
// monotonic time as an earlier one takes over from that time.
func TestConverterEqualMonoLaterAddWins(t *testing.T) {
	conv := clock.NewConverter(cal(10, 1000))
	conv.Add(cal(10, 2000))
	if got := conv.UnixNanos(10); got != 2010 {
		t.Errorf("UnixNanos(10) = %d, want 2010", got)
	}
	if got := conv.UnixNanos(9); got != 1009 {
		// Before both: the first in the sorted history.
		t.Errorf("UnixNanos(9) = %d, want 1009", got)
	}
}

func TestUnixMicrosFloor(t *testing.T) {
	tests := []struct {
		unixNs int64
		want   int64
	}{
		{0, 0},
		{1, 0},
		{999, 0},
		{1000, 1},
		{1999, 1},
		{-1, -1},
		{-999, -1},
		{-1000, -1},
		{-1001, -2},
		{-1999, -2},
		{-2000, -2},
		{jan2026 + 123_456_789, 1_767_225_600_123_456},
		{-jan2026 - 1, -1_767_225_600_000_001},
	}
	for _, tt := range tests {
		// Offset 0 calibration: unix ns == mono ns.
		conv := clock.NewConverter(clock.Calibration{})
		if got := conv.UnixMicros(tt.unixNs); got != tt.want {
			t.Errorf("UnixMicros(%d) = %d, want %d", tt.unixNs, got, tt.want)
		}
		// Through an offset that makes the monotonic value positive.
		conv = clock.NewConverter(cal(0, -jan2026))
		if got := conv.UnixMicros(tt.unixNs + jan2026); got != tt.want {
			t.Errorf("UnixMicros with offset (%d) = %d, want %d", tt.unixNs, got, tt.want)
		}
	}
}

func traceAt(monos ...int64) []allocmodel.TraceEntry {
	out := make([]allocmodel.TraceEntry, len(monos))
	for i, m := range monos {
		out[i] = allocmodel.TraceEntry{MonoNs: m, Addr: uint64(i), Action: allocmodel.ActionSegmentAlloc}
	}
	return out
}

func timesOf(es []allocmodel.TraceEntry) []int64 {
	out := make([]int64, len(es))
	for i, e := range es {
		out[i] = e.TimeUs
	}
	return out
}

func TestStampTrace(t *testing.T) {
	us := jan2026 / 1000
	tests := []struct {
		name  string
		cals  []clock.Calibration
		monos []int64
		want  []int64
	}{
		{
			name:  "empty",
			cals:  []clock.Calibration{cal(0, jan2026)},
			monos: nil,
			want:  []int64{},
		},
		{
			name:  "one calibration, truncated to µs",
			cals:  []clock.Calibration{cal(0, jan2026)},
			monos: []int64{0, 999, 1000, 12_345, 12_999},
			want:  []int64{us, us, us + 1, us + 12, us + 12},
		},
		{
			name:  "backwards step between calibrations is clamped",
			cals:  []clock.Calibration{cal(0, jan2026), cal(10*sec, jan2026-3*sec)},
			monos: []int64{5 * sec, 10*sec - 1000, 10 * sec, 11 * sec, 12 * sec, 13*sec + 5000, 20 * sec},
			want: []int64{
				us + 5_000_000,
				us + 9_999_999,
				us + 9_999_999, // would be us+7 s
				us + 9_999_999, // would be us+8 s
				us + 9_999_999, // would be us+9 s
				us + 10_000_005,
				us + 17_000_000,
			},
		},
		{
			name:  "forward step is kept",
			cals:  []clock.Calibration{cal(0, jan2026), cal(10*sec, jan2026+3*sec)},
			monos: []int64{9 * sec, 10 * sec},
			want:  []int64{us + 9_000_000, us + 13_000_000},
		},
		{
			name:  "out-of-order stamps (cross-CPU skew) are clamped",
			cals:  []clock.Calibration{cal(0, jan2026)},
			monos: []int64{5000, 4000, 6000, 5999, 7000},
			want:  []int64{us + 5, us + 5, us + 6, us + 6, us + 7},
		},
		{
			name:  "negative unix times clamp too",
			cals:  []clock.Calibration{cal(0, -10*sec)},
			monos: []int64{1, 2000, 1500},
			want:  []int64{-10_000_000, -9_999_998, -9_999_998},
		},
		{
			name:  "first entry is not clamped to zero",
			cals:  []clock.Calibration{cal(0, -10*sec)},
			monos: []int64{0},
			want:  []int64{-10_000_000},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conv := clock.NewConverter(tt.cals[0])
			for _, c := range tt.cals[1:] {
				conv.Add(c)
			}
			tr := traceAt(tt.monos...)
			conv.StampTrace(tr)
			if got := timesOf(tr); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("TimeUs = %v, want %v", got, tt.want)
			}
			for i := 1; i < len(tr); i++ {
				if tr[i].TimeUs < tr[i-1].TimeUs {
					t.Errorf("TimeUs decreases at %d: %d < %d", i, tr[i].TimeUs, tr[i-1].TimeUs)
				}
			}
			// Nothing but TimeUs changes.
			for i, e := range tr {
				if e.MonoNs != tt.monos[i] || e.Addr != uint64(i) || e.Action != allocmodel.ActionSegmentAlloc {
					t.Errorf("entry %d changed: %+v", i, e)
				}
			}
		})
	}
}

// TestStampTraceOverwritesTimes: stamping an already-stamped copy again
// gives the same times, whatever TimeUs held before.
func TestStampTraceOverwritesTimes(t *testing.T) {
	conv := clock.NewConverter(cal(0, jan2026))
	tr := traceAt(1000, 2000)
	tr[0].TimeUs = 1 << 60
	tr[1].TimeUs = -5
	conv.StampTrace(tr)
	if got, want := timesOf(tr), []int64{jan2026/1000 + 1, jan2026/1000 + 2}; !reflect.DeepEqual(got, want) {
		t.Errorf("TimeUs = %v, want %v", got, want)
	}
}

// TestConverterConcurrent exercises the lock: conversions racing with Adds
// must always see a consistent, sorted history (run with -race too).
func TestConverterConcurrent(t *testing.T) {
	conv := clock.NewConverter(cal(0, jan2026))
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := int64(1); i <= 2000; i++ {
			conv.Add(cal(i*1000, jan2026)) // same offset: results never change
		}
	}()
	go func() {
		defer wg.Done()
		for i := int64(0); i < 2000; i++ {
			if got := conv.UnixNanos(i * 997); got != jan2026+i*997 {
				t.Errorf("UnixNanos(%d) = %d", i*997, got)
				return
			}
			tr := traceAt(i, i+1000)
			conv.StampTrace(tr)
		}
	}()
	wg.Wait()
	if got := conv.Latest(); got != cal(2000*1000, jan2026) {
		t.Errorf("Latest = %+v after the adds", got)
	}
}

// TestSystem checks the real clocks against Go's wall clock.
func TestSystem(t *testing.T) {
	var src clock.System
	m0 := src.Monotonic()
	m1 := src.Monotonic()
	if m1 < m0 {
		t.Fatalf("CLOCK_MONOTONIC went backwards: %d then %d", m0, m1)
	}
	conv := clock.NewConverter(clock.Calibrate(src, 21))
	cal := conv.Latest()
	if cal.ErrorNs < 0 || cal.ErrorNs > int64(time.Millisecond) {
		t.Errorf("calibration error %d ns, want within [0, 1 ms]", cal.ErrorNs)
	}
	for i := 0; i < 5; i++ {
		before := time.Now().UnixMicro()
		got := conv.UnixMicros(src.Monotonic())
		after := time.Now().UnixMicro()
		if got < before-1000 || got > after+1000 {
			t.Errorf("UnixMicros(now) = %d, time.Now between %d and %d µs (more than 1 ms apart)", got, before, after)
		}
	}
	if r := src.Realtime(); abs(r-time.Now().UnixNano()) > int64(time.Millisecond) {
		t.Errorf("Realtime() = %d, time.Now() = %d", r, time.Now().UnixNano())
	}
}

func abs(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}
