package clock

import (
	"math"
	"math/bits"
	"sort"
)

// A curve maps x to y through calibration points (x_i, y_i). Two curves
// exist: monotonic→realtime (x = MonoNs, y = RealNs) and counter→monotonic
// (x = counter ticks, y = MonoNs). Its rule is the one in the package
// documentation; in short:
//
//   - Consecutive points are separated by a step, and so lie in different
//     runs, when the later one is marked as a step, when x does not
//     advance, or when the rate dy/dx is off its reference by more than
//     maxRate (plus both points' errors). The reference is the nominal rate
//     (realtime: 1), or, with adaptiveRef (counter), the rate of the
//     previous interval of the run.
//   - Inside a run, y is interpolated between neighbours along a quadratic
//     whose curvature is the mean of the neighbouring second differences
//     (those plausibly smooth and not touching a kink), else linearly. When
//     the neighbouring intervals' rates show that the rate jumped inside the
//     interval (a kink: an NTP slew starting or ending, a frequency
//     correction), the kink is located and each side uses its own rate.
//   - After the last point of a run (towards the next run, or after the
//     last point of all), y continues the run's rate at its end, with its
//     curvature for up to two intervals. Before the first point of a run
//     that comes first (or, for a counter that went backwards, the run
//     nearest to x), y continues the run's rate at its start backwards.
//     A run of one point uses the rate carried over from the run before it
//     (the nominal rate for the first).
//
// All reasoning is done in "nominal nanoseconds": X = x·nominal, so rates
// are dimensionless (≈ 1) and the thresholds below are in ppm whatever the
// units of x.
type curve struct {
	nominal     float64 // dy/dx assumed where nothing better is known (> 0)
	maxRate     float64 // a rate off its reference by more than this is a step
	adaptiveRef bool    // the reference is the previous interval's rate

	pts    []cpoint
	runs   []crun
	pieces []cpiece // pieces[j]: interval (pts[j], pts[j+1]) inside a run
	steps  int      // intervals holding a discontinuity or a notified step
	// runsSorted: the runs' first points do not decrease in x (always for
	// monotonic time; a counter that was reset breaks it). firstRun is
	// the run starting at the smallest x.
	runsSorted bool
	firstRun   int
}

type cpoint struct {
	x, y int64
	err  int64 // bound on y's error, in y units (ns)
	step bool  // the interval ending at this point is a step
}

type crun struct {
	first, last int // indices into pts

	// After pts[last]: y = y_last + extension of the last interval's
	// chord + dev, dev = (rate-slope)·U + curv·q(U) with q(U) = U²/2 up to
	// capX, linear beyond. For a single-point run, y = y_last + rate·U.
	rate  float64
	slope float64
	curv  float64
	capX  float64
	// Before pts[first]: y = y_first + head·U (U < 0).
	head float64
}

type cpiece struct {
	kink bool
	tau  float64 // kink position, nominal ns after pts[j]
	// With a kink: y = chord + dev; dev = (a-s)·U + kL·U²/2 before tau,
	// (s-b)·V + kR·V²/2 after it (V = ΔX-U). Without: y = chord +
	// kL·U·(U-ΔX)/2.
	a, b, s, kL, kR float64
}

// Thresholds of the interpolation rule, dimensionless (per nominal ns).
const (
	// kinkMin is the smallest rate jump located inside an interval;
	// smaller ones are left to the interpolation (error at most
	// kinkMin·Δ/4: 1.5 µs for one-minute calibrations).
	kinkMin = 0.1e-6
	// maxCurv bounds a plausible smooth change of rate (10 ppm per minute,
	// per nominal ns): larger second differences come from kinks and are
	// not used as curvature.
	maxCurv = 10e-6 / 60 / 1e9
)

