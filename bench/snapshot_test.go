package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/output"
	"github.com/npuprobe/npuprobe/snapshot"
)

// The snapshot: 1,000,000 trace entries, 10,000 segments.
const (
	snapEntries  = 1_000_000
	snapSegments = 10_000
)

var (
	snapOnce    sync.Once
	bigSnap     *allocmodel.Snapshot
	bigSettings []output.Setting
)

func bigSnapshot() (*allocmodel.Snapshot, []output.Setting) {
	snapOnce.Do(func() { bigSnap, bigSettings = SyntheticSnapshot(snapEntries, snapSegments, 1) })
	return bigSnap, bigSettings
}

// TestSyntheticSnapshotReadsBack: the benchmark's snapshot is a valid one
// (the snapshot package reads it back with every segment tiled by its
// blocks), at a reduced size.
func TestSyntheticSnapshotReadsBack(t *testing.T) {
	snap, settings := SyntheticSnapshot(20_000, 500, 3)
	var buf bytes.Buffer
	if err := output.WriteSnapshot(&buf, snap, settings); err != nil {
		t.Fatal(err)
	}
	got, err := snapshot.Decode(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Segments) != 500 || len(got.DeviceTraces) != 1 || len(got.DeviceTraces[0]) != 20_000 {
		t.Fatalf("read back %d segments, %d traces", len(got.Segments), len(got.DeviceTraces))
	}
	blocks := 0
	for _, s := range got.Segments {
		at := s.Address
		for _, b := range s.Blocks {
			if b.Address.V != at {
				t.Fatalf("segment %#x: block at %#x, want %#x", s.Address, b.Address.V, at)
			}
			at += b.Size
		}
		if at != s.Address+s.TotalSize {
			t.Fatalf("segment %#x: blocks end at %#x, segment at %#x", s.Address, at, s.Address+s.TotalSize)
		}
		blocks += len(s.Blocks)
	}
	t.Logf("%d blocks in 500 segments", blocks)
}

// BenchmarkWriteSnapshot writes the 1,000,000-entry, 10,000-segment
// snapshot with output.WriteSnapshot into a file, as npuprobe does (the
// atomic rename and fsync of output.Dir are left out: Python's side has
// neither). npubench snapshot compares it with python3's pickle.dump.
func BenchmarkWriteSnapshot(b *testing.B) {
	snap, settings := bigSnapshot()
	path := filepath.Join(b.TempDir(), "snap.pickle")
	b.ReportAllocs()
	for b.Loop() {
		f, err := os.Create(path)
		if err != nil {
			b.Fatal(err)
		}
		if err := output.WriteSnapshot(f, snap, settings); err != nil {
			b.Fatal(err)
		}
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
	st, err := os.Stat(path)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(st.Size()), "file-bytes")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/snapEntries, "ns/entry")
}
