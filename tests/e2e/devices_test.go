package e2e

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// TestExpandableSegmentsMatchGroundTruth: with expandable_segments:True,
// segments that grow (pages mapped), shrink (emptyCache unmaps) and grow
// again, in both pools, equal the allocator's own snapshot: one segment per
// contiguous mapped range, one segment_map/segment_unmap per allocator
// operation although the runtime maps page by page.
func TestExpandableSegmentsMatchGroundTruth(t *testing.T) {
	env := []string{"PYTORCH_NPU_ALLOC_CONF=expandable_segments:True"}
	for _, c := range []struct {
		name string
		args []string
	}{
		{"transformer", []string{"--pattern", "transformer", "--steps", "10", "--streams", "2"}},
		{"churn", []string{"--pattern", "churn", "--steps", "3000", "--seed", "13"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := runTensorWorkload(t, fixtures.TorchSymtabDir, env, nil, append(c.args, "--pre-attach-steps", "0")...)
			checkLevel(t, r.snap, "tensor")
			compareTensorSnapshot(t, r.final, r.snap, nil)
			counts := map[string]int{}
			for _, trace := range r.final.DeviceTraces {
				for _, e := range trace {
					counts[e.Action]++
				}
			}
			expandable := 0
			for _, s := range r.snap.Segments {
				if s.IsExpandable {
					expandable++
				}
			}
			t.Logf("%d expandable segments; %d segment_map, %d segment_unmap entries", expandable, counts["segment_map"], counts["segment_unmap"])
			if expandable == 0 || counts["segment_map"] == 0 || counts["segment_unmap"] == 0 {
				t.Fatalf("the workload did not grow and shrink expandable segments: %v", counts)
			}
		})
	}
}

// TestDevicesAndStreams: threads on devices 0-3, two of them bound to
// their device before npuprobe attached (so it never sees their
// aclrtSetDevice), some on a second stream: at tensor level every
// segment, block, stream and per-device trace equals the ground truth.
func TestDevicesAndStreams(t *testing.T) {
	for _, c := range []struct {
		name string
		env  []string
	}{
		{"cached segments", nil},
		{"expandable segments", []string{"PYTORCH_NPU_ALLOC_CONF=expandable_segments:True"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := runTensorWorkload(t, fixtures.TorchSymtabDir, c.env, nil, "--pattern", "multidevice", "--steps", "30", "--pre-attach-steps", "0")
			compareTensorSnapshot(t, r.final, r.snap, nil)
			devices := map[int]bool{}
			streams := map[uint64]bool{}
			for _, s := range r.snap.Segments {
				devices[s.Device] = true
				streams[s.Stream] = true
			}
			nonEmpty := 0
			for _, trace := range r.snap.DeviceTraces {
				if len(trace) > 0 {
					nonEmpty++
				}
			}
			if len(devices) != 4 || nonEmpty != 4 || len(streams) < 5 {
				t.Fatalf("segments on %d devices, %d non-empty device traces, %d streams; want 4, 4, at least 5", len(devices), nonEmpty, len(streams))
			}
		})
	}
}

// TestDeviceFallback: at segment level (no torch_npu symbols) a thread
// whose device was chosen before attach, and that never calls
// aclrtSetDevice/aclrtGetDevice again, cannot be attributed from what
// npuprobe sees; its segments go to the default device: --device if given,
// else the process's LOCAL_RANK, else 0. Threads seen choosing their
// device are attributed exactly.
func TestDeviceFallback(t *testing.T) {
	for _, c := range []struct {
		name     string
		env      []string
		args     []string
		fallback int
	}{
		{"default 0", nil, nil, 0},
		{"LOCAL_RANK", []string{"LOCAL_RANK=2"}, nil, 2},
		{"--device", []string{"LOCAL_RANK=2"}, []string{"--device", "3"}, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := append(fixtures.TorchEnv(fixtures.TorchStrippedDir), c.env...)
			w := startProgram(t, fixtures.TensorWorkload, env, "", "--pattern", "multidevice", "--steps", "20", "--pre-attach-steps", "0")
			a := runAgent(t, append([]string{"--pid", fmt.Sprint(w.pid), "--out", t.TempDir()}, c.args...)...)
			a.expect(regexp.MustCompile(`^npuprobe: tracing`), 30*time.Second)
			w.send("go")
			w.expectLine("done", 5*time.Minute)
			snap := loadSnapshot(t, a.snapshot())
			gt := dumpTorchGroundTruth(t, w)
			checkLevel(t, snap, "segment")
			var note string
			snap.Setting(t, "npuprobe_device_note", &note)
			if !strings.Contains(note, "default device") {
				t.Errorf("device note does not document the fallback: %q", note)
			}
			// Workers 1 and 3 bound their device before attach; 0 and 2 after.
			want := map[uint64]int{}
			for _, s := range gt.Segments {
				dev := s.Device
				if dev == 1 || dev == 3 {
					dev = c.fallback
				}
				want[s.Address] = dev
			}
			if len(snap.Segments) != len(gt.Segments) {
				t.Fatalf("%d segments, ground truth %d", len(snap.Segments), len(gt.Segments))
			}
			got := map[uint64]int{}
			for _, s := range snap.Segments {
				got[s.Address] = s.Device
			}
			var wrong []string
			for addr, dev := range want {
				if got[addr] != dev {
					wrong = append(wrong, fmt.Sprintf("%#x on %d, want %d", addr, got[addr], dev))
				}
			}
			sort.Strings(wrong)
			if len(wrong) > 0 {
				t.Fatalf("%d segments attributed otherwise: %v", len(wrong), wrong)
			}
			checkSegmentsOnly(t, gt, snap)
		})
	}
}

// checkSegmentsOnly compares segment ranges with the ground truth.
func checkSegmentsOnly(t *testing.T, gt *fixture.TorchGroundTruth, snap *Snapshot) {
	t.Helper()
	type rng struct{ addr, size uint64 }
	var a, b []rng
	for _, s := range gt.Segments {
		a = append(a, rng{s.Address, s.TotalSize})
	}
	for _, s := range snap.Segments {
		b = append(b, rng{s.Address, s.TotalSize})
	}
	sort.Slice(a, func(i, j int) bool { return a[i].addr < a[j].addr })
	sort.Slice(b, func(i, j int) bool { return b[i].addr < b[j].addr })
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatalf("segment ranges differ:\n got  %v\n want %v", b, a)
	}
}
