package snapshot

import (
	"math/rand"
	"testing"
)

func validPairs(t *testing.T, a, b []int32, ps []pair) {
	t.Helper()
	for i, p := range ps {
		if p.A < 0 || p.A >= len(a) || p.B < 0 || p.B >= len(b) || a[p.A] != b[p.B] {
			t.Fatalf("pair %d %+v invalid", i, p)
		}
		if i > 0 && (p.A <= ps[i-1].A || p.B <= ps[i-1].B) {
			t.Fatalf("pairs %+v, %+v not increasing", ps[i-1], p)
		}
	}
}

func randSeq(rng *rand.Rand, n, alphabet int) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = int32(rng.Intn(alphabet))
	}
	return s
}

// Myers and the dynamic programme find common subsequences of the same
// (longest) length.
func TestLCSMyersEqualsDP(t *testing.T) {
	rng := rand.New(rand.NewSource(2))
	for iter := 0; iter < 500; iter++ {
		a := randSeq(rng, rng.Intn(60), 1+rng.Intn(6))
		b := randSeq(rng, rng.Intn(60), 1+rng.Intn(6))
		dp := lcsDP(a, b)
		my, ok := lcsMyers(a, b, len(a)+len(b))
		if !ok {
			t.Fatal("Myers gave up within N+M")
		}
		validPairs(t, a, b, dp)
		validPairs(t, a, b, my)
		if len(dp) != len(my) {
			t.Fatalf("a=%v b=%v: DP %d, Myers %d", a, b, len(dp), len(my))
		}
		al := align(a, b)
		validPairs(t, a, b, al)
		if len(a)*len(b) <= dpCells && len(al) > len(dp) {
			t.Fatalf("align found %d pairs, more than the longest %d", len(al), len(dp))
		}
		validPairs(t, a, b, occurrencesFromStart(a, b))
	}
}

// A periodic stream (no key unique anywhere), two overlapping windows with
// losses, too big for the dynamic programme: Myers aligns it, and finds at
// least as many pairs as the true correspondence.
func TestAlignPeriodicLarge(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	var stream []int32
	for i := 0; i < 12000; i++ {
		stream = append(stream, int32(i%97))
	}
	window := func(from, to int, loss float64) ([]int32, []int) {
		var s []int32
		var idx []int
		for i := from; i < to; i++ {
			if rng.Float64() < loss {
				continue
			}
			s = append(s, stream[i])
			idx = append(idx, i)
		}
		return s, idx
	}
	a, ai := window(0, 11000, 0.002)
	b, bi := window(20, 11500, 0.002)
	truth := 0
	j := 0
	for _, x := range ai {
		for j < len(bi) && bi[j] < x {
			j++
		}
		if j < len(bi) && bi[j] == x {
			truth++
		}
	}
	ps := align(a, b)
	validPairs(t, a, b, ps)
	if len(ps) < truth {
		t.Fatalf("%d pairs, the true correspondence has %d", len(ps), truth)
	}
	// Beyond Myers' budget the fallback still gives a valid alignment.
	c, _ := window(3000, 11000, 0.3)
	d, _ := window(0, 8000, 0.3)
	validPairs(t, c, d, align(c, d))
	validPairs(t, c, d, occurrencesFromStart(c, d))
}

// Among equally long alignments the latest wins: a recording that
// repeats the last steps of a periodic history lines up with its end.
func TestAlignPrefersLate(t *testing.T) {
	step := []int32{1, 2, 3, 4, 2, 3}
	var a []int32
	for i := 0; i < 5; i++ {
		a = append(a, step...)
	}
	a = append(a, 9) // a different last entry: no common tail
	b := append(append([]int32(nil), step...), step...)
	ps := align(a, b)
	if len(ps) != len(b) || ps[0].A != 3*len(step) || ps[len(ps)-1].A != 5*len(step)-1 {
		t.Fatalf("pairs %v: want b on the last two steps of a", ps)
	}
}

func TestInterpolate(t *testing.T) {
	if got := interpolate(1767225600000000, 1767225600000000+1<<40, 3, 1<<30); got != 1767225600000000+3*1024 {
		t.Errorf("interpolate = %d", got)
	}
	if got := interpolate(10, 5, 1, 2); got != 10 {
		t.Errorf("decreasing anchors: %d", got)
	}
}
