package clock

import (
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

// medSample is one scripted bracket: monotonic m0, counter c0, realtime r,
// counter c1, monotonic m1.
type medSample struct{ m0, c0, r, c1, m1 int64 }

// medSource replays medSamples in the order CalibrateMedian reads them and
// records that order. noCounter makes Counter report no counter.
type medSource struct {
	t         *testing.T
	samples   []medSample
	i, step   int
	noCounter bool
	reads     strings.Builder
}

func (s *medSource) cur() medSample {
	if s.i >= len(s.samples) {
		s.t.Fatalf("read past the %d scripted samples", len(s.samples))
	}
	return s.samples[s.i]
}

func (s *medSource) Monotonic() int64 {
	s.reads.WriteByte('m')
	c := s.cur()
	if s.step == 0 {
		s.step = 1
		return c.m0
	}
	s.step = 0
	s.i++
	return c.m1
}

func (s *medSource) Realtime() int64 {
	s.reads.WriteByte('r')
	return s.cur().r
}

func (s *medSource) Counter() (int64, bool) {
	s.reads.WriteByte('c')
	c := s.cur()
	if s.noCounter {
		return 0, false
	}
	if strings.Count(s.reads.String()[strings.LastIndexByte(s.reads.String(), 'm'):], "c") == 1 {
		return c.c0, true
	}
	return c.c1, true
}

// plainSource hides the counter: only Source.
type plainSource struct{ s *medSource }

func (p plainSource) Monotonic() int64 { return p.s.Monotonic() }
func (p plainSource) Realtime() int64  { return p.s.Realtime() }

// bracket builds a sample at m0 of width w whose offset (r minus the
// bracket's midpoint) is off; the counter runs at 3 ticks/ns.
func bracket(m0, w, off int64) medSample {
	return medSample{m0: m0, c0: 3 * (m0 + 1), r: m0 + w/2 + off, c1: 3 * (m0 + w - 1), m1: m0 + w}
}

func TestCalibrateMedianPicksMedian(t *testing.T) {
	const O = int64(1_767_225_600_000_000_000)
	samples := []medSample{
		bracket(1000, 40, O+50),
		bracket(2000, 40, O+10),
		bracket(3000, 40, O+40),
		bracket(4000, 40, O+20),
		bracket(5000, 40, O+30), // the median offset
	}
	src := &medSource{t: t, samples: samples}
	got := CalibrateMedian(src, len(samples))
	want := Calibration{MonoNs: 5020, RealNs: 5020 + O + 30, ErrorNs: 20, Counter: (3*5001 + 3*5039) / 2, HasCounter: true}
	if got != want {
		t.Errorf("CalibrateMedian = %+v, want %+v", got, want)
	}
	if r := src.reads.String(); r != strings.Repeat("mcrcm", len(samples)) {
		t.Errorf("read order %q, want mcrcm per sample", r)
	}

	// Even count: the lower median.
	src = &medSource{t: t, samples: []medSample{
		bracket(1000, 30, O+4), bracket(2000, 30, O+1), bracket(3000, 30, O+3), bracket(4000, 30, O+2),
	}}
	if got := CalibrateMedian(src, 4); got.MonoNs != 4015 || got.OffsetNs() != O+2 || got.ErrorNs != 15 {
		t.Errorf("even count: %+v, want the sample at 4000 (offset O+2)", got)
	}

	// Equal offsets at the median rank: the earlier sample ranks first.
	src = &medSource{t: t, samples: []medSample{
		bracket(1000, 30, O+7), bracket(2000, 30, O+5), bracket(3000, 30, O+5), bracket(4000, 30, O+1), bracket(5000, 30, O+0),
	}}
	if got := CalibrateMedian(src, 5); got.MonoNs != 2015 {
		t.Errorf("ties: %+v, want the sample at 2000", got)
	}

	// Odd width: midpoint rounds down, error rounds up.
	src = &medSource{t: t, samples: []medSample{{m0: 100, c0: 301, r: 500, c1: 319, m1: 107}}}
	if got := CalibrateMedian(src, 1); got.MonoNs != 103 || got.RealNs != 500 || got.ErrorNs != 4 || got.Counter != 310 {
		t.Errorf("odd width: %+v", got)
	}
}

// TestCalibrateMedianIgnoresOutliers: samples whose bracket is more than
// twice the median width (preempted reads) are dropped, so a few huge
// outliers, all on one side, do not move the median at all; kept in, they
// would.
func TestCalibrateMedianIgnoresOutliers(t *testing.T) {
	const O = int64(1_700_000_000_000_000_000)
	rng := rand.New(rand.NewPCG(11, 12))
	var clean []medSample
	m := int64(1_000_000)
	for i := 0; i < 101; i++ {
		w := 30 + rng.Int64N(21) // 30–50 ns
		clean = append(clean, bracket(m, w, O+rng.Int64N(31)-15))
		m += w + 5
	}
	base := CalibrateMedian(&medSource{t: t, samples: clean}, len(clean))

	// Six 1 ms brackets with offsets 200–450 µs high, spread in time.
	dirty := append([]medSample(nil), clean...)
	for k := 0; k < 6; k++ {
		at := 10 + 15*k
		o := dirty[at]
		dirty[at] = bracket(o.m0, 1_000_000, O+200_000+int64(k)*50_000)
	}
	// The replaced samples are no longer in the clean set: compare with
	// the median of the clean samples left.
	var left []medSample
	for i, s := range clean {
		if i < 10 || (i-10)%15 != 0 || i >= 10+15*6 {
			left = append(left, s)
		}
	}
	wantCal := CalibrateMedian(&medSource{t: t, samples: left}, len(left))
	got := CalibrateMedian(&medSource{t: t, samples: dirty}, len(dirty))
	if got != wantCal {
		t.Errorf("with outliers %+v, want the clean samples' median %+v", got, wantCal)
	}
	if got.ErrorNs > 25 {
		t.Errorf("error %d ns: an outlier bracket was chosen", got.ErrorNs)
	}
	if d := got.OffsetNs() - O; d < -15 || d > 15 {
		t.Errorf("offset O%+d, want within the clean spread ±15", d)
	}
	// Control: the median over every sample, outliers included, is a
	// different sample (the outliers would have moved it).
	type so struct{ off, i int64 }
	var all []so
	for i, s := range dirty {
		all = append(all, so{s.r - (s.m0 + (s.m1-s.m0)/2), int64(i)})
	}
	sortSO := func(a []so) {
		for i := range a {
			for j := i + 1; j < len(a); j++ {
				if a[j].off < a[i].off || (a[j].off == a[i].off && a[j].i < a[i].i) {
					a[i], a[j] = a[j], a[i]
				}
			}
		}
	}
	sortSO(all)
	naive := dirty[all[(len(all)-1)/2].i]
	if naive.m0+(naive.m1-naive.m0)/2 == got.MonoNs {
		t.Errorf("control: the outliers would not have moved the median; the test proves nothing")
	}
	t.Logf("clean median %+v; with outliers kept the median would be offset O%+d", base, naive.r-(naive.m0+(naive.m1-naive.m0)/2)-O)
}

func TestCalibrateMedianWithoutCounter(t *testing.T) {
	samples := []medSample{bracket(1000, 40, 77), bracket(2000, 20, 78), bracket(3000, 40, 79)}
	// A plain Source is read m, r, m.
	ms := &medSource{t: t, samples: samples}
	got := CalibrateMedian(plainSource{ms}, 3)
	if want := (Calibration{MonoNs: 2010, RealNs: 2010 + 78, ErrorNs: 10}); got != want {
		t.Errorf("plain source: %+v, want %+v", got, want)
	}
	if r := ms.reads.String(); r != "mrmmrmmrm" {
		t.Errorf("plain source read order %q", r)
	}
	// A CounterSource without a counter: no counter in the calibration.
	ms = &medSource{t: t, samples: samples, noCounter: true}
	got = CalibrateMedian(ms, 3)
	if got.HasCounter || got.Counter != 0 || got.MonoNs != 2010 {
		t.Errorf("no counter: %+v", got)
	}
	// pairs < 1 means 1.
	ms = &medSource{t: t, samples: samples[:1]}
	if got := CalibrateMedian(ms, 0); !reflect.DeepEqual(got.MonoNs, int64(1020)) {
		t.Errorf("pairs 0: %+v", got)
	}
}
