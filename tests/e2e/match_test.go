package e2e

import (
	"fmt"
	"sort"
	"testing"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// expected is one trace entry a ground-truth call must produce.
type expected struct {
	action string
	addr   uint64 // device_free for oom
	size   uint64
	call   fixture.Call
}

func (e expected) String() string {
	return fmt.Sprintf("%s addr=%#x size=%d (tid %d seq %d %s)", e.action, e.addr, e.size, e.call.Tid, e.call.Seq, e.call.Func)
}

// segmentExpectations derives, per thread in call order, the entries
// npuprobe must record at segment level for the run-phase calls:
//   - a successful malloc: segment_alloc(pointer, size)
//   - a malloc failing with 207001: oom(device_free from the thread's next
//     call when it is aclrtGetMemInfo, as torch_npu does, size)
//   - aclrtFree: segment_free(pointer, size of that allocation if it was made
//     after attach; 0 for one made before, whose size the agent cannot know)
//
// It also returns how many frees are of pre-attach allocations.
func segmentExpectations(t *testing.T, gt *fixture.GroundTruth) (map[int][]expected, int) {
	t.Helper()
	sizes := allocationSizesAtFree(gt)
	byThread := gt.CallsByThread()
	out := make(map[int][]expected)
	unknownFrees := 0
	for tid, calls := range byThread {
		for i, c := range calls {
			if c.Phase != fixture.PhaseRun {
				continue
			}
			switch {
			case c.IsMalloc() && c.RC == fixture.ACLSuccess:
				out[tid] = append(out[tid], expected{"segment_alloc", c.R0, c.A0, c})
			case c.IsMalloc() && c.RC == fixture.ACLErrorRTMemoryAllocation:
				var free uint64
				if i+1 < len(calls) && calls[i+1].Func == fixture.FuncGetMemInfo && calls[i+1].RC == 0 {
					free = calls[i+1].R0
				} else {
					t.Fatalf("OOM at tid %d seq %d not followed by aclrtGetMemInfo", tid, c.Seq)
				}
				out[tid] = append(out[tid], expected{"oom", free, c.A0, c})
			case c.Func == fixture.FuncFree && c.RC == fixture.ACLSuccess:
				k := callKey{c.Tid, c.Seq}
				alloc, ok := sizes[k]
				if !ok {
					t.Fatalf("free at tid %d seq %d of %#x matches no allocation", tid, c.Seq, c.A0)
				}
				size := alloc.Size
				if alloc.Phase != fixture.PhaseRun {
					size = 0
					unknownFrees++
				}
				out[tid] = append(out[tid], expected{"segment_free", c.A0, size, c})
			}
		}
	}
	return out, unknownFrees
}

type callKey struct{ tid, seq int }

// allocationSizesAtFree replays every call in the order their effects
// happened (an allocation takes effect before it returns, a free after it is
// entered: sorting mallocs by return time and frees by entry time is exact
// for pointers that are reused across threads) and returns, for each free,
// the allocation it freed.
func allocationSizesAtFree(gt *fixture.GroundTruth) map[callKey]fixture.Live {
	type step struct {
		at int64
		c  fixture.Call
	}
	var steps []step
	for _, c := range gt.Calls {
		switch {
		case c.IsMalloc() && c.RC == fixture.ACLSuccess:
			steps = append(steps, step{c.AfterNs, c})
		case c.Func == fixture.FuncFree && c.RC == fixture.ACLSuccess:
			steps = append(steps, step{c.BeforeNs, c})
		}
	}
	sort.SliceStable(steps, func(i, j int) bool { return steps[i].at < steps[j].at })
	live := make(map[uint64]fixture.Live)
	out := make(map[callKey]fixture.Live)
	for _, s := range steps {
		if s.c.Func == fixture.FuncFree {
			if l, ok := live[s.c.A0]; ok {
				out[callKey{s.c.Tid, s.c.Seq}] = l
				delete(live, s.c.A0)
			}
			continue
		}
		live[s.c.R0] = fixture.Live{Device: s.c.Device, Address: s.c.R0, Size: s.c.A0, Func: s.c.Func, Phase: s.c.Phase}
	}
	return out
}

// timingStats summarises how far time_us lies from its call's interval.
type timingStats struct {
	distancesUs []float64 // 0 inside [before, after]
}

func (s *timingStats) quantile(q float64) float64 {
	if len(s.distancesUs) == 0 {
		return 0
	}
	d := append([]float64(nil), s.distancesUs...)
	sort.Float64s(d)
	return d[int(q*float64(len(d)-1))]
}

// matchTrace requires trace (one device, oldest first) to be exactly the
// union of the per-thread expectations, each thread's entries in its call
// order, and every time_us within slackUs of its call's [before, after]
// interval. Entries of different threads may interleave in any way
// consistent with those rules.
//
// An entry can fit the next expectation of several threads at once: the
// runtime reuses a freed address at once, so two threads may each be about
// to allocate the same address and size (one freed it, the other, whose
// call started earlier, got it next). Picking either thread is consistent
// with the entry but only one is consistent with the rest of the trace, so
// the matcher backtracks: it tries the call that ends first (it must be
// recorded first), and revisits the choice if a later entry then fits no
// thread.
func matchTrace(t *testing.T, trace []TraceEntry, want map[int][]expected, slackUs int64) *timingStats {
	t.Helper()
	entryAddr := func(e TraceEntry) uint64 {
		switch {
		case e.Action == "oom" && e.DeviceFree != nil:
			return *e.DeviceFree
		case e.Addr != nil:
			return *e.Addr
		}
		return 0
	}
	next := make(map[int]int)
	// candidates lists the threads whose next expectation fits trace[i],
	// the earliest-ending call first.
	candidates := func(i int) []int {
		e := trace[i]
		addr := entryAddr(e)
		var out []int
		for tid, list := range want {
			if next[tid] >= len(list) {
				continue
			}
			x := &list[next[tid]]
			if x.action != e.Action || x.addr != addr || x.size != e.Size {
				continue
			}
			lo := floorDiv(x.call.BeforeNs, 1000) - slackUs
			hi := floorDiv(x.call.AfterNs, 1000) + slackUs
			if e.TimeUs < lo || e.TimeUs > hi {
				continue
			}
			out = append(out, tid)
		}
		sort.Slice(out, func(a, b int) bool {
			x, y := want[out[a]][next[out[a]]].call, want[out[b]][next[out[b]]].call
			if x.AfterNs != y.AfterNs {
				return x.AfterNs < y.AfterNs
			}
			return x.BeforeNs < y.BeforeNs
		})
		return out
	}
	heads := func() []string {
		var out []string
		for tid, list := range want {
			if next[tid] < len(list) {
				x := list[next[tid]]
				out = append(out, fmt.Sprintf("tid %d next: %v [%d, %d] µs", tid, x, x.call.BeforeNs/1000, x.call.AfterNs/1000))
			}
		}
		sort.Strings(out)
		return out
	}

	// choices[i] is how trace[i] is matched: its candidate threads and the
	// one in use.
	type choice struct {
		cands []int
		used  int
	}
	choices := make([]choice, 0, len(trace))
	furthest, failure := -1, ""
	budget := 50*len(trace) + 10000 // entries matched, backtracking included
	for i := 0; i < len(trace); {
		if budget--; budget < 0 {
			t.Fatalf("matching the trace takes too much backtracking; furthest failure:\n%s", failure)
		}
		if cands := candidates(i); len(cands) > 0 {
			choices = append(choices, choice{cands: cands})
			next[cands[0]]++
			i++
			continue
		}
		if i > furthest {
			e := trace[i]
			furthest = i
			failure = fmt.Sprintf("trace entry %d {%s addr/free=%#x size=%d time_us=%d} is not the next call of any thread:\n%v",
				i, e.Action, entryAddr(e), e.Size, e.TimeUs, heads())
		}
		// Undo up to the latest entry that had another candidate.
		for {
			if len(choices) == 0 {
				t.Fatal(failure)
			}
			c := &choices[len(choices)-1]
			next[c.cands[c.used]]--
			if c.used++; c.used < len(c.cands) {
				next[c.cands[c.used]]++
				i = len(choices)
				break
			}
			choices = choices[:len(choices)-1]
		}
	}
	for tid, list := range want {
		if next[tid] != len(list) {
			t.Fatalf("thread %d: %d of %d expected entries missing from the trace, first: %v",
				tid, len(list)-next[tid], len(list), list[next[tid]])
		}
	}
	// Replay the final choices for the timing statistics.
	stats := &timingStats{}
	pos := make(map[int]int)
	for i, c := range choices {
		tid := c.cands[c.used]
		stats.distancesUs = append(stats.distancesUs, distanceUs(trace[i].TimeUs, want[tid][pos[tid]].call))
		pos[tid]++
	}
	return stats
}

// distanceUs is how far timeUs lies outside [before, after] (µs resolution).
func distanceUs(timeUs int64, c fixture.Call) float64 {
	lo, hi := float64(c.BeforeNs)/1000, float64(c.AfterNs)/1000
	x := float64(timeUs)
	switch {
	case x < lo-1: // time_us truncates: anything within the same µs is inside
		return lo - 1 - x
	case x > hi:
		return x - hi
	}
	return 0
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}
