package allocmodel_test

import (
	"fmt"
	"reflect"
	"testing"

	am "github.com/npuprobe/npuprobe/allocmodel"
)

const (
	mib   = 1 << 20
	small = 2 * mib // torch's small-pool segment size
)

// Event constructors. mono doubles as a tag that makes every entry unique.

func setDevice(tid uint32, dev int) am.Event {
	return am.Event{Tid: tid, Call: am.CallSetDevice, Outcome: am.OutcomeReturned, Arg: uint64(uint32(int32(dev)))}
}

func getDevice(tid uint32, dev int) am.Event {
	return am.Event{Tid: tid, Call: am.CallGetDevice, Outcome: am.OutcomeReturned, Arg: uint64(uint32(int32(dev)))}
}

func malloc(tid uint32, mono int64, addr, size uint64) am.Event {
	return am.Event{Tid: tid, MonoNs: mono, Call: am.CallMalloc, Outcome: am.OutcomeReturned, Addr: addr, Size: size}
}

func mallocCall(c am.Call, tid uint32, mono int64, addr, size uint64) am.Event {
	ev := malloc(tid, mono, addr, size)
	ev.Call = c
	return ev
}

func oom(tid uint32, mono int64, size uint64) am.Event {
	return am.Event{Tid: tid, MonoNs: mono, Call: am.CallMallocAlign32, Outcome: am.OutcomeOOM, RC: am.ACLErrorMemoryAllocation, Size: size}
}

func free(tid uint32, mono int64, addr uint64) am.Event {
	return am.Event{Tid: tid, MonoNs: mono, Call: am.CallFree, Outcome: am.OutcomeEntry, Addr: addr}
}

func memInfo(tid uint32, freeBytes, total uint64) am.Event {
	return am.Event{Tid: tid, Call: am.CallGetMemInfo, Outcome: am.OutcomeReturned, Addr: freeBytes, Size: total}
}

func failed(ev am.Event) am.Event {
	ev.Outcome = am.OutcomeFailed
	ev.RC = 507000
	ev.Addr = 0
	return ev
}

// Expected-value constructors.

func seg(dev int, addr, size uint64) am.Segment {
	typ := am.SegmentLarge
	if size == small {
		typ = am.SegmentSmall
	}
	return am.Segment{Device: dev, Address: addr, TotalSize: size, Type: typ,
		Blocks: []am.Block{{Address: addr, Size: size, State: am.BlockInactive}}}
}

func segAlloc(mono int64, addr, size uint64) am.TraceEntry {
	return am.TraceEntry{MonoNs: mono, Action: am.ActionSegmentAlloc, Addr: addr, Size: size}
}

func segFree(mono int64, addr, size uint64) am.TraceEntry {
	return am.TraceEntry{MonoNs: mono, Action: am.ActionSegmentFree, Addr: addr, Size: size}
}

func oomEntry(mono int64, size, deviceFree uint64) am.TraceEntry {
	return am.TraceEntry{MonoNs: mono, Action: am.ActionOOM, Addr: deviceFree, Size: size}
}

// stats is the part of Stats the segment level defines.
type stats struct {
	Events        uint64
	LiveSegments  int
	ReservedBytes uint64
}

func statsOf(m *am.Model) stats {
	s := m.Stats()
	return stats{Events: s.Events, LiveSegments: s.LiveSegments, ReservedBytes: s.ReservedBytes}
}

func apply(m *am.Model, evs []am.Event) {
	for i := range evs {
		m.Apply(&evs[i])
	}
}

// want fills the parts of an expected snapshot every test shares.
func want(cfg am.Config, nEvents int, segs []am.Segment, traces [][]am.TraceEntry, c am.Counters) *am.Snapshot {
	c.Events = uint64(nEvents)
	if segs == nil {
		segs = []am.Segment{}
	}
	if traces == nil {
		traces = [][]am.TraceEntry{}
	}
	for i := range traces {
		if traces[i] == nil {
			traces[i] = []am.TraceEntry{}
		}
	}
	return &am.Snapshot{
		Level:       am.LevelSegment,
		Segments:    segs,
		Traces:      traces,
		Pools:       []am.PoolID{{0, 0}},
		MaxEntries:  cfg.MaxEntries,
		Overwritten: make([]uint64, len(traces)),
		Counters:    c,
	}
}

