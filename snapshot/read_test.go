package snapshot_test

import (
	"bytes"
	"errors"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/output"
	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/snapshot/snaptest"
	"github.com/npuprobe/npuprobe/tests/snapshotcheck"
)

func TestMain(m *testing.M) { os.Exit(snaptest.Main(m)) }

const (
	exSeg    = 0x12C040000000
	exStream = 0xAAAAD1E2F3A0
	exT0     = 1767225600000000
)

// npuprobeExample is the spec's worked example (§13) as the model holds it,
// plus an oom on a second device.
func npuprobeExample() (*allocmodel.Snapshot, []output.Setting) {
	entry := func(a allocmodel.Action, addr, size uint64, dt int64) allocmodel.TraceEntry {
		return allocmodel.TraceEntry{MonoNs: 1000 + dt, TimeUs: exT0 + dt, Action: a, Addr: addr, Size: size, Stream: exStream}
	}
	snap := &allocmodel.Snapshot{
		Level: allocmodel.LevelTensor,
		Segments: []allocmodel.Segment{{
			Device: 0, Address: exSeg, TotalSize: 2097152, Stream: exStream, Type: allocmodel.SegmentSmall,
			Blocks: []allocmodel.Block{
				{Address: exSeg, Size: 4608, RequestedSize: 4096, State: allocmodel.BlockInactive},
				{Address: exSeg + 0x1200, Size: 1536, RequestedSize: 1000, State: allocmodel.BlockActiveAllocated},
				{Address: exSeg + 0x1800, Size: 2091008, RequestedSize: 0, State: allocmodel.BlockInactive},
			},
		}},
		Traces: [][]allocmodel.TraceEntry{{
			entry(allocmodel.ActionSegmentAlloc, exSeg, 2097152, 0),
			entry(allocmodel.ActionAlloc, exSeg, 4096, 12),
			entry(allocmodel.ActionAlloc, exSeg+0x1200, 1000, 40),
			entry(allocmodel.ActionFreeRequested, exSeg, 4096, 95),
			entry(allocmodel.ActionFreeCompleted, exSeg, 4096, 95),
		}, {
			entry(allocmodel.ActionOOM, 5<<20, 40<<20, 120),
		}},
		Pools: []allocmodel.PoolID{{0, 0}},
	}
	settings := []output.Setting{
		{Key: "npuprobe_level", Value: "tensor"},
		{Key: "npuprobe_dropped_events", Value: uint64(3)},
		{Key: "npuprobe_loss", Value: []output.Setting{{Key: "ring_buffer_full", Value: uint64(3)}, {Key: "ratio", Value: 0.5}}},
		{Key: "note", Value: nil},
	}
	return snap, settings
}

// TestReadNpuprobeOutput: what output.WriteSnapshot writes reads back field
// for field, and writing it again gives the same bytes.
func TestReadNpuprobeOutput(t *testing.T) {
	model, settings := npuprobeExample()
	var buf bytes.Buffer
	if err := output.WriteSnapshot(&buf, model, settings); err != nil {
		t.Fatal(err)
	}
	s, err := snapshot.Decode(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if s.Protocol != 4 || len(s.Segments) != 1 || len(s.DeviceTraces) != 2 {
		t.Fatalf("protocol %d, %d segments, %d traces", s.Protocol, len(s.Segments), len(s.DeviceTraces))
	}
	seg := s.Segments[0]
	if seg.Device != 0 || seg.Address != exSeg || seg.TotalSize != 2097152 || seg.AllocatedSize.V != 1536 ||
		seg.ActiveSize.V != 1536 || seg.RequestedSize.V != 1000 || seg.Stream.V != exStream ||
		seg.SegmentType.V != "small" || seg.SegmentPoolID != snapshot.Some([2]int64{0, 0}) || !seg.IsExpandable.Set ||
		seg.IsExpandable.V || !seg.Frames.Set || len(seg.Frames.V) != 0 || len(seg.Blocks) != 3 || len(seg.Extra) != 0 {
		t.Fatalf("segment %+v", seg)
	}
	for i, b := range model.Segments[0].Blocks {
		got := seg.Blocks[i]
		if got.Address.V != int64(b.Address) || got.Size != int64(b.Size) || got.RequestedSize.V != int64(b.RequestedSize) ||
			got.State != b.State.String() || !got.Frames.Set {
			t.Errorf("block %d = %+v, want %+v", i, got, b)
		}
	}
	for d, tr := range model.Traces {
		for k, want := range tr {
			got := s.DeviceTraces[d][k]
			addr := got.Addr
			if want.Action == allocmodel.ActionOOM {
				addr = got.DeviceFree
				if got.Addr.Set {
					t.Errorf("oom entry has addr")
				}
			}
			if got.Action != want.Action.String() || addr.V != int64(want.Addr) || !addr.Set || got.Size != int64(want.Size) ||
				got.Stream.V != exStream || got.TimeUs != snapshot.Some(want.TimeUs) || got.PoolID != snapshot.Some([2]int64{0, 0}) {
				t.Errorf("entry %d/%d = %+v, want %+v", d, k, got, want)
			}
		}
	}
	if v, _ := s.Setting("npuprobe_dropped_events"); v != int64(3) {
		t.Errorf("npuprobe_dropped_events = %v", v)
	}
	loss, _ := s.Setting("npuprobe_loss")
	if d, ok := loss.(*snapshot.Dict); !ok || len(d.Items) != 2 || d.Items[1].Value != 0.5 {
		t.Errorf("npuprobe_loss = %#v", loss)
	}
	if v, ok := s.Setting("note"); !ok || v != nil {
		t.Errorf("note = %v, %v", v, ok)
	}

	var again bytes.Buffer
	if err := snapshot.Write(&again, s); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(again.Bytes(), buf.Bytes()) {
		t.Errorf("rewriting changed the bytes (%d → %d)", buf.Len(), again.Len())
	}
}

// makePickles runs testdata/make_pickles.py into a new directory.
func makePickles(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	out, err := exec.Command("python3", filepath.Join(testdataDir(), "make_pickles.py"), dir).CombinedOutput()
	if err != nil {
		t.Fatalf("make_pickles.py: %v\n%s", err, out)
	}
	return dir
}

func testdataDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "testdata")
}

