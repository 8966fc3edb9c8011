package output_test

import (
	"bytes"
	"testing"

	am "github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/clock"
	"github.com/npuprobe/npuprobe/output"
)

// The agent writes snapshots straight from the model's rings
// (ViewSource); the copy path (Model.Snapshot, StampTrace, WriteSnapshot)
// is the reference. Both must give the same bytes: with rings that have
// wrapped, on two devices, and with an oom entry still waiting for its
// free-bytes figure (patched in the view, not in the ring).
func TestViewSourceWritesWhatTheCopyWrites(t *testing.T) {
	const mib = 1 << 20
	m := am.New(am.Config{MaxEntries: 5})
	ev := func(e am.Event) { m.Apply(&e) }
	ret := am.OutcomeReturned
	mono := int64(1_000_000)
	for i := range 12 {
		dev := i % 2
		ev(am.Event{Tid: 1, Call: am.CallSetDevice, Outcome: ret, Arg: uint64(dev)})
		addr := uint64(0x10_0000_0000 + i*0x1000_0000)
		mono += 1_500
		ev(am.Event{Tid: 1, MonoNs: mono, Call: am.CallMalloc, Outcome: ret, Addr: addr, Size: uint64(i+1) * mib})
		if i%3 == 2 {
			mono += 700
			ev(am.Event{Tid: 1, MonoNs: mono, Call: am.CallFree, Outcome: am.OutcomeEntry, Addr: addr})
		}
	}
	ev(am.Event{Tid: 1, Call: am.CallGetMemInfo, Outcome: ret, Addr: 100 * mib, Size: 128 * mib})
	mono += 2_000
	ev(am.Event{Tid: 1, MonoNs: mono, Call: am.CallMallocAlign32, Outcome: am.OutcomeOOM, RC: am.ACLErrorMemoryAllocation, Size: 64 * mib})

	// Unix time far from the monotonic readings, so an unstamped or
	// wrongly stamped entry shows.
	conv := clock.NewConverter(clock.Calibration{MonoNs: 0, RealNs: 1_790_000_000_123_456_789})
	settings := []output.Setting{{Key: "npuprobe_version", Value: "test"}}

	snap := m.Snapshot()
	entries := 0
	for _, tr := range snap.Traces {
		conv.StampTrace(tr)
		entries += len(tr)
	}
	if len(snap.Traces) != 2 || snap.Overwritten[0]+snap.Overwritten[1] == 0 {
		t.Fatalf("test model: %d traces, overwritten %v; want two devices whose rings wrapped", len(snap.Traces), snap.Overwritten)
	}
	var fromCopy, fromView bytes.Buffer
	if err := output.WriteSnapshot(&fromCopy, snap, settings); err != nil {
		t.Fatal(err)
	}
	if err := output.WriteSnapshotFrom(&fromView, output.ViewSource(m.View(), conv), settings); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fromCopy.Bytes(), fromView.Bytes()) {
		t.Fatalf("view snapshot (%d bytes) differs from the copied one (%d bytes, %d entries)", fromView.Len(), fromCopy.Len(), entries)
	}
}
