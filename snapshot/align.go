package snapshot

import "sort"

// pair matches a[A] with b[B].
type pair struct{ A, B int }

// Alignment limits. A leaf (a stretch with no key unique on both sides) of
// at most dpCells cells is aligned exactly by dynamic programming; larger
// leaves by Myers' algorithm if they differ in at most maxMyersD entries;
// beyond that by occurrence counting.
const (
	dpCells   = 4 << 20
	maxMyersD = 2000
)

// align returns an order-preserving matching between a and b (keys as
// small ints): pairs with a[A] == b[B], strictly increasing in both A and
// B. It is a longest common subsequence wherever that is affordable:
//
//  1. equal tails are matched (the usual case: both lists end at the
//     same dump);
//  2. keys occurring exactly once in both remaining stretches are anchors
//     (patience diff): the longest chain of anchors increasing on both
//     sides is matched and the stretches between anchors are aligned the
//     same way, recursively;
//  3. a stretch without unique keys is aligned exactly (dynamic
//     programming, or Myers' O((N+M)D) when few entries differ); a huge
//     stretch that differs a lot pairs the k-th last occurrence of each
//     key in a with the k-th last in b, keeping the longest chain that
//     increases on both sides.
//
// Where several alignments are equally long (a workload repeating the
// same allocations every step), the one matching entries as late as
// possible wins: a recording that starts after torch's history (npuprobe
// attached mid-run) then lines up with the end of that history, where it
// belongs, instead of with an identical earlier step.
func align(a, b []int32) []pair {
	ra, rb := reversed(a), reversed(b)
	var rev []pair
	alignRange(ra, rb, 0, 0, &rev)
	out := make([]pair, len(rev))
	for i, p := range rev {
		out[len(rev)-1-i] = pair{len(a) - 1 - p.A, len(b) - 1 - p.B}
	}
	return out
}

func reversed(s []int32) []int32 {
	out := make([]int32, len(s))
	for i, v := range s {
		out[len(s)-1-i] = v
	}
	return out
}

// alignRange aligns a and b (offsets aOff, bOff in the whole sequences),
// preferring early matches among equally long alignments; align runs it on
// the reversed sequences.
func alignRange(a, b []int32, aOff, bOff int, out *[]pair) {
	// 1. common head
	head := 0
	for head < len(a) && head < len(b) && a[head] == b[head] {
		*out = append(*out, pair{aOff + head, bOff + head})
		head++
	}
	a, b = a[head:], b[head:]
	aOff += head
	bOff += head
	// No common tail is stripped: a common head of the reversed sequences
	// is matched greedily (late in the original), while its common tail (the
	// original's head) is left to the steps below, which keep the
	// preference for late matches.
	if len(a) == 0 || len(b) == 0 {
		return
	}

	// 2. unique anchors
	type count struct {
		na, nb int
		ia, ib int
	}
	counts := make(map[int32]*count)
	for i, k := range a {
		c := counts[k]
		if c == nil {
			c = &count{}
			counts[k] = c
		}
		c.na++
		c.ia = i
	}
	for i, k := range b {
		if c := counts[k]; c != nil {
			c.nb++
			c.ib = i
		}
	}
	var anchors []pair
	for _, c := range counts {
		if c.na == 1 && c.nb == 1 {
			anchors = append(anchors, pair{c.ia, c.ib})
		}
	}
	if len(anchors) > 0 {
		chain := increasingChain(anchors)
		pa, pb := 0, 0
		for _, p := range chain {
			alignRange(a[pa:p.A], b[pb:p.B], aOff+pa, bOff+pb, out)
			*out = append(*out, pair{aOff + p.A, bOff + p.B})
			pa, pb = p.A+1, p.B+1
		}
		alignRange(a[pa:], b[pb:], aOff+pa, bOff+pb, out)
		return
	}

	// 3. leaf
	var leaf []pair
	switch {
	case len(a)*len(b) <= dpCells:
		leaf = lcsDP(a, b)
	default:
		var ok bool
		if leaf, ok = lcsMyers(a, b, maxMyersD); !ok {
			leaf = occurrencesFromStart(a, b)
		}
	}
	for _, p := range leaf {
		*out = append(*out, pair{aOff + p.A, bOff + p.B})
	}
}