// diffSnapshot compares the fields a segment-level snapshot defines.
func diffSnapshot(t *testing.T, got, want *am.Snapshot) {
	t.Helper()
	if !reflect.DeepEqual(got.Segments, want.Segments) {
		t.Errorf("Segments:\n got %+v\nwant %+v", got.Segments, want.Segments)
	}
	if !reflect.DeepEqual(got.Traces, want.Traces) {
		t.Errorf("Traces:\n got %+v\nwant %+v", got.Traces, want.Traces)
	}
	if got.Counters != want.Counters {
		t.Errorf("Counters:\n got %+v\nwant %+v", got.Counters, want.Counters)
	}
	if !reflect.DeepEqual(got.Overwritten, want.Overwritten) {
		t.Errorf("Overwritten: got %v, want %v", got.Overwritten, want.Overwritten)
	}
	if got.Level != want.Level || got.MaxEntries != want.MaxEntries || !reflect.DeepEqual(got.Pools, want.Pools) {
		t.Errorf("Level/MaxEntries/Pools: got %v/%d/%v, want %v/%d/%v",
			got.Level, got.MaxEntries, got.Pools, want.Level, want.MaxEntries, want.Pools)
	}
}

const (
	addrA = 0x12C040000000
	addrB = 0x12C060000000 // beyond A: live segments never overlap
	addrC = 0x12C080000000
)

