package snapshot_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/snapshot/snaptest"
	"github.com/npuprobe/npuprobe/tests/fixture"
	"github.com/npuprobe/npuprobe/tests/snapshotcheck"
)

// TestReadFixtureTorchPickle: the fake torch_npu's own pickle (torch's C++
// pickler format: protocol 2, BINUNICODE/BINPUT, no time_us) reads as
// exactly the allocator's ground truth dumped at the same moment.
func TestReadFixtureTorchPickle(t *testing.T) {
	cases := map[string][]string{
		"churn with oom":          {"--pattern", "churn", "--steps", "1200", "--seed", "7", "--pre-attach-steps", "0"},
		"transformer two streams": {"--pattern", "transformer", "--steps", "4", "--streams", "2", "--pre-attach-steps", "0"},
	}
	for name, args := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			d := snaptest.TensorDump(t, snaptest.Fixtures(t), t.TempDir(), nil, args...)
			s, err := snapshot.ReadFile(d.Pickle)
			if err != nil {
				t.Fatal(err)
			}
			if s.Protocol != 2 || s.AllocatorSettings != nil || s.ExternalAnnotations.Set || len(s.Extra) != 0 {
				t.Errorf("protocol %d, settings %v, annotations %v, extra %v", s.Protocol, s.AllocatorSettings, s.ExternalAnnotations, s.Extra)
			}
			compareWithGroundTruth(t, s, d.GT)
			if name == "churn with oom" && countAction(s, "oom") == 0 {
				t.Error("no oom entry")
			}
			opcodes := pickleOpcodes(t, d.Pickle)
			for _, op := range []string{"PROTO", "BINUNICODE", "BINPUT", "BINGET", "LONG1", "TUPLE2", "SETITEMS", "APPENDS"} {
				if !opcodes[op] {
					t.Errorf("no %s opcode", op)
				}
			}
			for _, op := range []string{"FRAME", "MEMOIZE", "SHORT_BINUNICODE"} {
				if opcodes[op] {
					t.Errorf("%s opcode in a protocol-2 C++ pickle", op)
				}
			}
			check(t, d.Pickle, snapshotcheck.Options{})
			res, err := snapshotcheck.Check(t.Context(), d.Pickle, snapshotcheck.Options{ExpectTime: true})
			if err != nil {
				t.Fatal(err)
			}
			if res.OK || !strings.Contains(strings.Join(res.Problems, "\n"), "trace.time_missing") {
				t.Errorf("torch_npu's pickle passes --expect-time: %v", res.Problems)
			}
		})
	}
}

func countAction(s *snapshot.Snapshot, action string) int {
	n := 0
	for _, tr := range s.DeviceTraces {
		for _, e := range tr {
			if e.Action == action {
				n++
			}
		}
	}
	return n
}

// pickleOpcodes lists the opcodes of a pickle with python3's pickletools.
func pickleOpcodes(t *testing.T, path string) map[string]bool {
	t.Helper()
	out, err := exec.Command("python3", "-c", `import pickletools, sys
print(' '.join(sorted({op.name for op, _, _ in pickletools.genops(open(sys.argv[1], 'rb').read())})))`, path).CombinedOutput()
	if err != nil {
		t.Fatalf("pickletools: %v\n%s", err, out)
	}
	m := map[string]bool{}
	for _, op := range strings.Fields(string(out)) {
		m[op] = true
	}
	return m
}

func compareWithGroundTruth(t *testing.T, s *snapshot.Snapshot, gt *fixture.TorchGroundTruth) {
	t.Helper()
	if len(s.Segments) != len(gt.Segments) || len(s.DeviceTraces) != len(gt.DeviceTraces) {
		t.Fatalf("%d segments, %d devices; ground truth %d, %d", len(s.Segments), len(s.DeviceTraces), len(gt.Segments), len(gt.DeviceTraces))
	}
	for i, g := range gt.Segments {
		seg := s.Segments[i]
		if seg.Device != g.Device || seg.Address != int64(g.Address) || seg.TotalSize != int64(g.TotalSize) ||
			seg.AllocatedSize.V != int64(g.AllocatedSize) || seg.ActiveSize.V != int64(g.ActiveSize) ||
			seg.RequestedSize.V != int64(g.RequestedSize) || seg.Stream.V != int64(g.Stream) || seg.SegmentType.V != g.SegmentType ||
			seg.IsExpandable.V != g.IsExpandable || seg.SegmentPoolID.V != [2]int64{int64(g.SegmentPoolID[0]), int64(g.SegmentPoolID[1])} ||
			len(seg.Blocks) != len(g.Blocks) || seg.Frames.Set {
			t.Fatalf("segment %d = %+v, ground truth %+v", i, seg, g)
		}
		for j, gb := range g.Blocks {
			b := seg.Blocks[j]
			if b.Address.V != int64(gb.Address) || b.Size != int64(gb.Size) || b.RequestedSize.V != int64(gb.RequestedSize) || b.State != gb.State {
				t.Fatalf("segment %d block %d = %+v, ground truth %+v", i, j, b, gb)
			}
		}
	}
	entries := 0
	for d, tr := range gt.DeviceTraces {
		if len(s.DeviceTraces[d]) != len(tr) {
			t.Fatalf("device %d: %d entries, ground truth %d", d, len(s.DeviceTraces[d]), len(tr))
		}
		for k, g := range tr {
			e := s.DeviceTraces[d][k]
			addr := e.Addr
			want := g.Addr
			if g.Action == "oom" {
				addr, want = e.DeviceFree, g.DeviceFree
			}
			if e.Action != g.Action || !addr.Set || addr.V != int64(want) || e.Size != int64(g.Size) || e.Stream.V != int64(g.Stream) ||
				e.TimeUs.Set || e.PoolID != snapshot.Some([2]int64{int64(g.PoolID[0]), int64(g.PoolID[1])}) {
				t.Fatalf("device %d entry %d = %+v, ground truth %+v", d, k, e, g)
			}
			entries++
		}
	}
	if entries == 0 {
		t.Fatal("empty trace")
	}
}
