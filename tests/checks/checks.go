// Package checks holds the checks the end-to-end and container tests apply
// to npuprobe's snapshots: every snapshot must pass the independent Python
// checker (tests/snapshotcheck, memory_viz's rules) and read the same with
// gopickle, and its trace must match, call for call, the ground truth a
// fixture workload recorded itself.
package checks

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"testing"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"
	"github.com/npuprobe/npuprobe/tests/fixture"
)

// checkerPath is tests/snapshotcheck/check_snapshot.py, found from this
// file's own location so that any test package can use it.
func checkerPath() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "snapshotcheck", "check_snapshot.py")
}

// Snapshot mirrors the pickled dict as the Python checker dumps it to JSON.
type Snapshot struct {
	Segments          []Segment                  `json:"segments"`
	DeviceTraces      [][]TraceEntry             `json:"device_traces"`
	AllocatorSettings map[string]json.RawMessage `json:"allocator_settings"`
}

type Segment struct {
	Device        int     `json:"device"`
	Address       uint64  `json:"address"`
	TotalSize     uint64  `json:"total_size"`
	AllocatedSize uint64  `json:"allocated_size"`
	ActiveSize    uint64  `json:"active_size"`
	RequestedSize uint64  `json:"requested_size"`
	Stream        uint64  `json:"stream"`
	SegmentType   string  `json:"segment_type"`
	PoolID        []int64 `json:"segment_pool_id"`
	IsExpandable  bool    `json:"is_expandable"`
	Blocks        []Block `json:"blocks"`
}

type Block struct {
	Address       uint64 `json:"address"`
	Size          uint64 `json:"size"`
	RequestedSize uint64 `json:"requested_size"`
	State         string `json:"state"`
}

type TraceEntry struct {
	Action     string  `json:"action"`
	Addr       *uint64 `json:"addr"`
	DeviceFree *uint64 `json:"device_free"`
	Size       uint64  `json:"size"`
	Stream     uint64  `json:"stream"`
	TimeUs     int64   `json:"time_us"`
	PoolID     []int64 `json:"pool_id"`
}

// loadSnapshot runs the Python checker on path (it must pass) and returns
// the snapshot as the checker loaded it with python3's pickle.
func LoadSnapshot(t testing.TB, path string) *Snapshot {
	t.Helper()
	jsonPath := filepath.Join(t.TempDir(), "snapshot.json")
	check := exec.Command("python3", checkerPath(),
		"--expect-time", "--json-out", jsonPath, path)
	out, err := check.CombinedOutput()
	if err != nil {
		t.Fatalf("snapshot checker rejected %s: %v\n%s", path, err, out)
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var s Snapshot
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&s); err != nil {
		t.Fatalf("decode checker JSON: %v", err)
	}
	checkGopickleAgrees(t, path, b)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("%s has mode %v, want 0600", path, st.Mode().Perm())
	}
	return &s
}

// setting decodes one allocator_settings value.
func (s *Snapshot) Setting(t testing.TB, key string, v any) {
	t.Helper()
	raw, ok := s.AllocatorSettings[key]
	if !ok {
		t.Fatalf("allocator_settings has no %q", key)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("allocator_settings[%q]: %v", key, err)
	}
}

// Expected is one trace entry a ground-truth call must produce.
type Expected struct {
	action string
	addr   uint64 // device_free for oom
	size   uint64
	call   fixture.Call
}