func TestApplySegmentLevel(t *testing.T) {
	tests := []struct {
		name   string
		cfg    am.Config
		events []am.Event
		segs   []am.Segment
		traces [][]am.TraceEntry
		c      am.Counters
	}{
		{
			name:   "malloc on the default device 0",
			events: []am.Event{malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(0, addrA, 20*mib)},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "malloc on a configured default device",
			cfg:    am.Config{DefaultDevice: 2},
			events: []am.Event{malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(2, addrA, 20*mib)},
			traces: [][]am.TraceEntry{nil, nil, {segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "negative default device means 0",
			cfg:    am.Config{DefaultDevice: -3},
			events: []am.Event{malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(0, addrA, 20*mib)},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "device from SetDevice",
			events: []am.Event{setDevice(1, 1), malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(1, addrA, 20*mib)},
			traces: [][]am.TraceEntry{nil, {segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "device from GetDevice",
			events: []am.Event{getDevice(1, 3), malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(3, addrA, 20*mib)},
			traces: [][]am.TraceEntry{nil, nil, nil, {segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "latest SetDevice wins",
			events: []am.Event{setDevice(1, 3), setDevice(1, 1), malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(1, addrA, 20*mib)},
			traces: [][]am.TraceEntry{nil, {segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "another thread's SetDevice does not apply",
			cfg:    am.Config{DefaultDevice: 1},
			events: []am.Event{setDevice(2, 3), malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(1, addrA, 20*mib)},
			traces: [][]am.TraceEntry{nil, {segAlloc(10, addrA, 20*mib)}},
		},
		{
			name:   "failed SetDevice keeps the device and is counted",
			events: []am.Event{setDevice(1, 1), failed(setDevice(1, 2)), malloc(1, 10, addrA, 20*mib)},
			segs:   []am.Segment{seg(1, addrA, 20*mib)},
			traces: [][]am.TraceEntry{nil, {segAlloc(10, addrA, 20*mib)}},
			c:      am.Counters{FailedCalls: 1},
		},
		{
			name: "threads on different devices",
			events: []am.Event{
				setDevice(1, 0), setDevice(2, 1),
				malloc(2, 10, addrB, 20*mib), malloc(1, 11, addrA, 20*mib), malloc(2, 12, addrC, small),
			},
			segs:   []am.Segment{seg(0, addrA, 20*mib), seg(1, addrB, 20*mib), seg(1, addrC, small)},
			traces: [][]am.TraceEntry{{segAlloc(11, addrA, 20*mib)}, {segAlloc(10, addrB, 20*mib), segAlloc(12, addrC, small)}},
		},
		{
			name: "every malloc call makes a segment",
			events: []am.Event{
				mallocCall(am.CallMalloc, 1, 10, addrA, 20*mib),
				mallocCall(am.CallMallocAlign32, 1, 11, addrB, small),
				mallocCall(am.CallMallocCached, 1, 12, addrC, 32*mib),
			},
			segs:   []am.Segment{seg(0, addrA, 20*mib), seg(0, addrB, small), seg(0, addrC, 32*mib)},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segAlloc(11, addrB, small), segAlloc(12, addrC, 32*mib)}},
		},
		{
			name:   "free of a known segment",
			events: []am.Event{malloc(1, 10, addrA, 20*mib), malloc(1, 11, addrB, small), free(1, 12, addrA)},
			segs:   []am.Segment{seg(0, addrB, small)},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segAlloc(11, addrB, small), segFree(12, addrA, 20*mib)}},
		},
		{
			name: "free from another thread goes to the segment's device",
			events: []am.Event{
				setDevice(1, 1), malloc(1, 10, addrA, 20*mib),
				setDevice(2, 0), free(2, 11, addrA),
			},
			traces: [][]am.TraceEntry{nil, {segAlloc(10, addrA, 20*mib), segFree(11, addrA, 20*mib)}},
		},
		{
			name:   "free of an unknown address",
			events: []am.Event{setDevice(1, 1), free(1, 10, addrA)},
			traces: [][]am.TraceEntry{nil, {segFree(10, addrA, 0)}},
			c:      am.Counters{SegmentFreesUnknown: 1},
		},
		{
			name:   "double free: the second is unknown",
			events: []am.Event{malloc(1, 10, addrA, 20*mib), free(1, 11, addrA), free(1, 12, addrA)},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segFree(11, addrA, 20*mib), segFree(12, addrA, 0)}},
			c:      am.Counters{SegmentFreesUnknown: 1},
		},
		{
			name:   "free of NULL adds no entry and no device",
			events: []am.Event{setDevice(1, 2), free(1, 10, 0), free(1, 11, 0)},
			c:      am.Counters{FreesOfNull: 2},
		},
		{
			// The old segment's free was lost: it is recorded, at the new
			// allocation's time, so the trace replays.
			name: "allocation at a live base replaces the segment",
			events: []am.Event{
				malloc(1, 10, addrA, 20*mib),
				setDevice(1, 1), malloc(1, 11, addrA, small),
				free(1, 12, addrB), // unknown
			},
			segs:   []am.Segment{seg(1, addrA, small)},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segFree(11, addrA, 20*mib)}, {segAlloc(11, addrA, small), segFree(12, addrB, 0)}},
			c:      am.Counters{AllocsOverLive: 1, SegmentFreesUnknown: 1, SegmentsOverlapped: 1},
		},
		{
			name: "failed non-OOM calls are counted and leave no trace",
			events: []am.Event{
				failed(malloc(1, 10, addrA, 20*mib)),
				failed(mallocCall(am.CallMallocCached, 1, 11, addrA, 20*mib)),
				failed(setDevice(1, 1)),
				failed(getDevice(1, 1)),
				failed(memInfo(1, 0, 0)),
			},
			c: am.Counters{FailedCalls: 5},
		},
		{
			name:   "GetMemInfo alone creates an empty trace for its device",
			events: []am.Event{setDevice(1, 1), memInfo(1, 5*mib, 64*mib)},
			traces: [][]am.TraceEntry{nil, nil},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := am.New(tt.cfg)
			apply(m, tt.events)
			diffSnapshot(t, m.Snapshot(), want(tt.cfg, len(tt.events), tt.segs, tt.traces, tt.c))
		})
	}
}