// build derives runs and pieces from pts.
func (c *curve) build() {
	n := len(c.pts)
	c.runs = c.runs[:0]
	if cap(c.pieces) < n {
		c.pieces = make([]cpiece, n)
	}
	c.pieces = c.pieces[:n]
	clear(c.pieces)
	c.steps = 0
	if n == 0 {
		return
	}
	// Nominal-scaled interval widths and rates; steps.
	dX := make([]float64, n)
	rate := make([]float64, n)
	isStep := make([]bool, n)
	runStart := true // interval j is the first of its run
	for j := 0; j+1 < n; j++ {
		p, q := c.pts[j], c.pts[j+1]
		dx, dy := q.x-p.x, q.y-p.y
		X := float64(dx) * c.nominal
		dX[j] = X
		ref := 1.0
		if c.adaptiveRef && !runStart {
			ref = rate[j-1]
		}
		switch {
		case dx <= 0 || q.step:
			isStep[j] = true
		case c.adaptiveRef && runStart:
			rate[j] = float64(dy) / X
		default:
			rate[j] = float64(dy) / X
			isStep[j] = math.Abs(float64(dy)-ref*X) > c.maxRate*X+float64(p.err+q.err)+1
		}
		if isStep[j] && (q.step || math.Abs(float64(dy)-ref*X) > float64(p.err+q.err)+1) {
			c.steps++
		}
		runStart = isStep[j]
	}
	first := 0
	carried := 1.0
	for j := 0; j < n; j++ {
		if j+1 < n && !isStep[j] {
			continue
		}
		r := crun{first: first, last: j, rate: carried, head: carried}
		if j > first {
			c.buildRun(&r, dX, rate)
		}
		carried = r.rate
		c.runs = append(c.runs, r)
		first = j + 1
	}
	c.runsSorted, c.firstRun = true, 0
	for i := 1; i < len(c.runs); i++ {
		x := c.pts[c.runs[i].first].x
		if x < c.pts[c.runs[i-1].first].x {
			c.runsSorted = false
		}
		if x < c.pts[c.runs[c.firstRun].first].x {
			c.firstRun = i
		}
	}
}

// curvAt returns the curvature seen by the intervals i and i+1 (both in the
// run), and whether it is plausibly smooth.
func curvAt(dX, rate []float64, i int) (float64, bool) {
	k := 2 * (rate[i+1] - rate[i]) / (dX[i] + dX[i+1])
	return k, math.Abs(k) <= maxCurv
}

func (c *curve) buildRun(r *crun, dX, rate []float64) {
	f, l := r.first, r.last
	// curv returns the curvature of intervals i and i+1 if both are in the
	// run, neither holds a located kink, and it is plausibly smooth.
	curv := func(i int) (float64, bool) {
		if i < f || i+1 >= l || c.pieces[i].kink || c.pieces[i+1].kink {
			return 0, false
		}
		return curvAt(dX, rate, i)
	}
	// Pass 1: kinks. An interval with two intervals on each side in the
	// run, whose second differences are plausibly smooth, holds a kink if
	// the rates of its neighbours, carried to its ends with the curvature
	// on their side, cannot meet its chord smoothly: the jump between them
	// exceeds kinkMin plus the disagreement of the two curvatures (the
	// smooth drift's own uncertainty).
	for j := f; j < l; j++ {
		c.pieces[j] = cpiece{s: rate[j]}
		if j-2 < f || j+2 >= l {
			continue // two intervals needed on each side
		}
		kL, okL := curvAt(dX, rate, j-2)
		kR, okR := curvAt(dX, rate, j+1)
		if !okL || !okR {
			continue // a kink next door: this interval is not the one
		}
		a := rate[j-1] + kL*dX[j-1]/2 // rate at pts[j], from the left
		b := rate[j+1] - kR*dX[j+1]/2 // rate at pts[j+1], from the right
		D := dX[j]
		jump := b - a - (kL+kR)/2*D
		if math.Abs(jump) < kinkMin+math.Abs(kL-kR)*D {
			continue
		}
		// Left: a·U + kL·U²/2; right: ΔY − b·V + kR·V²/2 (V = D−U); they
		// meet at tau: (kL−kR)/2·τ² + (a−b+kR·D)·τ − (s−b+kR·D/2)·D = 0.
		tau, ok := solveIn(0, D, (kL-kR)/2, a-b+kR*D, -(rate[j]-b+kR*D/2)*D)
		if ok {
			c.pieces[j] = cpiece{kink: true, tau: tau, a: a, b: b, s: rate[j], kL: kL, kR: kR}
		}
	}
	// Pass 2: the other intervals follow a quadratic through both ends,
	// its curvature the mean of the second differences they take part in
	// (those not touching a kink).
	for j := f; j < l; j++ {
		if c.pieces[j].kink {
			continue
		}
		kL, okL := curv(j - 1)
		kR, okR := curv(j)
		switch {
		case okL && okR:
			c.pieces[j].kL = (kL + kR) / 2
		case okL:
			c.pieces[j].kL = kL
		case okR:
			c.pieces[j].kL = kR
		}
	}
	// Tail: the rate at the last point, from the last interval and the
	// curvature of the last two when it is usable.
	r.slope = rate[l-1]
	r.rate = rate[l-1]
	r.capX = 2 * dX[l-1]
	if k, ok := curv(l - 2); ok {
		r.curv = k
		r.rate += k * dX[l-1] / 2
	}
	// Head: the rate at the first point, likewise.
	r.head = rate[f]
	if k, ok := curv(f); ok {
		r.head -= k * dX[f] / 2
	}
}

