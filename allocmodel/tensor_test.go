package allocmodel_test

import (
	"math"
	"reflect"
	"testing"

	"github.com/npuprobe/npuprobe/allocmodel"
)

func TestRoundSize(t *testing.T) {
	def := allocmodel.DefaultAllocConf()
	// The spec's examples (torch_npu round_size with the +32 pad).
	for orig, want := range map[uint64]uint64{
		0: 512, 1: 512, 480: 512, 481: 1024, 512: 1024, 1000: 1536, 4096: 4608,
		1 << 20: 1<<20 + 512, 10 << 20: 10<<20 + 512,
	} {
		if got := def.RoundSize(orig); got != want {
			t.Errorf("RoundSize(%d) = %d, want %d", orig, got, want)
		}
	}
	// roundup_power2_divisions:4 → sizes above 2 KiB round up to quarters
	// between powers of two (padded size decides).
	c, err := allocmodel.ParseAllocConf("roundup_power2_divisions:4")
	if err != nil {
		t.Fatal(err)
	}
	for orig, want := range map[uint64]uint64{
		1000:              1536,                  // 1032 <= 512*4: plain rounding
		3000:              3072,                  // 3032 → quarters of 2048: 2560, 3072
		5<<20 + 1:         6 << 20,               // quarters of 4 MiB: 5 MiB, 6 MiB
		(8 << 20) - 32:    8 << 20,               // padded size is a power of two
		(1 << 30) + 12345: (1 << 30) + (1 << 28), // quarter of 1 GiB
	} {
		if got := c.RoundSize(orig); got != want {
			t.Errorf("divisions 4: RoundSize(%d) = %d, want %d", orig, got, want)
		}
	}
}

func TestParseAllocConf(t *testing.T) {
	c, err := allocmodel.ParseAllocConf("max_split_size_mb:64, roundup_power2_divisions:[1:2,256:4,>:8],expandable_segments:False,garbage_collection_threshold:0.6")
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxSplitSize != 64<<20 {
		t.Errorf("MaxSplitSize = %d", c.MaxSplitSize)
	}
	want := [16]uint64{2, 0, 0, 0, 0, 0, 0, 0, 4, 8, 8, 8, 8, 8, 8, 8}
	if c.RoundupDivisions != want {
		t.Errorf("RoundupDivisions = %v, want %v", c.RoundupDivisions, want)
	}
	for _, bad := range []string{"max_split_size_mb:x", "roundup_power2_divisions:3", "roundup_power2_divisions:[3:2]",
		"expandable_segments:yes", "base_addr_aligned_kb:32", "novalue"} {
		if _, err := allocmodel.ParseAllocConf(bad); err == nil {
			t.Errorf("ParseAllocConf(%q) accepted", bad)
		}
	}
	env := map[string]string{"PYTORCH_ALLOC_CONF": "max_split_size_mb:100"}
	c, err = allocmodel.AllocConfFromEnv(env)
	if err != nil || c.Source != "PYTORCH_ALLOC_CONF" || c.MaxSplitSize != 100<<20 {
		t.Errorf("from env: %+v, %v", c, err)
	}
	c, err = allocmodel.AllocConfFromEnv(nil)
	if err != nil || c.MaxSplitSize != math.MaxUint64 || c.Pad != 32 {
		t.Errorf("default: %+v, %v", c, err)
	}
}

// tensorModel drives a tensor-level model with calls as the agent decodes them.
type tensorModel struct {
	t   *testing.T
	m   *allocmodel.Model
	now int64
}

func newTensorModel(t *testing.T, conf string) *tensorModel {
	c, err := allocmodel.ParseAllocConf(conf)
	if err != nil {
		t.Fatal(err)
	}
	return &tensorModel{t: t, m: allocmodel.New(allocmodel.Config{Level: allocmodel.LevelTensor, Alloc: c})}
}