func TestSegmentType(t *testing.T) {
	tests := []struct {
		size uint64
		want am.SegmentType
	}{
		{small, am.SegmentSmall},
		{small - 1, am.SegmentLarge},
		{small + 1, am.SegmentLarge},
		{512, am.SegmentLarge},
		{1 * mib, am.SegmentLarge},
		{4 * mib, am.SegmentLarge},
		{20 * mib, am.SegmentLarge},
	}
	for _, tt := range tests {
		m := am.New(am.Config{})
		ev := malloc(1, 1, addrA, tt.size)
		m.Apply(&ev)
		s := m.Snapshot()
		if len(s.Segments) != 1 {
			t.Fatalf("size %d: %d segments", tt.size, len(s.Segments))
		}
		if got := s.Segments[0].Type; got != tt.want {
			t.Errorf("size %d: type %v, want %v", tt.size, got, tt.want)
		}
	}
}

func TestOOMDeviceFree(t *testing.T) {
	tests := []struct {
		name   string
		events []am.Event
		traces [][]am.TraceEntry
		segs   []am.Segment
		c      am.Counters
	}{
		{
			name:   "observed by the GetMemInfo that follows",
			events: []am.Event{oom(1, 10, 30*mib), memInfo(1, 7*mib, 64*mib)},
			traces: [][]am.TraceEntry{{oomEntry(10, 30*mib, 7*mib)}},
			c:      am.Counters{OOMs: 1},
		},
		{
			name: "other threads in between do not settle it",
			events: []am.Event{
				oom(1, 10, 30*mib),
				malloc(2, 11, addrA, 20*mib), free(2, 12, addrB), memInfo(2, 1*mib, 64*mib),
				memInfo(1, 7*mib, 64*mib),
			},
			traces: [][]am.TraceEntry{{oomEntry(10, 30*mib, 7*mib), segAlloc(11, addrA, 20*mib), segFree(12, addrB, 0)}},
			segs:   []am.Segment{seg(0, addrA, 20*mib)},
			c:      am.Counters{OOMs: 1, SegmentFreesUnknown: 1},
		},
		{
			name:   "on the thread's device",
			events: []am.Event{setDevice(1, 1), oom(1, 10, 30*mib), memInfo(1, 7*mib, 64*mib)},
			traces: [][]am.TraceEntry{nil, {oomEntry(10, 30*mib, 7*mib)}},
			c:      am.Counters{OOMs: 1},
		},
		{
			name:   "no GetMemInfo ever: estimate 0",
			events: []am.Event{oom(1, 10, 30*mib), malloc(1, 11, addrA, 20*mib)},
			traces: [][]am.TraceEntry{{oomEntry(10, 30*mib, 0), segAlloc(11, addrA, 20*mib)}},
			segs:   []am.Segment{seg(0, addrA, 20*mib)},
			c:      am.Counters{OOMs: 1, OOMFreeInferred: 1},
		},
		{
			name: "estimate: last free minus bytes reserved since",
			events: []am.Event{
				malloc(1, 10, addrA, 20*mib),
				memInfo(1, 100*mib, 128*mib), // 20 mib reserved then
				malloc(1, 11, addrB, small),  // +2 mib since
				oom(1, 12, 30*mib),
				free(1, 13, 0), // any other call settles it
			},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segAlloc(11, addrB, small), oomEntry(12, 30*mib, 98*mib)}},
			segs:   []am.Segment{seg(0, addrA, 20*mib), seg(0, addrB, small)},
			c:      am.Counters{OOMs: 1, OOMFreeInferred: 1, FreesOfNull: 1},
		},
		{
			name: "estimate grows with bytes released since",
			events: []am.Event{
				malloc(1, 10, addrA, 20*mib),
				memInfo(1, 100*mib, 128*mib),
				free(1, 11, addrA),
				oom(1, 12, 30*mib),
				setDevice(1, 0),
			},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segFree(11, addrA, 20*mib), oomEntry(12, 30*mib, 120*mib)}},
			c:      am.Counters{OOMs: 1, OOMFreeInferred: 1},
		},
		{
			name: "estimate never below 0",
			events: []am.Event{
				memInfo(1, 1*mib, 128*mib),
				malloc(1, 10, addrA, 20*mib),
				oom(1, 11, 30*mib),
				malloc(1, 12, addrB, small),
			},
			traces: [][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), oomEntry(11, 30*mib, 0), segAlloc(12, addrB, small)}},
			segs:   []am.Segment{seg(0, addrA, 20*mib), seg(0, addrB, small)},
			c:      am.Counters{OOMs: 1, OOMFreeInferred: 1},
		},
		{
			name: "another device's GetMemInfo does not inform the estimate",
			events: []am.Event{
				setDevice(2, 1), memInfo(2, 50*mib, 64*mib),
				oom(1, 10, 30*mib), free(1, 11, 0),
			},
			traces: [][]am.TraceEntry{{oomEntry(10, 30*mib, 0)}, nil},
			c:      am.Counters{OOMs: 1, OOMFreeInferred: 1, FreesOfNull: 1},
		},
		{
			name: "a failed GetMemInfo does not settle it with a value",
			events: []am.Event{
				memInfo(1, 40*mib, 64*mib),
				oom(1, 10, 30*mib),
				failed(memInfo(1, 0, 0)),
			},
			traces: [][]am.TraceEntry{{oomEntry(10, 30*mib, 40*mib)}},
			c:      am.Counters{OOMs: 1, OOMFreeInferred: 1, FailedCalls: 1},
		},
		{
			name: "two OOMs in a row: the first inferred, the second observed",
			events: []am.Event{
				memInfo(1, 40*mib, 64*mib),
				oom(1, 10, 60*mib),
				oom(1, 11, 50*mib),
				memInfo(1, 39*mib, 64*mib),
			},
			traces: [][]am.TraceEntry{{oomEntry(10, 60*mib, 40*mib), oomEntry(11, 50*mib, 39*mib)}},
			c:      am.Counters{OOMs: 2, OOMFreeInferred: 1},
		},
		{
			name: "the observing GetMemInfo becomes the new estimate base",
			events: []am.Event{
				oom(1, 10, 60*mib), memInfo(1, 40*mib, 64*mib),
				malloc(1, 11, addrA, 20*mib),
				oom(1, 12, 30*mib), free(1, 13, 0),
			},
			traces: [][]am.TraceEntry{{oomEntry(10, 60*mib, 40*mib), segAlloc(11, addrA, 20*mib), oomEntry(12, 30*mib, 20*mib)}},
			segs:   []am.Segment{seg(0, addrA, 20*mib)},
			c:      am.Counters{OOMs: 2, OOMFreeInferred: 1, FreesOfNull: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := am.New(am.Config{})
			apply(m, tt.events)
			diffSnapshot(t, m.Snapshot(), want(am.Config{}, len(tt.events), tt.segs, tt.traces, tt.c))
		})
	}
}

