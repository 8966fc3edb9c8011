package clock

import "sort"

// DefaultPairs is how many bracketed samples a calibration takes, as
// PyTorch's ApproximateClockToUnixTimeConverter does.
const DefaultPairs = 1001

// CalibrateMedian takes pairs bracketed samples and returns the median one.
//
// Each sample reads monotonic m0, then (if src is a CounterSource) the
// counter c0, realtime r, the counter c1, then monotonic m1; a plain Source
// is read m0, r, m1. Samples whose bracket m1−m0 is more than twice the
// median bracket width (preempted or interrupted) are dropped; of the rest,
// the one whose offset r − (m0+m1)/2 is the median (the lower median for an
// even count; ties in sampling order) becomes the calibration: MonoNs its
// bracket midpoint (rounded down), RealNs its r, ErrorNs half its bracket
// (rounded up), Counter its counter midpoint. Both r and the counter reads
// happened inside the bracket, so ErrorNs bounds both pairings.
func CalibrateMedian(src Source, pairs int) Calibration {
	if pairs < 1 {
		pairs = 1
	}
	cs, withCounter := src.(CounterSource)
	type sample struct {
		m0, m1, r, c0, c1 int64
		ctr               bool
	}
	samples := make([]sample, pairs)
	for i := range samples {
		s := &samples[i]
		if withCounter {
			s.m0 = src.Monotonic()
			c0, ok0 := cs.Counter()
			s.r = src.Realtime()
			c1, ok1 := cs.Counter()
			s.m1 = src.Monotonic()
			s.c0, s.c1, s.ctr = c0, c1, ok0 && ok1 && c1 >= c0
		} else {
			s.m0 = src.Monotonic()
			s.r = src.Realtime()
			s.m1 = src.Monotonic()
		}
	}

	widths := make([]int64, 0, pairs)
	for _, s := range samples {
		if w := s.m1 - s.m0; w >= 0 {
			widths = append(widths, w)
		}
	}
	if len(widths) == 0 {
		// Monotonic never advanced across a bracket: a broken source. Keep
		// the first sample with the widest possible error.
		s := samples[0]
		return Calibration{MonoNs: s.m0, RealNs: s.r, ErrorNs: max(s.m0-s.m1, 0)}
	}
	sort.Slice(widths, func(i, j int) bool { return widths[i] < widths[j] })
	limit := 2 * widths[(len(widths)-1)/2]

	type kept struct {
		offset int64
		i      int
	}
	keep := make([]kept, 0, len(widths))
	for i, s := range samples {
		if w := s.m1 - s.m0; w >= 0 && w <= limit {
			keep = append(keep, kept{offset: s.r - (s.m0 + w/2), i: i})
		}
	}
	sort.Slice(keep, func(a, b int) bool {
		if keep[a].offset != keep[b].offset {
			return keep[a].offset < keep[b].offset
		}
		return keep[a].i < keep[b].i
	})
	s := samples[keep[(len(keep)-1)/2].i]
	w := s.m1 - s.m0
	cal := Calibration{MonoNs: s.m0 + w/2, RealNs: s.r, ErrorNs: (w + 1) / 2}
	if s.ctr {
		cal.Counter, cal.HasCounter = s.c0+(s.c1-s.c0)/2, true
	}
	return cal
}