func (tm *tensorModel) apply(ev allocmodel.Event) {
	tm.now++
	ev.MonoNs = tm.now
	if ev.Tid == 0 {
		ev.Tid = 1
	}
	tm.m.Apply(&ev)
}

// segment: the allocator obtains a segment while serving a request of reqSize.
func (tm *tensorModel) segment(addr, size, reqSize uint64) {
	tm.apply(allocmodel.Event{Call: allocmodel.CallMallocAlign32, Outcome: allocmodel.OutcomeReturned, Addr: addr, Size: size,
		Ctx: allocmodel.Context{Valid: true, Size: reqSize, HasStream: true, Stream: 0xabc, HasDevice: true, Device: 0}})
}

func (tm *tensorModel) alloc(ptr, size uint64) {
	tm.apply(allocmodel.Event{Call: allocmodel.CallTorchAllocate, Outcome: allocmodel.OutcomeReturned, Addr: ptr, Size: size,
		Arg: 20<<8 | 0, Ctx: allocmodel.Context{HasStream: true, Stream: 0xabc, HasDevice: true}})
}

func (tm *tensorModel) free(ptr uint64) {
	tm.apply(allocmodel.Event{Call: allocmodel.CallTorchLocalRawDelete, Outcome: allocmodel.OutcomeEntry, Addr: ptr})
}

func (tm *tensorModel) releaseSegment(addr uint64) {
	tm.apply(allocmodel.Event{Call: allocmodel.CallFree, Outcome: allocmodel.OutcomeEntry, Addr: addr})
}

type blk struct {
	size, req uint64
	state     allocmodel.BlockState
}

func (tm *tensorModel) wantBlocks(segAddr uint64, want ...blk) {
	tm.t.Helper()
	snap := tm.m.Snapshot()
	for _, s := range snap.Segments {
		if s.Address != segAddr {
			continue
		}
		var got []blk
		addr := s.Address
		for _, b := range s.Blocks {
			if b.Address != addr {
				tm.t.Fatalf("block at %#x, want %#x: blocks do not tile", b.Address, addr)
			}
			addr += b.Size
			got = append(got, blk{b.Size, b.RequestedSize, b.State})
		}
		if addr != s.Address+s.TotalSize {
			tm.t.Fatalf("blocks end at %#x, segment at %#x", addr, s.Address+s.TotalSize)
		}
		if !reflect.DeepEqual(got, want) {
			tm.t.Fatalf("segment %#x blocks = %+v, want %+v", segAddr, got, want)
		}
		return
	}
	tm.t.Fatalf("no segment at %#x", segAddr)
}

const (
	inactive  = allocmodel.BlockInactive
	allocated = allocmodel.BlockActiveAllocated
)

// The spec's worked example: a small segment, two tensors, the first freed.
func TestTensorWorkedExample(t *testing.T) {
	tm := newTensorModel(t, "")
	const seg = 0x12C040000000
	tm.segment(seg, 2<<20, 4096)
	tm.alloc(seg, 4096)
	tm.alloc(seg+0x1200, 1000)
	tm.free(seg)
	tm.wantBlocks(seg, blk{4608, 4096, inactive}, blk{1536, 1000, allocated}, blk{2091008, 0, inactive})

	snap := tm.m.Snapshot()
	var actions []string
	for _, e := range snap.Traces[0] {
		actions = append(actions, e.Action.String())
	}
	want := []string{"segment_alloc", "alloc", "alloc", "free_requested", "free_completed"}
	if !reflect.DeepEqual(actions, want) {
		t.Fatalf("trace %v, want %v", actions, want)
	}
	if e := snap.Traces[0][2]; e.Addr != seg+0x1200 || e.Size != 1000 || e.Stream != 0xabc {
		t.Errorf("second alloc entry %+v", e)
	}
	if e := snap.Traces[0][3]; e.Addr != seg || e.Size != 4096 {
		t.Errorf("free_requested %+v: want the block's requested size", e)
	}
	if snap.Segments[0].Type != allocmodel.SegmentSmall || snap.Segments[0].Stream != 0xabc {
		t.Errorf("segment %+v", snap.Segments[0])
	}
	st := tm.m.Stats()
	if st.AllocatedBytes != 1536 || st.ReservedBytes != 2<<20 {
		t.Errorf("stats %+v", st)
	}
}