// TestSnapshotWhileOOMPending: the copy carries an estimate; the model keeps
// waiting and takes the observed value afterwards.
func TestSnapshotWhileOOMPending(t *testing.T) {
	m := am.New(am.Config{})
	apply(m, []am.Event{
		malloc(1, 10, addrA, 20*mib),
		memInfo(1, 100*mib, 128*mib),
		malloc(2, 11, addrB, small),
		oom(1, 12, 30*mib),
	})
	s1 := m.Snapshot()
	w1 := want(am.Config{}, 4, []am.Segment{seg(0, addrA, 20*mib), seg(0, addrB, small)},
		[][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segAlloc(11, addrB, small), oomEntry(12, 30*mib, 98*mib)}},
		am.Counters{OOMs: 1, OOMFreeInferred: 1})
	diffSnapshot(t, s1, w1)

	// addrA second snapshot still pending: the same estimate, counted once.
	diffSnapshot(t, m.Snapshot(), w1)

	apply(m, []am.Event{memInfo(1, 77*mib, 128*mib)})
	w2 := want(am.Config{}, 5, []am.Segment{seg(0, addrA, 20*mib), seg(0, addrB, small)},
		[][]am.TraceEntry{{segAlloc(10, addrA, 20*mib), segAlloc(11, addrB, small), oomEntry(12, 30*mib, 77*mib)}},
		am.Counters{OOMs: 1})
	diffSnapshot(t, m.Snapshot(), w2)

	// The first copy is unaffected by what happened since.
	diffSnapshot(t, s1, w1)
}