// pythonEqual requires python3's pickle to load a and b to equal objects.
func pythonEqual(t *testing.T, a, b string) {
	t.Helper()
	script := `import pickle, sys
a = pickle.load(open(sys.argv[1], 'rb')); b = pickle.load(open(sys.argv[2], 'rb'))
if a != b:
    sys.exit('differ:\n%r\n%r' % (a, b))
`
	if out, err := exec.Command("python3", "-c", script, a, b).CombinedOutput(); err != nil {
		t.Fatalf("python3 reads %s and %s differently: %v\n%s", a, b, err, out)
	}
}

func check(t *testing.T, path string, opts snapshotcheck.Options) {
	t.Helper()
	res, err := snapshotcheck.Check(t.Context(), path, opts)
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK {
		t.Fatalf("check_snapshot.py rejects %s:\n%s", path, strings.Join(res.Problems, "\n"))
	}
}

// TestReadPythonPickles: pickles made by python3 (protocols 2 and 4) read,
// and written back they load in python3 as the same object.
func TestReadPythonPickles(t *testing.T) {
	dir := makePickles(t)
	for _, name := range []string{"good_cuda_p2", "good_cuda_p4", "good_exotic_p2", "good_exotic_p4", "good_torchnpu_p4"} {
		t.Run(name, func(t *testing.T) {
			in := filepath.Join(dir, name+".pickle")
			s, err := snapshot.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			if want := int(name[len(name)-1] - '0'); s.Protocol != want {
				t.Errorf("protocol %d, want %d", s.Protocol, want)
			}
			out := filepath.Join(t.TempDir(), "rewritten.pickle")
			if err := snapshot.WriteFile(out, s); err != nil {
				t.Fatal(err)
			}
			pythonEqual(t, in, out)
			switch {
			case strings.HasPrefix(name, "good_cuda"):
				check(t, out, snapshotcheck.Options{ExpectTime: true})
				oom := s.DeviceTraces[1][1]
				if oom.Action != "oom" || oom.Addr.Set || oom.DeviceFree.V != 123<<20 || oom.Size != 40<<20 {
					t.Errorf("oom entry %+v", oom)
				}
				e := s.DeviceTraces[0][2]
				if !e.Frames.Set || len(e.Frames.V) != 2 || e.Frames.V[1].Name != "linear" || e.Frames.V[1].Line.V != 11 ||
					e.TimeUs.V != exT0+40 || len(e.Extra) != 2 || e.Extra[0].Key != "compile_context" {
					t.Errorf("entry %+v", e)
				}
				if !s.ExternalAnnotations.Set || len(s.ExternalAnnotations.V) != 2 {
					t.Errorf("external_annotations %+v", s.ExternalAnnotations)
				}
			case strings.HasPrefix(name, "good_exotic"):
				t3, _ := s.Setting("t3")
				if !reflect.DeepEqual(t3, snapshot.Tuple{int64(1), "a", 2.5}) {
					t.Errorf("t3 = %#v", t3)
				}
				if v, _ := s.AllocatorSettings.Get("big"); v != int64(1<<52+3) {
					t.Errorf("big = %v", v)
				}
				found := false
				for _, it := range s.AllocatorSettings.Items {
					found = found || it.Key == int64(7)
				}
				if !found || len(s.Extra) != 1 || s.Extra[0].Key != "future_key" {
					t.Errorf("int key %v, extra %+v", found, s.Extra)
				}
			case name == "good_torchnpu_p4":
				check(t, out, snapshotcheck.Options{})
				if s.AllocatorSettings != nil || s.DeviceTraces[0][0].TimeUs.Set || s.DeviceTraces[0][0].Action != "workspace_snapshot" {
					t.Errorf("torch_npu snapshot read as %+v", s)
				}
			}
		})
	}
}