func TestTensorMergeKeepsFreedBlocksRequest(t *testing.T) {
	tm := newTensorModel(t, "")
	const seg = 0x1000000
	tm.segment(seg, 2<<20, 1000)
	tm.alloc(seg, 1000)      // 1536
	tm.alloc(seg+1536, 2500) // 2560
	tm.alloc(seg+4096, 100)  // 512
	tm.free(seg)             // free, neighbour allocated: no merge
	tm.free(seg + 4096)      // merges with the free remainder after it
	tm.wantBlocks(seg, blk{1536, 1000, inactive}, blk{2560, 2500, allocated}, blk{2<<20 - 4096, 100, inactive})
	tm.free(seg + 1536) // merges both sides, keeps its own request
	tm.wantBlocks(seg, blk{2 << 20, 2500, inactive})
	// The whole segment is free: releasing it records segment_free.
	tm.releaseSegment(seg)
	snap := tm.m.Snapshot()
	if len(snap.Segments) != 0 {
		t.Fatalf("segment not released: %+v", snap.Segments)
	}
	last := snap.Traces[0][len(snap.Traces[0])-1]
	if last.Action != allocmodel.ActionSegmentFree || last.Addr != seg || last.Size != 2<<20 {
		t.Fatalf("last entry %+v", last)
	}
}

func TestTensorLargePoolSplitRules(t *testing.T) {
	// Large pool: split only if the remainder exceeds 1 MiB and the request
	// is below max_split_size.
	tm := newTensorModel(t, "max_split_size_mb:8")
	const seg = 0x40000000
	tm.segment(seg, 20<<20, 19<<20)
	tm.alloc(seg, 19<<20) // 19 MiB + 512: remainder < 1 MiB → no split
	tm.wantBlocks(seg, blk{20 << 20, 19 << 20, allocated})

	const seg2 = 0x80000000
	tm.segment(seg2, 20<<20, 2<<20)
	tm.alloc(seg2, 2<<20) // below max_split_size, remainder 18 MiB → split
	tm.wantBlocks(seg2, blk{2<<20 + 512, 2 << 20, allocated}, blk{18<<20 - 512, 0, inactive})

	const seg3 = 0xC0000000
	tm.segment(seg3, 40<<20, 9<<20)
	tm.free(seg2)
	tm.alloc(seg3, 9<<20) // 9 MiB ≥ max_split_size 8 MiB → whole block
	tm.wantBlocks(seg3, blk{40 << 20, 9 << 20, allocated})
}

func TestTensorRepairs(t *testing.T) {
	tm := newTensorModel(t, "")
	const seg = 0x2000000
	tm.segment(seg, 2<<20, 1000)
	// Thread 2's allocation of the remainder is recorded before thread 1's
	// allocation that split the block off (thread 1 returned later).
	tm.alloc(seg+1536, 700)
	tm.alloc(seg, 1000)
	tm.wantBlocks(seg, blk{1536, 1000, allocated}, blk{1024, 700, allocated}, blk{2<<20 - 2560, 0, inactive})
	c := tm.m.Counters()
	if c.OutOfOrderSplits != 1 {
		t.Errorf("OutOfOrderSplits = %d", c.OutOfOrderSplits)
	}

	// A large block the model kept whole (its max_split_size is wrong)
	// that torch split: the next allocation inside it reveals the split.
	tm2 := newTensorModel(t, "max_split_size_mb:2")
	const big = 0x90000000
	tm2.segment(big, 20<<20, 2<<20)
	tm2.alloc(big, 2<<20)
	tm2.wantBlocks(big, blk{20 << 20, 2 << 20, allocated})
	tm2.alloc(big+2<<20+512, 1<<20)
	tm2.wantBlocks(big, blk{2<<20 + 512, 2 << 20, allocated}, blk{1<<20 + 512, 1 << 20, allocated}, blk{17<<20 - 1024, 0, inactive})
	if c := tm2.m.Counters(); c.BlockSplitsRepaired != 1 {
		t.Errorf("BlockSplitsRepaired = %d", c.BlockSplitsRepaired)
	}
	if st := tm2.m.Stats(); st.AllocatedBytes != 3<<20+1024 {
		t.Errorf("allocated bytes %d after repair", st.AllocatedBytes)
	}
}