// TestSnapshotWhileOOMPendingOverwritten: the pending entry left the ring.
func TestSnapshotWhileOOMPendingOverwritten(t *testing.T) {
	cfg := am.Config{MaxEntries: 2}
	m := am.New(cfg)
	apply(m, []am.Event{
		oom(1, 10, 30*mib),
		malloc(2, 11, addrA, 20*mib),
		malloc(2, 12, addrB, small),
	})
	w := want(cfg, 3, []am.Segment{seg(0, addrA, 20*mib), seg(0, addrB, small)},
		[][]am.TraceEntry{{segAlloc(11, addrA, 20*mib), segAlloc(12, addrB, small)}},
		am.Counters{OOMs: 1, OOMFreeInferred: 1})
	w.Overwritten = []uint64{1}
	diffSnapshot(t, m.Snapshot(), w)

	// The late GetMemInfo must not patch whichever entry took the slot.
	apply(m, []am.Event{memInfo(1, 7*mib, 64*mib)})
	w.Counters = am.Counters{Events: 4, OOMs: 1}
	diffSnapshot(t, m.Snapshot(), w)
}

// TestOOMEntryOverwrittenBeforeInference: inference of an overwritten entry
// changes nothing but the counter.
func TestOOMEntryOverwrittenBeforeInference(t *testing.T) {
	cfg := am.Config{MaxEntries: 1}
	m := am.New(cfg)
	apply(m, []am.Event{
		memInfo(1, 40*mib, 64*mib),
		oom(1, 10, 30*mib),
		malloc(2, 11, addrA, 20*mib),
		free(1, 12, 0),
	})
	w := want(cfg, 4, []am.Segment{seg(0, addrA, 20*mib)},
		[][]am.TraceEntry{{segAlloc(11, addrA, 20*mib)}},
		am.Counters{OOMs: 1, OOMFreeInferred: 1, FreesOfNull: 1})
	w.Overwritten = []uint64{1}
	diffSnapshot(t, m.Snapshot(), w)
}

func TestSnapshotIsDeepCopy(t *testing.T) {
	build := func() *am.Model {
		m := am.New(am.Config{MaxEntries: 8})
		apply(m, []am.Event{
			malloc(1, 10, addrA, 20*mib), setDevice(2, 1), malloc(2, 11, addrB, small),
			oom(1, 12, 30*mib),
		})
		return m
	}
	m := build()
	s := m.Snapshot()
	s.Segments[0].Blocks[0].Size = 1
	s.Segments[0].Blocks[0].State = am.BlockActiveAllocated
	s.Segments[0].Blocks = append(s.Segments[0].Blocks, am.Block{Address: 1})
	s.Segments[0].TotalSize = 1
	s.Segments[1].Device = 7
	s.Traces[0][0].Addr = 1
	s.Traces[0][1].Addr = 1 // the pending oom entry
	s.Traces[1][0].Size = 1
	s.Traces[1] = append(s.Traces[1], am.TraceEntry{})
	s.Pools[0] = am.PoolID{5, 5}
	s.Overwritten[0] = 9
	s.Counters.Events = 99

	diffSnapshot(t, m.Snapshot(), build().Snapshot())
	if st := statsOf(m); st != (stats{Events: 4, LiveSegments: 2, ReservedBytes: 22 * mib}) {
		t.Errorf("Stats after mutating a snapshot = %+v", st)
	}
}

func TestSnapshotSegmentOrder(t *testing.T) {
	m := am.New(am.Config{})
	// Addresses chosen so that address order and device order disagree,
	// and enough segments that map order would be visibly random.
	var evs []am.Event
	var wantSegs []am.Segment
	devs := []int{2, 0, 1}
	for i := 0; i < 60; i++ {
		dev := devs[i%3]
		addr := uint64(0x7000_0000_0000 - i*0x200_0000)
		tid := uint32(dev + 1)
		evs = append(evs, setDevice(tid, dev), malloc(tid, int64(i), addr, 20*mib))
	}
	apply(m, evs)
	for _, dev := range []int{0, 1, 2} {
		for i := 59; i >= 0; i-- {
			if devs[i%3] == dev {
				wantSegs = append(wantSegs, seg(dev, uint64(0x7000_0000_0000-i*0x200_0000), 20*mib))
			}
		}
	}
	for k := 0; k < 5; k++ {
		got := m.Snapshot().Segments
		if !reflect.DeepEqual(got, wantSegs) {
			for i := range got {
				if got[i].Device != wantSegs[i].Device || got[i].Address != wantSegs[i].Address {
					t.Fatalf("segment %d is (device %d, %#x), want (device %d, %#x)",
						i, got[i].Device, got[i].Address, wantSegs[i].Device, wantSegs[i].Address)
				}
			}
			t.Fatalf("segments differ")
		}
	}
}

