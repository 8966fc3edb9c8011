package e2e

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// tensorRun is one traced run of the fake torch_npu workload.
type tensorRun struct {
	w     *workload
	a     *agentProc
	pre   *fixture.TorchGroundTruth // ground truth when npuprobe attached
	final *fixture.TorchGroundTruth // ground truth at the snapshot
	snap  *Snapshot
	path  string
}

// runTensorWorkload starts tensor_workload against the libtorch_npu.so in
// torchDir, attaches npuprobe with agentArgs, lets the workload run, and
// takes a snapshot and the workload's own ground truth at the same point.
func runTensorWorkload(t *testing.T, torchDir string, env []string, agentArgs []string, workloadArgs ...string) *tensorRun {
	t.Helper()
	env = append(append([]string(nil), fixtures.TorchEnv(torchDir)...), env...)
	w := startProgram(t, fixtures.TensorWorkload, env, "", workloadArgs...)
	r := &tensorRun{w: w}
	r.pre = dumpTorchGroundTruth(t, w)
	args := append([]string{"--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--status-interval", "100ms"}, agentArgs...)
	r.a = startAgent(t, args...)
	w.send("go")
	w.expectLine("done", 5*time.Minute)
	r.path = r.a.snapshot()
	r.final = dumpTorchGroundTruth(t, w)
	r.snap = loadSnapshot(t, r.path)
	return r
}

func dumpTorchGroundTruth(t *testing.T, w *workload) *fixture.TorchGroundTruth {
	t.Helper()
	path := filepath.Join(t.TempDir(), fmt.Sprintf("gt-%d.json", time.Now().UnixNano()))
	w.send("dump " + path)
	w.expectLine("dumped", time.Minute)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gt, err := fixture.ParseTorchGroundTruth(f)
	if err != nil {
		t.Fatal(err)
	}
	return gt
}

// TestTensorLevelMatchesGroundTruth: attached before the first allocation,
// npuprobe's snapshot equals the fake allocator's own snapshot exactly:
// segments, block tiling, states, sizes, requested sizes, streams, and
// every trace entry in order.
func TestTensorLevelMatchesGroundTruth(t *testing.T) {
	cases := []struct {
		name string
		env  []string
		args []string
	}{
		{"transformer two streams", nil, []string{"--pattern", "transformer", "--steps", "12", "--streams", "2"}},
		{"churn with OOM", nil, []string{"--pattern", "churn", "--steps", "3000", "--seed", "7"}},
		{"allocator options", []string{"PYTORCH_NPU_ALLOC_CONF=max_split_size_mb:40,roundup_power2_divisions:4"},
			[]string{"--pattern", "churn", "--steps", "2500", "--seed", "11", "--streams", "2"}},
		{"PYTORCH_ALLOC_CONF list form", []string{"PYTORCH_ALLOC_CONF=roundup_power2_divisions:[1:2,64:8,>:4],max_split_size_mb:64"},
			[]string{"--pattern", "transformer", "--steps", "8"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := runTensorWorkload(t, fixtures.TorchSymtabDir, c.env, nil, append(c.args, "--pre-attach-steps", "0")...)
			checkLevel(t, r.snap, "tensor")
			if len(r.pre.Segments) != 0 {
				t.Fatalf("the workload allocated before attach: %d segments", len(r.pre.Segments))
			}
			compareTensorSnapshot(t, r.final, r.snap, nil)
			if c.env != nil {
				var conf struct{ Source, Value string }
				r.snap.Setting(t, "npuprobe_alloc_conf", &conf)
				name, value, _ := strings.Cut(c.env[0], "=")
				if conf.Source != name || conf.Value != value {
					t.Errorf("npuprobe_alloc_conf = %+v, want %s=%s", conf, name, value)
				}
			}
		})
	}
}