// solveIn returns the root in (lo, hi) of A·x² + B·x + C = 0, the one
// nearest the linear solution if two are.
func solveIn(lo, hi, A, B, C float64) (float64, bool) {
	in := func(x float64) bool { return x > lo && x < hi }
	if B == 0 && A == 0 {
		return 0, false
	}
	lin := -C / B
	if A == 0 || math.Abs(A)*(hi-lo) < 1e-12*math.Abs(B) {
		return lin, B != 0 && in(lin)
	}
	disc := B*B - 4*A*C
	if disc < 0 {
		return 0, false
	}
	q := -(B + math.Copysign(math.Sqrt(disc), B)) / 2
	x1, x2 := q/A, C/q
	switch {
	case in(x1) && in(x2):
		if math.Abs(x1-lin) < math.Abs(x2-lin) {
			return x1, true
		}
		return x2, true
	case in(x1):
		return x1, true
	case in(x2):
		return x2, true
	}
	return 0, false
}

// eval returns y at x. c must hold at least one point.
func (c *curve) eval(x int64) int64 {
	r := &c.runs[c.runFor(x)]
	f := c.pts[r.first]
	if x < f.x {
		if r.last == r.first {
			return f.y + scaleRound(x-f.x, r.head*c.nominal)
		}
		return f.y + roundNs(r.head*float64(x-f.x)*c.nominal)
	}
	pts := c.pts[r.first : r.last+1]
	j := r.first + sort.Search(len(pts), func(i int) bool { return pts[i].x > x }) - 1
	p := c.pts[j]
	u := x - p.x
	U := float64(u) * c.nominal
	if j == r.last {
		if r.first == r.last {
			return p.y + scaleRound(u, r.rate*c.nominal)
		}
		q := c.pts[j-1]
		base := p.y + mulDivFloor(p.y-q.y, u, p.x-q.x)
		qu := U * U / 2
		if U > r.capX {
			qu = r.capX*r.capX/2 + r.capX*(U-r.capX)
		}
		return base + roundNs((r.rate-r.slope)*U+r.curv*qu)
	}
	q := c.pts[j+1]
	base := p.y + mulDivFloor(q.y-p.y, u, q.x-p.x)
	pc := &c.pieces[j]
	if !pc.kink {
		if pc.kL == 0 {
			return base
		}
		return base + roundNs(pc.kL*U*(U-float64(q.x-p.x)*c.nominal)/2)
	}
	var dev float64
	if U <= pc.tau {
		dev = (pc.a-pc.s)*U + pc.kL*U*U/2
	} else {
		V := float64(q.x-x) * c.nominal
		dev = (pc.s-pc.b)*V + pc.kR*V*V/2
	}
	return base + roundNs(dev)
}

// runFor returns the run x is converted with. Sorted runs: the latest run
// starting at or before x (the first run for x before all). Otherwise (a
// counter that went backwards): the run whose x range is nearest to x,
// containing it if possible, the latest on ties.
func (c *curve) runFor(x int64) int {
	if c.runsSorted {
		return max(sort.Search(len(c.runs), func(i int) bool { return c.pts[c.runs[i].first].x > x })-1, 0)
	}
	best, bestD := 0, uint64(math.MaxUint64)
	for i := len(c.runs) - 1; i >= 0; i-- {
		lo, hi := c.pts[c.runs[i].first].x, c.pts[c.runs[i].last].x
		var d uint64
		switch {
		case x < lo:
			d = uint64(lo - x)
		case x > hi:
			d = uint64(x - hi)
		}
		if d < bestD {
			best, bestD = i, d
		}
	}
	return best
}

// maxErr returns the largest point error.
func (c *curve) maxErr() int64 {
	var m int64
	for _, p := range c.pts {
		m = max(m, p.err)
	}
	return m
}

// scaleRound returns round(u·f), exactly u when f is 1.
func scaleRound(u int64, f float64) int64 {
	if f == 1 {
		return u
	}
	return roundNs(float64(u) * f)
}

func roundNs(v float64) int64 { return int64(math.Round(v)) }

// mulDivFloor returns floor(a·b/c) for b ≥ 0, c > 0, without overflow in
// the product; the result saturates if it does not fit in an int64.
func mulDivFloor(a, b, c int64) int64 {
	if b == 0 || a == 0 {
		return 0
	}
	neg := a < 0
	ua := uint64(a)
	if neg {
		ua = -ua
	}
	hi, lo := bits.Mul64(ua, uint64(b))
	if hi >= uint64(c) {
		if neg {
			return math.MinInt64
		}
		return math.MaxInt64
	}
	q, rem := bits.Div64(hi, lo, uint64(c))
	if neg {
		if rem != 0 {
			q++
		}
		if q > 1<<63 {
			return math.MinInt64
		}
		return -int64(q)
	}
	if q > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(q)
}