func TestTracesOnePerDeviceUpToHighestUsed(t *testing.T) {
	m := am.New(am.Config{})
	// Selecting a device uses nothing on it.
	apply(m, []am.Event{setDevice(1, 5), getDevice(2, 7)})
	if n := len(m.Snapshot().Traces); n != 0 {
		t.Fatalf("after SetDevice/GetDevice only: %d traces, want 0", n)
	}
	apply(m, []am.Event{malloc(1, 10, addrA, 20*mib)})
	s := m.Snapshot()
	if len(s.Traces) != 6 || len(s.Overwritten) != 6 {
		t.Fatalf("%d traces, %d overwritten counts, want 6 and 6", len(s.Traces), len(s.Overwritten))
	}
	for d, tr := range s.Traces {
		if tr == nil {
			t.Errorf("Traces[%d] is nil, want a list", d)
		}
		if wantLen := map[bool]int{true: 1, false: 0}[d == 5]; len(tr) != wantLen {
			t.Errorf("Traces[%d] has %d entries, want %d", d, len(tr), wantLen)
		}
	}
}

func TestRingCapacityPerDevice(t *testing.T) {
	cfg := am.Config{MaxEntries: 3}
	m := am.New(cfg)
	var evs []am.Event
	for i := 0; i < 5; i++ {
		evs = append(evs, malloc(1, int64(i), addrA+uint64(i)*0x1000_0000, 20*mib))
	}
	evs = append(evs, setDevice(2, 1))
	for i := 0; i < 2; i++ {
		evs = append(evs, malloc(2, int64(100+i), 0x2000_0000_0000+uint64(i)*0x1000_0000, small))
	}
	evs = append(evs, setDevice(3, 2))
	for i := 0; i < 7; i++ { // two laps and one more on device 2
		evs = append(evs, free(3, int64(200+i), 0x99_0000+uint64(i)))
	}
	apply(m, evs)

	var segs []am.Segment
	for i := 0; i < 5; i++ {
		segs = append(segs, seg(0, addrA+uint64(i)*0x1000_0000, 20*mib))
	}
	for i := 0; i < 2; i++ {
		segs = append(segs, seg(1, 0x2000_0000_0000+uint64(i)*0x1000_0000, small))
	}
	w := want(cfg, len(evs), segs, [][]am.TraceEntry{
		{segAlloc(2, addrA+2*0x1000_0000, 20*mib), segAlloc(3, addrA+3*0x1000_0000, 20*mib), segAlloc(4, addrA+4*0x1000_0000, 20*mib)},
		{segAlloc(100, 0x2000_0000_0000, small), segAlloc(101, 0x2000_1000_0000, small)},
		{segFree(204, 0x99_0004, 0), segFree(205, 0x99_0005, 0), segFree(206, 0x99_0006, 0)},
	}, am.Counters{SegmentFreesUnknown: 7})
	w.Overwritten = []uint64{2, 0, 4}
	diffSnapshot(t, m.Snapshot(), w)
}

