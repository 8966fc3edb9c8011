package snapshot_test

import (
	"errors"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/snapshot/snaptest"
	"github.com/npuprobe/npuprobe/tests/snapshotcheck"
)

const (
	segA = 0x100000000
	segB = 0x200000000
	segW = 0x300000000
	mib  = 1 << 20
)

func ent(action string, addr, size int64) snapshot.TraceEntry {
	e := snapshot.TraceEntry{Action: action, Size: size, Stream: snapshot.Some(int64(7)), PoolID: snapshot.Some([2]int64{0, 0})}
	if action == "oom" {
		e.DeviceFree = snapshot.Some(addr)
	} else {
		e.Addr = snapshot.Some(addr)
	}
	return e
}

func timed(e snapshot.TraceEntry, t int64) snapshot.TraceEntry {
	e.TimeUs = snapshot.Some(t)
	e.Stream = snapshot.Some(int64(0))
	return e
}

// TestAugmentUnmatchedRule shows the matching and the unmatched rule on a
// hand-made pair, entry by entry.
func TestAugmentUnmatchedRule(t *testing.T) {
	torch := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{
		ent("workspace_snapshot", segW, 4*mib), // 0  synthesized at dump: before the first match
		ent("segment_alloc", segW, 4*mib),      // 1
		ent("alloc", segW, 4*mib),              // 2
		ent("segment_alloc", segA, 2*mib),      // 3  exact
		ent("alloc", segA, 1000),               // 4  exact
		ent("alloc", segA+1536, 500),           // 5  not recorded: halfway between 4 and 6
		ent("free_requested", segA, 1000),      // 6  exact
		ent("free_completed", segA, 1000),      // 7  exact
		ent("snapshot", 0, 0),                  // 8  never recorded: 1/3 of the way from 7 to 10
		ent("segment_alloc", segB, 20*mib),     // 9  not recorded (lost): 2/3 of the way
		ent("oom", 5*mib, 40*mib),              // 10 relaxed: the recording's free bytes differ
		ent("segment_free", segA, 2*mib),       // 11 relaxed: the recording does not know the size
		ent("alloc", segA, 64),                 // 12 after the last match
	}, {
		ent("segment_alloc", segB+mib, 2*mib), // device 1: absent from the recording
	}}}
	rec := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{
		timed(ent("segment_alloc", segB+64*mib, 2*mib), 900), // before torch's window
		timed(ent("segment_alloc", segA, 2*mib), 1000),
		timed(ent("alloc", segA, 1000), 1010),
		timed(ent("free_requested", segA, 1000), 1020),
		timed(ent("free_completed", segA, 1000), 1020),
		timed(ent("oom", 9*mib, 40*mib), 1100),
		timed(ent("segment_free", segA, 0), 1200),
	}}}
	out, r, err := snapshot.Augment(torch, rec, "rec.pickle")
	if err != nil {
		t.Fatal(err)
	}
	want := []int64{1000, 1000, 1000, 1000, 1010, 1015, 1020, 1020, 1046, 1073, 1100, 1200, 1200}
	var got []int64
	for _, e := range out.DeviceTraces[0] {
		got = append(got, e.TimeUs.V)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("times\n got  %v\n want %v", got, want)
	}
	if out.DeviceTraces[1][0].TimeUs != snapshot.Some(int64(1000)) {
		t.Errorf("device without a recording: %v, want the earliest matched time 1000", out.DeviceTraces[1][0].TimeUs)
	}
	if torch.DeviceTraces[0][0].TimeUs.Set {
		t.Error("Augment changed its input")
	}
	if r.RecordingLevel != "tensor" || r.Entries != 14 || r.Matched != 4 || r.MatchedRelaxed != 2 || r.Interpolated != 3 || r.Extrapolated != 5 {
		t.Errorf("report %+v", r)
	}
	wantReasons := map[string]int{
		snapshot.ReasonWorkspace:                     3,
		snapshot.ReasonNotRecorded:                   3,
		snapshot.ReasonNeverRecorded + " (snapshot)": 1,
		snapshot.ReasonNoDevice:                      1,
	}
	if !reflect.DeepEqual(r.Unmatched, wantReasons) {
		t.Errorf("reasons %v, want %v", r.Unmatched, wantReasons)
	}
	a, ok := out.Setting("npuprobe_augment")
	if d, isDict := a.(*snapshot.Dict); !ok || !isDict {
		t.Fatalf("npuprobe_augment = %#v", a)
	} else if m, _ := d.Get("matched"); m != int64(4) {
		t.Errorf("npuprobe_augment.matched = %v", m)
	}

	// The same pair with a segment-level recording: tensor entries are
	// not matchable and get interpolated times.
	segRec := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{
		timed(ent("segment_alloc", segA, 2*mib), 1000),
		timed(ent("oom", 9*mib, 40*mib), 1100),
		timed(ent("segment_free", segA, 0), 1200),
	}}}
	out, r, err = snapshot.Augment(torch, segRec, "seg.pickle")
	if err != nil {
		t.Fatal(err)
	}
	got = got[:0]
	for _, e := range out.DeviceTraces[0] {
		got = append(got, e.TimeUs.V)
	}
	// 3 matched (1000); 4..9 between 3 and 10 (1000 → 1100 over 7 steps).
	want = []int64{1000, 1000, 1000, 1000, 1014, 1028, 1042, 1057, 1071, 1085, 1100, 1200, 1200}
	if !reflect.DeepEqual(got, want) || r.RecordingLevel != "segment" || r.Unmatched[snapshot.ReasonSegmentLevel] != 5 {
		t.Errorf("segment level: times %v (want %v), report %+v", got, want, r)
	}
}