func TestTensorUnknownMemory(t *testing.T) {
	tm := newTensorModel(t, "")
	tm.free(0x5000)              // tensor from before attach
	tm.alloc(0x7000, 100)        // in a segment from before attach
	tm.releaseSegment(0x9000000) // segment from before attach
	tm.free(0)                   // null deleter
	snap := tm.m.Snapshot()
	if len(snap.Segments) != 0 || len(snap.Traces) != 0 {
		t.Fatalf("unknown memory produced state: %+v", snap)
	}
	c := tm.m.Counters()
	if c.FreesOfUnknownBlocks != 1 || c.AllocsUnplaceable != 1 || c.SegmentFreesUnknown != 1 || c.FreesOfNull != 1 {
		t.Fatalf("counters %+v", c)
	}
}

func TestTensorOOM(t *testing.T) {
	tm := newTensorModel(t, "")
	ctx := allocmodel.Context{Valid: true, Size: 5 << 30, HasStream: true, Stream: 0xabc, HasDevice: true, Device: 0}
	// Allocation fails, the allocator releases its cache and retries, then
	// asks for free memory and records oom with the rounded request.
	tm.apply(allocmodel.Event{Call: allocmodel.CallMallocAlign32, Outcome: allocmodel.OutcomeOOM, RC: 207001, Size: 5 << 30, Ctx: ctx})
	tm.apply(allocmodel.Event{Call: allocmodel.CallMallocAlign32, Outcome: allocmodel.OutcomeOOM, RC: 207001, Size: 5 << 30, Ctx: ctx})
	tm.apply(allocmodel.Event{Call: allocmodel.CallGetMemInfo, Outcome: allocmodel.OutcomeReturned, Arg: 1, Addr: 123 << 20, Size: 8 << 30, Ctx: ctx})
	// A later, unrelated free-memory query is not an OOM.
	tm.apply(allocmodel.Event{Call: allocmodel.CallGetMemInfo, Outcome: allocmodel.OutcomeReturned, Arg: 1, Addr: 1, Size: 8 << 30, Ctx: ctx})
	snap := tm.m.Snapshot()
	if len(snap.Traces) != 1 || len(snap.Traces[0]) != 1 {
		t.Fatalf("trace %+v", snap.Traces)
	}
	e := snap.Traces[0][0]
	want := allocmodel.DefaultAllocConf()
	if e.Action != allocmodel.ActionOOM || e.Addr != 123<<20 || e.Size != want.RoundSize(5<<30) || e.Stream != 0xabc {
		t.Fatalf("oom entry %+v", e)
	}
}

func TestTensorRuntimeAllocationsOutsideAllocator(t *testing.T) {
	tm := newTensorModel(t, "")
	tm.apply(allocmodel.Event{Call: allocmodel.CallMallocAlign32, Outcome: allocmodel.OutcomeReturned, Addr: 0x100000, Size: 2 << 20, Arg: 1})
	tm.releaseSegment(0x100000)
	snap := tm.m.Snapshot()
	if len(snap.Segments) != 0 || len(snap.Traces) != 0 {
		t.Fatalf("workspace-style allocation entered the snapshot: %+v", snap)
	}
	if c := tm.m.Counters(); c.RuntimeAllocsOutside != 1 || c.SegmentFreesUnknown != 0 {
		t.Fatalf("counters %+v", c)
	}
}