// TestReadBadFiles: every broken file gives one FormatError line naming the
// file and the problem.
func TestReadBadFiles(t *testing.T) {
	dir := makePickles(t)
	cases := map[string]string{
		"bad_truncated.pickle":        "truncated pickle",
		"bad_truncated_header.pickle": "truncated pickle",
		"bad_empty.pickle":            "empty file",
		"bad_proto5.pickle":           "pickle protocol 5: memory snapshots are pickle protocol 2 to 4",
		"bad_proto1.pickle":           "pickle protocol 0 or 1",
		"bad_garbage.pickle":          "not a pickle (starts with bytes 07 08",
		"bad_trailing.pickle":         "4 bytes after its end",
		"bad_json.json":               "looks like JSON",
		"bad_class.pickle":            "pickle opcode STACK_GLOBAL",
		"bad_bytes.pickle":            "pickle opcode SHORT_BINBYTES",
		"bad_legacy_list.pickle":      "not a memory snapshot: the pickle is a list, the pre-2.0 torch format",
		"bad_not_dict.pickle":         "not a memory snapshot: the pickle holds a str",
		"bad_no_traces.pickle":        `not a memory snapshot: the top level has no "device_traces" key`,
		"bad_size_str.pickle":         `device_traces[0][1]["size"] is a str, want an int`,
		"bad_no_state.pickle":         `segments[1].blocks[0] has no "state" key`,
		"bad_oom_no_free.pickle":      `device_traces[1][1] has no "device_free" key`,
		"bad_huge_int.pickle":         "does not fit in 64 bits",
	}
	for name, want := range cases {
		path := filepath.Join(dir, name)
		_, err := snapshot.ReadFile(path)
		var fe *snapshot.FormatError
		if !errors.As(err, &fe) {
			t.Errorf("%s: error %v, want a FormatError", name, err)
			continue
		}
		msg := err.Error()
		if !strings.HasPrefix(msg, path+": ") || !strings.Contains(msg, want) || strings.Contains(msg, "\n") {
			t.Errorf("%s: error %q, want one line %q", name, msg, path+": …"+want+"…")
		}
	}
	if _, err := snapshot.ReadFile(filepath.Join(dir, "missing.pickle")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

// TestReadNeverPanics: every prefix and thousands of corrupted variants of
// real pickles give an error or a snapshot, never a panic or a hang.
func TestReadNeverPanics(t *testing.T) {
	dir := makePickles(t)
	rng := rand.New(rand.NewSource(1))
	for _, name := range []string{"good_cuda_p2", "good_cuda_p4", "good_exotic_p4"} {
		data, err := os.ReadFile(filepath.Join(dir, name+".pickle"))
		if err != nil {
			t.Fatal(err)
		}
		for n := 0; n < len(data); n++ {
			if _, err := snapshot.Decode(data[:n]); err == nil {
				t.Errorf("%s: prefix of %d bytes read without error", name, n)
			}
		}
		for i := 0; i < 3000; i++ {
			mut := append([]byte(nil), data...)
			for k := 0; k <= rng.Intn(3); k++ {
				mut[rng.Intn(len(mut))] = byte(rng.Intn(256))
			}
			snapshot.Decode(mut) // must return
		}
	}
}

func FuzzDecode(f *testing.F) {
	model, settings := npuprobeExample()
	var buf bytes.Buffer
	if err := output.WriteSnapshot(&buf, model, settings); err != nil {
		f.Fatal(err)
	}
	f.Add(buf.Bytes())
	f.Add([]byte("\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02u."))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := snapshot.Decode(data)
		if err == nil {
			var out bytes.Buffer
			_ = snapshot.Write(&out, s)
		}
	})
}