// TestTensorLevelMidRunAttach: attached while the workload runs, the
// snapshot is consistent (the checker replays it), counts the frees of
// tensors it never saw allocated, and equals the ground truth restricted to
// segments created after attach.
func TestTensorLevelMidRunAttach(t *testing.T) {
	for _, pattern := range []string{"transformer", "churn"} {
		t.Run(pattern, func(t *testing.T) {
			steps := map[string][]string{"transformer": {"--pre-attach-steps", "4", "--steps", "10"},
				"churn": {"--pre-attach-steps", "800", "--steps", "2000", "--seed", "3"}}[pattern]
			r := runTensorWorkload(t, fixtures.TorchSymtabDir, nil, nil, append([]string{"--pattern", pattern}, steps...)...)
			if len(r.pre.Segments) == 0 {
				t.Fatal("nothing was allocated before attach")
			}
			restricted, unseenFrees := restrictToPostAttach(t, r.pre, r.final)
			compareTensorSnapshot(t, restricted, r.snap, nil)

			var model struct {
				TensorFreesBeforeAttach uint64 `json:"tensor_frees_before_attach"`
			}
			r.snap.Setting(t, "npuprobe_model", &model)
			if model.TensorFreesBeforeAttach != unseenFrees || unseenFrees == 0 {
				t.Errorf("metadata counts %d frees of pre-attach tensors, the ground truth has %d (want > 0)",
					model.TensorFreesBeforeAttach, unseenFrees)
			}
			r.a.expect(regexp.MustCompile(fmt.Sprintf(`, %d frees of pre-attach tensors, `, unseenFrees)), 10*time.Second)
		})
	}
}

// TestTensorLevelFromDebugFile: a stripped libtorch_npu.so with a separate
// debug file gives the same result as the unstripped one, whether the file
// is found by build-id (--debug-dir) or by .gnu_debuglink next to the
// library.
func TestTensorLevelFromDebugFile(t *testing.T) {
	cases := []struct {
		name      string
		agentArgs []string
		source    string
	}{
		{"build-id", []string{"--debug-dir", fixtures.DebugDir, "--level", "tensor"}, "build-id debug file " + fixtures.DebugDir},
		{"debuglink", []string{"--level", "tensor"}, "debuglink debug file " + fixtures.TorchDebuglinkDir + "/.debug/libtorch_npu.so.debug"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := runTensorWorkload(t, fixtures.TorchDebuglinkDir, nil, c.agentArgs,
				"--pattern", "transformer", "--steps", "6", "--streams", "2", "--pre-attach-steps", "0")
			checkLevel(t, r.snap, "tensor")
			var src string
			r.snap.Setting(t, "npuprobe_symbols", &src)
			if !strings.HasPrefix(src, c.source) {
				t.Errorf("symbols from %q, want %q", src, c.source)
			}
			compareTensorSnapshot(t, r.final, r.snap, nil)
		})
	}
}

// TestTensorLevelStrippedFallsBack: with no symbols anywhere, npuprobe says
// so in one line and traces segments, which still match.
func TestTensorLevelStrippedFallsBack(t *testing.T) {
	env := fixtures.TorchEnv(fixtures.TorchStrippedDir)
	w := startProgram(t, fixtures.TensorWorkload, env, "", "--pattern", "churn", "--steps", "1500", "--seed", "5", "--pre-attach-steps", "0")
	a := runAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir())
	notice := a.expect(regexp.MustCompile(`^npuprobe: tensor level unavailable for process \d+: .*libtorch_npu.so has no symbol for NpuCachingAllocator::allocate .*tracing segments only \(.*--debug-dir DIR\)$`), 30*time.Second)
	if len(notice) == 0 {
		t.Fatal("no notice")
	}
	a.expect(regexp.MustCompile(`^npuprobe: tracing`), 30*time.Second)
	w.send("go")
	w.expectLine("done", 5*time.Minute)
	snap := loadSnapshot(t, a.snapshot())
	gt := dumpTorchGroundTruth(t, w)
	checkLevel(t, snap, "segment")

	// Segments: same ranges and pools; one inactive block each.
	if len(snap.Segments) != len(gt.Segments) {
		t.Fatalf("%d segments, ground truth has %d", len(snap.Segments), len(gt.Segments))
	}
	for i, s := range snap.Segments {
		g := gt.Segments[i]
		if s.Device != g.Device || s.Address != g.Address || s.TotalSize != g.TotalSize || s.SegmentType != g.SegmentType {
			t.Fatalf("segment %d = {dev %d %#x %d %s}, ground truth {dev %d %#x %d %s}",
				i, s.Device, s.Address, s.TotalSize, s.SegmentType, g.Device, g.Address, g.TotalSize, g.SegmentType)
		}
	}
	// The segment entries, in order.
	var got, want []string
	for _, e := range snap.DeviceTraces[0] {
		if strings.HasPrefix(e.Action, "segment_") {
			got = append(got, fmt.Sprintf("%s %#x %d", e.Action, *e.Addr, e.Size))
		}
	}
	for _, e := range gt.DeviceTraces[0] {
		if strings.HasPrefix(e.Action, "segment_") {
			want = append(want, fmt.Sprintf("%s %#x %d", e.Action, e.Addr, e.Size))
		}
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("segment entries differ: %d recorded, %d in the ground truth", len(got), len(want))
	}
}