// TestTensorAllocPastLostSegment: records of the allocator releasing a
// segment and obtaining a larger one at the same address were lost. An
// allocation that only fits the larger segment is not placed in the
// model's stale, smaller one (the trace would free a block running past
// its segment, and memory_viz cannot draw that); the resync brings in the
// segment and the block, and the whole trace replays.
func TestTensorAllocPastLostSegment(t *testing.T) {
	tm := newTensorModel(t, "")
	const seg = 0x40000000
	tm.segment(seg, 20<<20, 12<<20)
	tm.alloc(seg, 12<<20)
	tm.free(seg)
	// Lost: the segment's release and a 40 MiB one at the same address.
	tm.alloc(seg, 30<<20)
	if c := tm.m.Counters(); c.AllocsUnplaceable != 1 || c.BlocksMergedRepaired != 0 {
		t.Fatalf("an allocation past the segment's end was placed: %+v", c)
	}
	tm.m.Resync(allocmodel.LiveState{
		Segments: []allocmodel.LiveAllocation{{Addr: seg, Size: 40 << 20, Device: 0, ByAllocator: true}},
		Blocks:   []allocmodel.LiveAllocation{{Addr: seg, Size: 30 << 20, Device: 0}},
	})
	conf := allocmodel.DefaultAllocConf()
	want := conf.RoundSize(30 << 20)
	tm.wantBlocks(seg, blk{want, 30 << 20, allocated}, blk{40<<20 - want, 0, inactive})
	replayBackwards(t, tm.m.Snapshot())
}

// replayBackwards undoes a device's trace from the snapshot's state, as
// memory_viz does to draw it, and fails where an entry does not fit the
// state it undoes: an alloc or free outside every segment or running past
// its end, a segment freed or allocated twice. Expandable segments are
// not covered.
func replayBackwards(t *testing.T, snap *allocmodel.Snapshot) {
	t.Helper()
	for dev, trace := range snap.Traces {
		segs := map[uint64]uint64{} // address → size
		live := map[uint64]bool{}   // allocated block addresses
		for _, s := range snap.Segments {
			if s.Device != dev {
				continue
			}
			segs[s.Address] = s.TotalSize
			for _, b := range s.Blocks {
				if b.State == allocated {
					live[b.Address] = true
				}
			}
		}
		inSegment := func(addr, size uint64) bool {
			for a, n := range segs {
				if addr >= a && addr+size <= a+n {
					return true
				}
			}
			return false
		}
		for i := len(trace) - 1; i >= 0; i-- {
			e := trace[i]
			switch e.Action {
			case allocmodel.ActionSegmentAlloc:
				if segs[e.Addr] != e.Size {
					t.Fatalf("device %d entry %d: segment_alloc %#x+%d, state has size %d", dev, i, e.Addr, e.Size, segs[e.Addr])
				}
				delete(segs, e.Addr)
			case allocmodel.ActionSegmentFree:
				if _, ok := segs[e.Addr]; ok {
					t.Fatalf("device %d entry %d: segment_free %#x of a segment that exists after it", dev, i, e.Addr)
				}
				segs[e.Addr] = e.Size
			case allocmodel.ActionAlloc:
				if !live[e.Addr] || !inSegment(e.Addr, e.Size) {
					t.Fatalf("device %d entry %d: alloc %#x+%d not live in a segment after it", dev, i, e.Addr, e.Size)
				}
				delete(live, e.Addr)
			case allocmodel.ActionFreeCompleted:
				if live[e.Addr] || !inSegment(e.Addr, e.Size) {
					t.Fatalf("device %d entry %d: free %#x+%d not free inside a segment after it", dev, i, e.Addr, e.Size)
				}
				live[e.Addr] = true
			}
		}
	}
}