// increasingChain returns the longest subset of pairs increasing in both A
// and B (pairs have distinct A and distinct B).
func increasingChain(ps []pair) []pair {
	sort.Slice(ps, func(i, j int) bool { return ps[i].A < ps[j].A })
	// Patience sorting on B.
	tails := []int{} // tails[k] = index in ps of the smallest B ending a chain of length k+1
	prev := make([]int, len(ps))
	for i, p := range ps {
		k := sort.Search(len(tails), func(k int) bool { return ps[tails[k]].B >= p.B })
		if k > 0 {
			prev[i] = tails[k-1]
		} else {
			prev[i] = -1
		}
		if k == len(tails) {
			tails = append(tails, i)
		} else {
			tails[k] = i
		}
	}
	chain := make([]pair, len(tails))
	for k, i := len(tails)-1, tails[len(tails)-1]; k >= 0; k, i = k-1, prev[i] {
		chain[k] = ps[i]
	}
	return chain
}

// lcsDP is the textbook longest common subsequence by dynamic
// programming.
func lcsDP(a, b []int32) []pair {
	n, m := len(a), len(b)
	// l[i*(m+1)+j] = LCS length of a[i:] and b[j:].
	l := make([]int32, (n+1)*(m+1))
	at := func(i, j int) int32 { return l[i*(m+1)+j] }
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			var v int32
			if a[i] == b[j] {
				v = at(i+1, j+1) + 1
			} else {
				v = max(at(i+1, j), at(i, j+1))
			}
			l[i*(m+1)+j] = v
		}
	}
	var out []pair
	i, j := 0, 0
	for i < n && j < m {
		switch {
		case a[i] == b[j]:
			out = append(out, pair{i, j})
			i++
			j++
		case at(i+1, j) >= at(i, j+1):
			i++
		default:
			j++
		}
	}
	return out
}

// lcsMyers is Myers' O((N+M)D) longest common subsequence; ok is false
// when more than maxD entries differ.
func lcsMyers(a, b []int32, maxD int) ([]pair, bool) {
	n, m := len(a), len(b)
	maxD = min(maxD, n+m)
	off := maxD + 1
	v := make([]int, 2*maxD+3)
	var trace [][]int // trace[d][k+d] = furthest x on diagonal k after d edits
	for d := 0; d <= maxD; d++ {
		done := false
		for k := -d; k <= d; k += 2 {
			var x int
			if k == -d || (k != d && v[off+k-1] < v[off+k+1]) {
				x = v[off+k+1] // down: an entry of b unmatched
			} else {
				x = v[off+k-1] + 1 // right: an entry of a unmatched
			}
			y := x - k
			for x < n && y < m && a[x] == b[y] {
				x++
				y++
			}
			v[off+k] = x
			if x >= n && y >= m {
				done = true
			}
		}
		snap := make([]int, 2*d+1)
		for k := -d; k <= d; k += 2 {
			snap[k+d] = v[off+k]
		}
		trace = append(trace, snap)
		if done {
			return myersPath(trace, n, m), true
		}
	}
	return nil, false
}

// myersPath walks Myers' trace back from (n, m) and returns the diagonal
// moves: the matches.
func myersPath(trace [][]int, n, m int) []pair {
	var rev []pair
	x, y := n, m
	for d := len(trace) - 1; d > 0; d-- {
		k := x - y
		prev := trace[d-1]
		var pk int
		if k == -d || (k != d && prev[k-1+d-1] < prev[k+1+d-1]) {
			pk = k + 1
		} else {
			pk = k - 1
		}
		px := prev[pk+d-1]
		py := px - pk
		for x > px && y > py {
			x--
			y--
			rev = append(rev, pair{x, y})
		}
		x, y = px, py
	}
	for x > 0 && y > 0 {
		x--
		y--
		rev = append(rev, pair{x, y})
	}
	out := make([]pair, len(rev))
	for i, p := range rev {
		out[len(rev)-1-i] = p
	}
	return out
}

// occurrencesFromStart pairs, for each key, the k-th occurrence in a with
// the k-th in b, and keeps the longest chain increasing on both sides.
// (On the reversed sequences align works on, that is the k-th last
// occurrence of the original ones.)
func occurrencesFromStart(a, b []int32) []pair {
	pos := make(map[int32][]int)
	for j, k := range b {
		pos[k] = append(pos[k], j)
	}
	seen := make(map[int32]int)
	var ps []pair
	for i, k := range a {
		js := pos[k]
		n := seen[k]
		if n < len(js) {
			ps = append(ps, pair{i, js[n]})
		}
		seen[k] = n + 1
	}
	if len(ps) == 0 {
		return nil
	}
	return increasingChain(ps)
}