func checkLevel(t *testing.T, snap *Snapshot, want string) {
	t.Helper()
	var level string
	snap.Setting(t, "npuprobe_level", &level)
	if level != want {
		t.Fatalf("npuprobe_level = %q, want %q", level, want)
	}
}

// compareTensorSnapshot requires snap to equal the ground truth: every
// segment and block field, and every trace entry (action, address or
// device_free, size, stream) in order, with time_us close to the time the
// allocator recorded the event.
func compareTensorSnapshot(t *testing.T, gt *fixture.TorchGroundTruth, snap *Snapshot, _ any) {
	t.Helper()
	if len(snap.Segments) != len(gt.Segments) {
		t.Fatalf("%d segments, ground truth has %d", len(snap.Segments), len(gt.Segments))
	}
	for i, s := range snap.Segments {
		g := gt.Segments[i]
		got := fmt.Sprintf("dev %d %#x size %d alloc %d active %d req %d stream %#x %s exp %v",
			s.Device, s.Address, s.TotalSize, s.AllocatedSize, s.ActiveSize, s.RequestedSize, s.Stream, s.SegmentType, s.IsExpandable)
		want := fmt.Sprintf("dev %d %#x size %d alloc %d active %d req %d stream %#x %s exp %v",
			g.Device, g.Address, g.TotalSize, g.AllocatedSize, g.ActiveSize, g.RequestedSize, g.Stream, g.SegmentType, g.IsExpandable)
		if got != want {
			t.Fatalf("segment %d:\n got  %s\n want %s", i, got, want)
		}
		if len(s.Blocks) != len(g.Blocks) {
			t.Fatalf("segment %d (%#x): %d blocks, ground truth %d:\n got  %+v\n want %+v", i, s.Address, len(s.Blocks), len(g.Blocks), s.Blocks, g.Blocks)
		}
		for j, b := range s.Blocks {
			gb := g.Blocks[j]
			if b.Address != gb.Address || b.Size != gb.Size || b.RequestedSize != gb.RequestedSize || b.State != gb.State {
				t.Fatalf("segment %d (%#x) block %d: got %+v, want %+v", i, s.Address, j, b, gb)
			}
		}
	}
	devices := max(len(snap.DeviceTraces), len(gt.DeviceTraces))
	var diffsUs []float64
	byAction := make(map[string][]float64)
	total := 0
	for d := 0; d < devices; d++ {
		var got []TraceEntry
		var want []fixture.TorchTraceEntry
		if d < len(snap.DeviceTraces) {
			got = snap.DeviceTraces[d]
		}
		if d < len(gt.DeviceTraces) {
			want = gt.DeviceTraces[d]
		}
		n := min(len(got), len(want))
		for k := 0; k < n; k++ {
			e, g := got[k], want[k]
			var addr uint64
			if e.Action == "oom" && e.DeviceFree != nil {
				addr = *e.DeviceFree
			} else if e.Addr != nil {
				addr = *e.Addr
			}
			gAddr := g.Addr
			if g.Action == "oom" {
				gAddr = g.DeviceFree
			}
			if e.Action != g.Action || addr != gAddr || e.Size != g.Size || e.Stream != g.Stream {
				t.Fatalf("device %d entry %d of %d:\n got  %s %#x size %d stream %#x\n want %s %#x size %d stream %#x\ncontext: %s",
					d, k, len(want), e.Action, addr, e.Size, e.Stream, g.Action, gAddr, g.Size, g.Stream, traceContext(want, k))
			}
			diffsUs = append(diffsUs, math.Abs(float64(e.TimeUs)-float64(g.TimeNs)/1000))
			byAction[e.Action] = append(byAction[e.Action], float64(e.TimeUs)-float64(g.TimeNs)/1000)
		}
		if len(got) != len(want) {
			t.Fatalf("device %d: %d entries, ground truth %d (first difference at %d)", d, len(got), len(want), n)
		}
		total += n
	}
	if total == 0 {
		t.Fatal("empty trace")
	}
	sort.Float64s(diffsUs)
	q := func(p float64) float64 { return diffsUs[int(p*float64(len(diffsUs)-1))] }
	t.Logf("%d trace entries equal the ground truth; |time_us − allocator's time|: median %.1f µs, p99 %.1f µs, max %.1f µs",
		total, q(0.5), q(0.99), q(1))
	for action, d := range byAction {
		sort.Float64s(d)
		t.Logf("  %s: time_us − allocator's time: median %+.1f µs, p1 %+.1f, p99 %+.1f", action, d[len(d)/2], d[len(d)/100], d[len(d)*99/100])
	}
	// time_us is stamped where the probe fires (allocate's return, the
	// deleter's entry, the runtime call's return), the allocator stamps
	// inside the call: they differ by the rest of the call, which includes
	// the uprobe's own trap (about 10 µs on this VM). These bounds only
	// catch wrong clocks and units; accuracy against call intervals is
	// what the segment-level and clock tests assert.
	if q(0.99) > 250 || q(1) > 50_000 {
		t.Errorf("time_us too far from the allocator's own clock: p99 %.1f µs, max %.1f µs", q(0.99), q(1))
	}
}