func (e Expected) String() string {
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
func SegmentExpectations(t testing.TB, gt *fixture.GroundTruth) (map[int][]Expected, int) {
	t.Helper()
	sizes := AllocationSizesAtFree(gt)
	byThread := gt.CallsByThread()
	out := make(map[int][]Expected)
	unknownFrees := 0
	for tid, calls := range byThread {
		for i, c := range calls {
			if c.Phase != fixture.PhaseRun {
				continue
			}
			switch {
			case c.IsMalloc() && c.RC == fixture.ACLSuccess:
				out[tid] = append(out[tid], Expected{"segment_alloc", c.R0, c.A0, c})
			case c.IsMalloc() && c.RC == fixture.ACLErrorRTMemoryAllocation:
				var free uint64
				if i+1 < len(calls) && calls[i+1].Func == fixture.FuncGetMemInfo && calls[i+1].RC == 0 {
					free = calls[i+1].R0
				} else {
					t.Fatalf("OOM at tid %d seq %d not followed by aclrtGetMemInfo", tid, c.Seq)
				}
				out[tid] = append(out[tid], Expected{"oom", free, c.A0, c})
			case c.Func == fixture.FuncFree && c.RC == fixture.ACLSuccess:
				k := CallKey{c.Tid, c.Seq}
				alloc, ok := sizes[k]
				if !ok {
					t.Fatalf("free at tid %d seq %d of %#x matches no allocation", tid, c.Seq, c.A0)
				}
				size := alloc.Size
				if alloc.Phase != fixture.PhaseRun {
					size = 0
					unknownFrees++
				}
				out[tid] = append(out[tid], Expected{"segment_free", c.A0, size, c})
			}
		}
	}
	return out, unknownFrees
}

// CallKey names a ground-truth call by thread and sequence number.
type CallKey struct{ Tid, Seq int }

// allocationSizesAtFree replays every call in the order their effects
// happened (an allocation takes effect before it returns, a free after it is
// entered: sorting mallocs by return time and frees by entry time is exact
// for pointers that are reused across threads) and returns, for each free,
// the allocation it freed.
func AllocationSizesAtFree(gt *fixture.GroundTruth) map[CallKey]fixture.Live {
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
	out := make(map[CallKey]fixture.Live)
	for _, s := range steps {
		if s.c.Func == fixture.FuncFree {
			if l, ok := live[s.c.A0]; ok {
				out[CallKey{s.c.Tid, s.c.Seq}] = l
				delete(live, s.c.A0)
			}
			continue
		}
		live[s.c.R0] = fixture.Live{Device: s.c.Device, Address: s.c.R0, Size: s.c.A0, Func: s.c.Func, Phase: s.c.Phase}
	}
	return out
}

// TimingStats summarises how far time_us lies from its call's interval.
type TimingStats struct {
	DistancesUs []float64 // 0 inside [before, after]
}

func (s *TimingStats) Quantile(q float64) float64 {
	if len(s.DistancesUs) == 0 {
		return 0
	}
	d := append([]float64(nil), s.DistancesUs...)
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
func MatchTrace(t testing.TB, trace []TraceEntry, want map[int][]Expected, slackUs int64) *TimingStats {
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
			t.Fatalf("thread %d: %d of %d Expected entries missing from the trace, first: %v",
				tid, len(list)-next[tid], len(list), list[next[tid]])
		}
	}
	// Replay the final choices for the timing statistics.
	stats := &TimingStats{}
	pos := make(map[int]int)
	for i, c := range choices {
		tid := c.cands[c.used]
		stats.DistancesUs = append(stats.DistancesUs, distanceUs(trace[i].TimeUs, want[tid][pos[tid]].call))
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

// checkGopickleAgrees loads path with gopickle and requires the result to
// equal what python3's pickle loaded (the checker's JSON dump), so two
// independent unpicklers read the same snapshot.
func checkGopickleAgrees(t testing.TB, path string, pythonJSON []byte) {
	t.Helper()
	v, err := pickle.Load(path)
	if err != nil {
		t.Fatalf("gopickle cannot load %s: %v", path, err)
	}
	fromGo, err := generic(v)
	if err != nil {
		t.Fatalf("gopickle result: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(pythonJSON))
	dec.UseNumber()
	var fromPy any
	if err := dec.Decode(&fromPy); err != nil {
		t.Fatal(err)
	}
	fromPy = fromJSON(fromPy)
	if !reflect.DeepEqual(fromGo, fromPy) {
		t.Fatalf("gopickle and python3 read %s differently", path)
	}
}

// generic turns gopickle's types into plain Go values.
func generic(v any) (any, error) {
	switch v := v.(type) {
	case *types.Dict:
		m := make(map[string]any, v.Len())
		for _, e := range *v {
			k, ok := e.Key.(string)
			if !ok {
				return nil, fmt.Errorf("dict key %T, want str", e.Key)
			}
			g, err := generic(e.Value)
			if err != nil {
				return nil, err
			}
			m[k] = g
		}
		return m, nil
	case *types.List:
		return genericSlice(*v)
	case *types.Tuple:
		return genericSlice(*v)
	case int:
		return int64(v), nil
	case *big.Int:
		if !v.IsInt64() {
			return nil, fmt.Errorf("integer %v out of int64 range", v)
		}
		return v.Int64(), nil
	case string, bool, float64, nil:
		return v, nil
	}
	return nil, fmt.Errorf("unexpected pickled type %T", v)
}

func genericSlice(items []any) (any, error) {
	out := make([]any, len(items))
	for i, it := range items {
		g, err := generic(it)
		if err != nil {
			return nil, err
		}
		out[i] = g
	}
	return out, nil
}

func fromJSON(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			v[k] = fromJSON(e)
		}
		return v
	case []any:
		for i, e := range v {
			v[i] = fromJSON(e)
		}
		return v
	case json.Number:
		if n, err := v.Int64(); err == nil {
			return n
		}
		f, _ := v.Float64()
		return f
	}
	return v
}

// checkWorkloadShape makes sure the ground truth exercises what the test
// claims: enough calls, several threads, pre-attach frees, one OOM.
func CheckWorkloadShape(t testing.TB, gt *fixture.GroundTruth, threads, calls int) {
	t.Helper()
	run, ooms, preFrees := 0, 0, 0
	tids := make(map[int]bool)
	sizes := AllocationSizesAtFree(gt)
	for _, c := range gt.Calls {
		if c.Phase != fixture.PhaseRun {
			continue
		}
		run++
		tids[c.Tid] = true
		if c.RC == fixture.ACLErrorRTMemoryAllocation {
			ooms++
		}
		if c.Func == fixture.FuncFree {
			if l := sizes[CallKey{c.Tid, c.Seq}]; l.Phase == fixture.PhasePre {
				preFrees++
			}
		}
	}
	if run < 10000 || run != calls {
		t.Fatalf("workload made %d calls after attach, want %d (at least 10,000)", run, calls)
	}
	if len(tids) < 2 || len(tids) != threads {
		t.Fatalf("calls came from %d threads, want %d", len(tids), threads)
	}
	if ooms != 1 {
		t.Fatalf("workload had %d OOMs, want 1", ooms)
	}
	if preFrees == 0 {
		t.Fatal("workload freed no pre-attach allocation")
	}
}

func CheckSegmentSnapshot(t testing.TB, gt *fixture.GroundTruth, snap *Snapshot) {
	t.Helper()
	var level string
	snap.Setting(t, "npuprobe_level", &level)
	if level != "segment" {
		t.Errorf("npuprobe_level = %q, want segment", level)
	}
	var dropped uint64
	snap.Setting(t, "npuprobe_dropped_events", &dropped)
	if dropped != 0 {
		t.Errorf("%d events dropped", dropped)
	}

	// Every run-phase call exactly once, per-thread order, exact values,
	// time within 50 µs of the call.
	if len(snap.DeviceTraces) != 1 {
		t.Fatalf("%d device traces, want 1 (device 0)", len(snap.DeviceTraces))
	}
	want, unknownFrees := SegmentExpectations(t, gt)
	stats := MatchTrace(t, snap.DeviceTraces[0], want, 50)
	t.Logf("%d entries matched; time_us distance to the call interval: median %.1f µs, p99.9 %.1f µs, max %.1f µs",
		len(stats.DistancesUs), stats.Quantile(0.5), stats.Quantile(0.999), stats.Quantile(1))

	var model struct {
		SegmentFreesSizeUnknown int `json:"segment_frees_size_unknown"`
		OOMs                    int `json:"ooms"`
		OOMDeviceFreeInferred   int `json:"oom_device_free_inferred"`
	}
	snap.Setting(t, "npuprobe_model", &model)
	if model.SegmentFreesSizeUnknown != unknownFrees {
		t.Errorf("metadata counts %d frees of unknown size, workload freed %d pre-attach allocations",
			model.SegmentFreesSizeUnknown, unknownFrees)
	}
	if model.OOMs != 1 || model.OOMDeviceFreeInferred != 0 {
		t.Errorf("metadata: %d OOMs, %d with inferred device_free; want 1 and 0", model.OOMs, model.OOMDeviceFreeInferred)
	}

	// Live segments: exactly the workload's live allocations made after
	// attach (those made before are invisible to a tracer that was not there).
	var wantLive []fixture.Live
	for _, l := range gt.Live {
		if l.Phase == fixture.PhaseRun {
			wantLive = append(wantLive, l)
		}
	}
	sort.Slice(wantLive, func(i, j int) bool { return wantLive[i].Address < wantLive[j].Address })
	if len(snap.Segments) != len(wantLive) {
		t.Fatalf("%d live segments, workload holds %d allocated after attach", len(snap.Segments), len(wantLive))
	}
	for i, s := range snap.Segments {
		l := wantLive[i]
		if s.Address != l.Address || s.TotalSize != l.Size || s.Device != l.Device {
			t.Fatalf("segment %d = {dev %d %#x size %d}, workload has {dev %d %#x size %d}",
				i, s.Device, s.Address, s.TotalSize, l.Device, l.Address, l.Size)
		}
		wantType := "large"
		if l.Size == 2<<20 {
			wantType = "small"
		}
		if s.SegmentType != wantType || len(s.Blocks) != 1 || s.Blocks[0].State != "inactive" || s.Blocks[0].Size != s.TotalSize {
			t.Fatalf("segment %d: type %s, blocks %+v; want %s with one inactive block of the full size", i, s.SegmentType, s.Blocks, wantType)
		}
	}
}

// allCallsExpected is segmentExpectations over every call, whatever its
// phase: for a workload that made no call before npuprobe was attached.
func AllCallsExpected(t testing.TB, gt *fixture.GroundTruth) map[int][]Expected {
	t.Helper()
	for i := range gt.Calls {
		gt.Calls[i].Phase = fixture.PhaseRun
	}
	for i := range gt.Live {
		gt.Live[i].Phase = fixture.PhaseRun
	}
	want, unknown := SegmentExpectations(t, gt)
	if unknown != 0 {
		t.Fatalf("%d frees of unknown allocations in a workload that allocated nothing before attach", unknown)
	}
	return want
}

// checkLiveSegments requires snap's segments to be the workload's live
// allocations of the run phase.
func CheckLiveSegments(t testing.TB, gt *fixture.GroundTruth, snap *Snapshot) {
	t.Helper()
	var want []fixture.Live
	for _, l := range gt.Live {
		if l.Phase == fixture.PhaseRun {
			want = append(want, l)
		}
	}
	sort.Slice(want, func(i, j int) bool { return want[i].Address < want[j].Address })
	if len(snap.Segments) != len(want) {
		t.Fatalf("%d live segments, the workload holds %d", len(snap.Segments), len(want))
	}
	for i, s := range snap.Segments {
		if s.Address != want[i].Address || s.TotalSize != want[i].Size || s.Device != want[i].Device {
			t.Fatalf("segment %d = {dev %d %#x %d}, workload has {dev %d %#x %d}",
				i, s.Device, s.Address, s.TotalSize, want[i].Device, want[i].Address, want[i].Size)
		}
	}
}