// A recording whose times go backwards (not npuprobe's) loses the matches
// that would make time decrease; they are interpolated instead.
func TestAugmentConflictingTimes(t *testing.T) {
	torch := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{
		ent("segment_alloc", segA, 2*mib), ent("alloc", segA, 1000), ent("free_requested", segA, 1000), ent("free_completed", segA, 1000),
	}}}
	rec := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{
		timed(ent("segment_alloc", segA, 2*mib), 1000), timed(ent("alloc", segA, 1000), 1100),
		timed(ent("free_requested", segA, 1000), 1020), timed(ent("free_completed", segA, 1000), 1020),
	}}}
	out, r, err := snapshot.Augment(torch, rec, "x")
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, e := range out.DeviceTraces[0] {
		got = append(got, e.TimeUs.V)
	}
	if want := []int64{1000, 1010, 1020, 1020}; !reflect.DeepEqual(got, want) || r.Matched != 3 || r.Unmatched[snapshot.ReasonConflict] != 1 {
		t.Errorf("times %v (want %v), report %+v", got, want, r)
	}
}

func TestAugmentNothingMatched(t *testing.T) {
	torch := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{ent("segment_alloc", segA, 2*mib)}}}
	rec := &snapshot.Snapshot{DeviceTraces: [][]snapshot.TraceEntry{{timed(ent("segment_alloc", segB, 2*mib), 5)}}}
	if _, _, err := snapshot.Augment(torch, rec, "x"); !errors.Is(err, snapshot.ErrNothingMatched) {
		t.Fatalf("err %v", err)
	}
}

// TestAugmentFixtureWindows: the fixture's torch_npu pickle against a
// perfect recording (its own ground truth with time), and against windows
// of it that start later, end earlier and lost entries: every entry of the
// torch snapshot that the recording holds gets exactly that entry's time.
func TestAugmentFixtureWindows(t *testing.T) {
	dir := t.TempDir()
	d := snaptest.TensorDump(t, snaptest.Fixtures(t), dir, nil, "--pattern", "churn", "--steps", "2500", "--seed", "3", "--pre-attach-steps", "0")
	torch, err := snapshot.ReadFile(d.Pickle)
	if err != nil {
		t.Fatal(err)
	}
	truth := snaptest.FromGroundTruth(d.GT) // same entries, same order, with time
	full := truth.DeviceTraces[0]
	n := len(full)
	if n < 1000 {
		t.Fatalf("only %d entries", n)
	}
	cases := []struct {
		name     string
		from, to int   // the recording's window of the truth
		drop     []int // entries lost inside the window
	}{
		{"perfect", 0, n, nil},
		{"starts later", n / 3, n, nil},
		{"ends earlier", 0, 2 * n / 3, nil},
		{"inside, with losses", n / 4, 3 * n / 4, []int{n/4 + 10, n / 2, n/2 + 1, n/2 + 2, 3*n/4 - 5}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rec := *truth
			lost := map[int]bool{}
			var tr []snapshot.TraceEntry
			var truthIdx []int
			for i := c.from; i < c.to; i++ {
				if contains(c.drop, i) {
					lost[i] = true
					continue
				}
				tr = append(tr, full[i])
				truthIdx = append(truthIdx, i)
			}
			rec.DeviceTraces = [][]snapshot.TraceEntry{tr}
			out, r, err := snapshot.Augment(torch, &rec, "rec")
			if err != nil {
				t.Fatal(err)
			}
			wrong := 0
			for i, e := range out.DeviceTraces[0] {
				inWindow := i >= c.from && i < c.to && !lost[i]
				if inWindow && e.TimeUs.V != full[i].TimeUs.V {
					wrong++
					if wrong < 5 {
						t.Errorf("entry %d (%s %#x %d): time %d, recording has %d", i, e.Action, e.AddrOrFree(), e.Size, e.TimeUs.V, full[i].TimeUs.V)
					}
				}
				if i > 0 && e.TimeUs.V < out.DeviceTraces[0][i-1].TimeUs.V {
					t.Fatalf("time decreases at %d", i)
				}
			}
			if wrong > 0 {
				t.Fatalf("%d of %d recorded entries got another time", wrong, len(tr))
			}
			if r.Matched != len(tr) || r.Matched+r.Interpolated+r.Extrapolated != n {
				t.Errorf("report %+v, want %d matched of %d", r, len(tr), n)
			}
			path := filepath.Join(t.TempDir(), "augmented.pickle")
			if err := snapshot.WriteFile(path, out); err != nil {
				t.Fatal(err)
			}
			check(t, path, snapshotcheck.Options{ExpectTime: true})
		})
	}
}

func contains(xs []int, x int) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}