func traceContext(want []fixture.TorchTraceEntry, k int) string {
	var b strings.Builder
	for i := max(0, k-3); i < min(len(want), k+3); i++ {
		fmt.Fprintf(&b, "\n   [%d] %s %#x %d", i, want[i].Action, want[i].Addr, want[i].Size)
	}
	return b.String()
}

// restrictToPostAttach keeps, of the final ground truth, the segments
// created after attach (after the pre dump) and the trace entries that
// concern them (plus oom entries), and counts the frees the restriction
// drops: frees of tensors npuprobe cannot have seen allocated.
func restrictToPostAttach(t *testing.T, pre, final *fixture.TorchGroundTruth) (*fixture.TorchGroundTruth, uint64) {
	t.Helper()
	out := &fixture.TorchGroundTruth{Config: final.Config}
	var unseenFrees uint64
	live := make(map[uint64]*gtSegment)
	for d, trace := range final.DeviceTraces {
		preLen := 0
		if d < len(pre.DeviceTraces) {
			preLen = len(pre.DeviceTraces[d])
		}
		idx, unseen := postAttachEntries(trace, preLen, live)
		unseenFrees += unseen
		kept := make([]fixture.TorchTraceEntry, 0, len(idx))
		for _, i := range idx {
			kept = append(kept, trace[i])
		}
		out.DeviceTraces = append(out.DeviceTraces, kept)
	}
	for _, s := range final.Segments {
		if l := live[s.Address]; l != nil && l.post {
			out.Segments = append(out.Segments, s)
		}
	}
	return out, unseenFrees
}

// gtSegment is a ground-truth segment as postAttachEntries tracks it.
type gtSegment struct {
	size uint64
	post bool // created after attach
}

// postAttachEntries returns the indices of trace's entries from preLen on
// (after attach) that concern segments created after attach, and its oom
// entries; and how many frees it left out (of tensors npuprobe cannot have
// seen allocated). live holds the segments alive so far, by address, and
// is updated: devices share one address space.
func postAttachEntries(trace []fixture.TorchTraceEntry, preLen int, live map[uint64]*gtSegment) (kept []int, unseenFrees uint64) {
	owner := func(addr uint64) *gtSegment {
		for base, s := range live {
			if addr >= base && addr < base+s.size {
				return s
			}
		}
		return nil
	}
	for i, e := range trace {
		post := i >= preLen
		switch e.Action {
		case "segment_alloc":
			live[e.Addr] = &gtSegment{size: e.Size, post: post}
			if post {
				kept = append(kept, i)
			}
		case "segment_free":
			if s := live[e.Addr]; s != nil && s.post && post {
				kept = append(kept, i)
			}
			delete(live, e.Addr)
		case "oom":
			if post {
				kept = append(kept, i)
			}
		default:
			if !post {
				continue
			}
			if s := owner(e.Addr); s != nil && s.post {
				kept = append(kept, i)
			} else if e.Action == "free_requested" {
				unseenFrees++
			}
		}
	}
	return kept, unseenFrees
}