func TestStats(t *testing.T) {
	m := am.New(am.Config{})
	steps := []struct {
		ev   am.Event
		want stats
	}{
		{setDevice(1, 0), stats{Events: 1}},
		{malloc(1, 1, addrA, 20*mib), stats{Events: 2, LiveSegments: 1, ReservedBytes: 20 * mib}},
		{setDevice(2, 3), stats{Events: 3, LiveSegments: 1, ReservedBytes: 20 * mib}},
		{malloc(2, 2, addrB, small), stats{Events: 4, LiveSegments: 2, ReservedBytes: 22 * mib}},
		{free(2, 3, 0), stats{Events: 5, LiveSegments: 2, ReservedBytes: 22 * mib}},
		{free(2, 4, addrC), stats{Events: 6, LiveSegments: 2, ReservedBytes: 22 * mib}},
		{malloc(2, 5, addrA, 4*mib), stats{Events: 7, LiveSegments: 2, ReservedBytes: 6 * mib}}, // over live: replaces 20 mib on device 0
		{oom(1, 6, 64*mib), stats{Events: 8, LiveSegments: 2, ReservedBytes: 6 * mib}},
		{free(1, 7, addrA), stats{Events: 9, LiveSegments: 1, ReservedBytes: 2 * mib}},
		{free(1, 8, addrB), stats{Events: 10}},
	}
	for i, st := range steps {
		m.Apply(&st.ev)
		if got := statsOf(m); got != st.want {
			t.Fatalf("after step %d (%v): Stats = %+v, want %+v", i, st.ev.Call, got, st.want)
		}
	}
	c := m.Snapshot().Counters
	wantC := am.Counters{Events: 10, FreesOfNull: 1, SegmentFreesUnknown: 1, AllocsOverLive: 1, SegmentsOverlapped: 1, OOMs: 1, OOMFreeInferred: 1}
	if c != wantC {
		t.Errorf("Counters = %+v, want %+v", c, wantC)
	}
}

func TestLevel(t *testing.T) {
	m := am.New(am.Config{})
	if m.Level() != am.LevelSegment || m.Snapshot().Level != am.LevelSegment {
		t.Errorf("level %v / snapshot level %v, want segment", m.Level(), m.Snapshot().Level)
	}
}

func TestStrings(t *testing.T) {
	tests := []struct {
		got  fmt.Stringer
		want string
	}{
		{am.LevelSegment, "segment"},
		{am.LevelTensor, "tensor"},
		{am.Level(0), "unknown"},
		{am.SegmentLarge, "large"},
		{am.SegmentSmall, "small"},
		{am.BlockInactive, "inactive"},
		{am.BlockActiveAllocated, "active_allocated"},
		{am.BlockActivePendingFree, "active_pending_free"},
		{am.ActionAlloc, "alloc"},
		{am.ActionFreeRequested, "free_requested"},
		{am.ActionFreeCompleted, "free_completed"},
		{am.ActionSegmentAlloc, "segment_alloc"},
		{am.ActionSegmentFree, "segment_free"},
		{am.ActionSegmentMap, "segment_map"},
		{am.ActionSegmentUnmap, "segment_unmap"},
		{am.ActionOOM, "oom"},
		{am.ActionSnapshot, "snapshot"},
		{am.Action(0), "unknown"},
		{am.Action(200), "unknown"},
		{am.CallMalloc, "aclrtMalloc"},
		{am.CallMallocAlign32, "aclrtMallocAlign32"},
		{am.CallMallocCached, "aclrtMallocCached"},
		{am.CallFree, "aclrtFree"},
		{am.CallSetDevice, "aclrtSetDevice"},
		{am.CallGetDevice, "aclrtGetDevice"},
		{am.CallGetMemInfo, "aclrtGetMemInfo"},
		{am.Call(0), "call?"},
		{am.Call(99), "call?"},
	}
	for _, tt := range tests {
		if got := tt.got.String(); got != tt.want {
			t.Errorf("%T(%d).String() = %q, want %q", tt.got, tt.got, got, tt.want)
		}
	}
	wantActions := []am.Action{am.ActionAlloc, am.ActionFreeRequested, am.ActionFreeCompleted, am.ActionSegmentAlloc,
		am.ActionSegmentFree, am.ActionSegmentMap, am.ActionSegmentUnmap, am.ActionOOM, am.ActionSnapshot}
	if got := am.Actions(); !reflect.DeepEqual(got, wantActions) {
		t.Errorf("Actions() = %v, want %v", got, wantActions)
	}
	for c := am.Call(0); c < 10; c++ {
		wantMalloc := c == am.CallMalloc || c == am.CallMallocAlign32 || c == am.CallMallocCached
		if c.IsMalloc() != wantMalloc {
			t.Errorf("%v.IsMalloc() = %v", c, c.IsMalloc())
		}
	}
}
