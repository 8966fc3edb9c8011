// Package allocmodel rebuilds a torch_npu process's device-memory state
// (segments, blocks, per-device trace rings) from the calls npuprobe
// observes. It is pure Go: no BPF, no system calls, no clocks.
//
// Invariants:
//   - Apply is the only mutator, and events are applied in the order the
//     ring buffer delivered them. Trace entries are appended in that same
//     order, which is the order memory_viz replays them in.
//   - Each trace entry goes to the ring of the device the event is
//     attributed to; rings never share entries.
//   - Blocks tile their segment exactly, in address order, at every step.
//   - The model never emits an entry memory_viz could not place: a tensor
//     event for memory the model does not know (allocated before attach) is
//     counted, not recorded.
//   - What the model infers rather than observes is counted in Counters and
//     labelled in the snapshot (see Level and the README).
//   - Snapshot returns a deep copy: segments sorted by (device, address),
//     blocks tiling each segment, rings read oldest to newest.
package allocmodel

import (
	"sort"
)

// Level says how much of the allocator the model can see.
type Level uint8

const (
	// LevelSegment: only runtime calls are observed. Segments and their
	// trace entries (segment_alloc, segment_free, oom) are exact; what lies
	// inside a segment is unknown, so each segment is reported as one
	// inactive block of its full size.
	LevelSegment Level = iota + 1
	// LevelTensor: the caching allocator's entry points are observed too,
	// and the model splits and merges blocks by torch_npu's rules.
	LevelTensor
)

func (l Level) String() string {
	switch l {
	case LevelSegment:
		return "segment"
	case LevelTensor:
		return "tensor"
	}
	return "unknown"
}

// SegmentType is the pool kind torch reports for a segment.
type SegmentType uint8

const (
	SegmentLarge SegmentType = iota
	SegmentSmall
)

func (t SegmentType) String() string {
	if t == SegmentSmall {
		return "small"
	}
	return "large"
}

// BlockState is a block's state as torch names it.
type BlockState uint8

const (
	BlockInactive BlockState = iota
	BlockActiveAllocated
	BlockActivePendingFree
)

func (s BlockState) String() string {
	switch s {
	case BlockActiveAllocated:
		return "active_allocated"
	case BlockActivePendingFree:
		return "active_pending_free"
	}
	return "inactive"
}

// Config holds the model's settings.
type Config struct {
	// Level is what the agent attached; the zero value means LevelSegment.
	Level Level
	// MaxEntries caps each device's trace ring; 0 keeps every entry.
	MaxEntries int
	// DefaultDevice is the device of threads whose device the model never
	// saw (set before attach): runtime allocation calls carry no device.
	DefaultDevice int
	// Alloc is the target's allocator configuration (tensor level).
	Alloc AllocConf
}

// Segment is a range of device memory obtained from the runtime.
type Segment struct {
	Device     int
	Address    uint64
	TotalSize  uint64
	Stream     uint64
	Pool       uint16 // index into Snapshot.Pools
	Type       SegmentType
	Expandable bool
	Blocks     []Block // in address order, tiling [Address, Address+TotalSize)
}

// Block is a piece of a segment.
type Block struct {
	Address       uint64
	Size          uint64
	RequestedSize uint64
	State         BlockState
}

// Counters report what the model saw that it could not fully account for.
// They go into every snapshot's metadata.
type Counters struct {
	Events uint64 // events applied
	// SegmentFreesUnknown counts frees of segments the model never saw
	// allocated (allocated before attach). At segment level their
	// segment_free entries carry size 0: the size is not knowable from the
	// free call. At tensor level they are not recorded.
	SegmentFreesUnknown uint64
	FreesOfNull         uint64 // aclrtFree(NULL) or a null tensor deleter: nothing freed
	// SegmentFreesAllocLost counts frees of segments whose allocation the
	// kernel saw but whose record was lost (ring buffer full).
	SegmentFreesAllocLost uint64
	// AllocsOverLive counts allocations returning the base of a segment the
	// model still held live: the matching free was lost.
	AllocsOverLive uint64
	FailedCalls    uint64 // calls that failed with a code other than out-of-memory
	OOMs           uint64
	// OOMFreeInferred counts oom entries whose device_free was estimated
	// from earlier aclrtGetMemInfo results, because the process did not
	// query free memory right after the failure as torch_npu does.
	OOMFreeInferred uint64

	// Tensor level.

	// FreesOfUnknownBlocks counts tensor frees of blocks the model does not
	// know: tensors allocated before attach. No entry is recorded.
	FreesOfUnknownBlocks uint64
	// AllocsUnplaceable counts tensor allocations in memory outside every
	// known segment (segments obtained before attach), or running past the
	// end of the known segment (the larger segment that replaced it was
	// lost with dropped records). No entry is recorded.
	AllocsUnplaceable uint64
	// AllocsOverLiveBlock counts allocations of a block the model held
	// allocated: its free was lost.
	AllocsOverLiveBlock uint64
	// OutOfOrderSplits counts allocations inside a free block rather than at
	// its start: another thread's allocation that split it was recorded
	// later (it returned later), or the model's split rules disagreed.
	OutOfOrderSplits uint64
	// AlignmentSplits counts allocations in an expandable segment at an
	// aligned address inside a free block (base_addr_aligned_kb).
	AlignmentSplits uint64
	// BlocksMergedRepaired counts blocks merged into an allocation that did
	// not fit its block: the frees that would have merged them were lost.
	BlocksMergedRepaired uint64
	// BlockSplitsRepaired counts allocated blocks the model had to split
	// after the fact because torch split them when the model did not.
	BlockSplitsRepaired uint64
	// SegmentsFreedWithLiveBlocks counts segments returned to the runtime
	// while the model held blocks in them allocated.
	SegmentsFreedWithLiveBlocks uint64
	// InvalidDevices counts device numbers outside [0, MaxDevices): the
	// event was attributed to the default device.
	InvalidDevices uint64
	// Resyncs counts rebuilds from the kernel's live map after lost
	// records; the others count what they changed.
	Resyncs               uint64
	ResyncSegmentsAdded   uint64
	ResyncSegmentsRemoved uint64
	ResyncBlocksChanged   uint64
	// ResyncEntries counts trace entries a resync added, at the resync's
	// time, so that the trace replays to the state it found.
	ResyncEntries uint64
	// MapsOutsideReservation counts page mappings the model could not
	// place in a known reservation (reserved before attach).
	MapsOutsideReservation uint64
	// SegmentsOverlapped counts segments dropped because a new one
	// overlapped them: their free was lost (with its record).
	SegmentsOverlapped uint64
	// RuntimeAllocsOutside counts runtime allocations made outside the
	// caching allocator (workspace, communication libraries, direct runtime
	// users): not part of a torch snapshot.
	RuntimeAllocsOutside uint64
}

// Stats is a cheap summary for status lines and metrics.
type Stats struct {
	Events         uint64
	LiveSegments   int
	ReservedBytes  uint64
	AllocatedBytes uint64
}

// DeviceStats is one device's share of Stats.
type DeviceStats struct {
	ReservedBytes  uint64
	AllocatedBytes uint64
	ActiveBytes    uint64
	// Entries recorded since attach: segment_alloc and segment_map,
	// alloc, oom.
	SegmentAllocs, Allocs, OOMs uint64
}

type block struct {
	addr, size uint64
	requested  uint64
	allocated  bool
	// mapped: backed by device memory. Always true in ordinary segments;
	// in an expandable segment (a VA reservation) only mapped pages are.
	mapped     bool
	seg        *segment
	prev, next *block
}

type segment struct {
	device int
	addr   uint64
	size   uint64
	stream uint64
	small  bool
	// expandable: a virtual-address reservation whose pages are mapped on
	// demand; reported as one segment per contiguous mapped range.
	expandable bool
	head       *block
}

type threadState struct {
	device      int
	deviceKnown bool
	// Segment level: an oom entry waiting for the free-bytes figure of the
	// aclrtGetMemInfo call torch_npu makes right after a failed allocation.
	oomPending bool
	oomDevice  int
	oomEntry   uint64 // absolute ring index
	// Tensor level: a runtime allocation failed for lack of memory inside
	// the current caching-allocator call, so its next aclrtGetMemInfo is
	// the out-of-memory report.
	allocFailed bool
	// Pages mapped or unmapped one by one, recorded as one entry.
	run vmmRun
}

type deviceState struct {
	ring *Ring
	// Entries recorded, by kind, for rates (metrics).
	segmentAllocs, allocs, ooms uint64
	reserved                    uint64
	allocated                   uint64 // tensor level
	active                      uint64 // tensor level
	// Last aclrtGetMemInfo result on this device, and the bytes reserved
	// then, to estimate free memory at an OOM that is not followed by one.
	memInfoKnown    bool
	memInfoFree     uint64
	memInfoReserved uint64
}

// Model is the rebuilt allocator state of one process.
type Model struct {
	cfg      Config
	segments map[uint64]*segment
	blocks   map[uint64]*block // tensor level: every block by address
	outside  map[uint64]uint64 // tensor level: runtime allocations outside the allocator
	handles  map[uint64]physHandle
	pages    map[uint64]uint64 // reservation base → page size
	devices  []*deviceState
	threads  map[uint32]*threadState
	pools    []PoolID
	counters Counters
	lastMono int64 // latest event time applied
	// bases holds every segment's address, sorted, to find the segment
	// containing an address and segments overlapping a new one.
	bases []uint64
}

// addSegment registers seg. A segment it overlaps must have been freed
// with the record of that free lost: it is dropped first, with the entries
// that free it, so the trace replays.
func (m *Model) addSegment(seg *segment) {
	m.dropOverlapping(seg.addr, seg.size)
	m.segments[seg.addr] = seg
	i := sort.Search(len(m.bases), func(i int) bool { return m.bases[i] >= seg.addr })
	m.bases = append(m.bases, 0)
	copy(m.bases[i+1:], m.bases[i:])
	m.bases[i] = seg.addr
	if m.cfg.Level == LevelTensor {
		for b := seg.head; b != nil; b = b.next {
			m.blocks[b.addr] = b
		}
	}
}

func (m *Model) removeSegmentIndex(addr uint64) {
	i := sort.Search(len(m.bases), func(i int) bool { return m.bases[i] >= addr })
	if i < len(m.bases) && m.bases[i] == addr {
		m.bases = append(m.bases[:i], m.bases[i+1:]...)
	}
}

// segmentContaining finds the segment holding ptr.
func (m *Model) segmentContaining(ptr uint64) *segment {
	i := sort.Search(len(m.bases), func(i int) bool { return m.bases[i] > ptr })
	if i == 0 {
		return nil
	}
	if s := m.segments[m.bases[i-1]]; s != nil && ptr < s.addr+s.size {
		return s
	}
	return nil
}

// dropOverlapping drops every segment overlapping [addr, addr+size),
// recording the frees (or unmaps) whose records were lost.
func (m *Model) dropOverlapping(addr, size uint64) {
	i := sort.Search(len(m.bases), func(i int) bool { return m.bases[i] >= addr+size })
	var victims []*segment
	for j := i - 1; j >= 0; j-- {
		s := m.segments[m.bases[j]]
		if s == nil || s.addr+s.size <= addr {
			break
		}
		victims = append(victims, s)
	}
	for _, s := range victims {
		m.counters.SegmentsOverlapped++
		if s.expandable {
			for _, r := range mappedRanges(s) {
				m.record(s.device, TraceEntry{MonoNs: m.lastMono, Action: ActionSegmentUnmap, Addr: r[0], Size: r[1] - r[0], Stream: s.stream})
			}
		} else {
			m.releaseBlocks(s)
			m.record(s.device, TraceEntry{MonoNs: m.lastMono, Action: ActionSegmentFree, Addr: s.addr, Size: s.size, Stream: s.stream})
		}
		m.dropSegment(s)
	}
}

// releaseBlocks records frees of seg's allocated blocks (their records
// were lost) before the segment goes.
func (m *Model) releaseBlocks(seg *segment) {
	for b := seg.head; b != nil; b = b.next {
		if b.allocated {
			e := TraceEntry{MonoNs: m.lastMono, Addr: b.addr, Size: b.requested, Stream: seg.stream, Action: ActionFreeRequested}
			m.record(seg.device, e)
			e.Action = ActionFreeCompleted
			m.record(seg.device, e)
		}
	}
}

// New returns an empty model.
func New(cfg Config) *Model {
	if cfg.DefaultDevice < 0 {
		cfg.DefaultDevice = 0
	}
	if cfg.Level == 0 {
		cfg.Level = LevelSegment
	}
	if cfg.Alloc.Pad == 0 && cfg.Alloc.MaxSplitSize == 0 {
		cfg.Alloc = DefaultAllocConf()
	}
	return &Model{
		cfg:      cfg,
		segments: make(map[uint64]*segment),
		blocks:   make(map[uint64]*block),
		outside:  make(map[uint64]uint64),
		handles:  make(map[uint64]physHandle),
		pages:    make(map[uint64]uint64),
		threads:  make(map[uint32]*threadState),
		pools:    []PoolID{{0, 0}},
	}
}

// Level reports what the model can see.
func (m *Model) Level() Level { return m.cfg.Level }

// SetLevel changes what the model sees from now on: a process that loads
// torch_npu after the runtime moves to tensor level. Segments it holds are
// kept; their blocks are learned as allocations arrive.
func (m *Model) SetLevel(l Level) {
	if l == m.cfg.Level {
		return
	}
	m.cfg.Level = l
	if l == LevelTensor {
		for _, seg := range m.segments {
			for b := seg.head; b != nil; b = b.next {
				m.blocks[b.addr] = b
			}
		}
	}
}

// Counters returns the counters so far.
func (m *Model) Counters() Counters { return m.counters }

// Stats summarises the model.
func (m *Model) Stats() Stats {
	s := Stats{Events: m.counters.Events, LiveSegments: len(m.segments)}
	for _, d := range m.devices {
		s.ReservedBytes += d.reserved
		s.AllocatedBytes += d.allocated
	}
	return s
}

// DeviceStats returns per-device byte counts, indexed by device.
func (m *Model) DeviceStats() []DeviceStats {
	out := make([]DeviceStats, len(m.devices))
	for i, d := range m.devices {
		out[i] = DeviceStats{ReservedBytes: d.reserved, AllocatedBytes: d.allocated, ActiveBytes: d.active,
			SegmentAllocs: d.segmentAllocs, Allocs: d.allocs, OOMs: d.ooms}
	}
	return out
}

// MaxDevices bounds device numbers: an Ascend host has at most 16 NPUs, so
// anything past this is a misread value, and growing per-device state to
// it would waste memory.
const MaxDevices = 64

func (m *Model) device(d int) *deviceState {
	if d < 0 || d >= MaxDevices {
		m.counters.InvalidDevices++
		d = m.cfg.DefaultDevice
	}
	for len(m.devices) <= d {
		m.devices = append(m.devices, &deviceState{ring: NewRing(m.cfg.MaxEntries)})
	}
	return m.devices[d]
}

func (m *Model) thread(tid uint32) *threadState {
	t := m.threads[tid]
	if t == nil {
		t = &threadState{device: m.cfg.DefaultDevice}
		m.threads[tid] = t
	}
	return t
}

func (m *Model) record(dev int, e TraceEntry) uint64 {
	d := m.device(dev)
	switch e.Action {
	case ActionSegmentAlloc, ActionSegmentMap:
		d.segmentAllocs++
	case ActionAlloc:
		d.allocs++
	case ActionOOM:
		d.ooms++
	}
	return d.ring.Append(e)
}

// Apply updates the model with one event.
func (m *Model) Apply(ev *Event) {
	m.counters.Events++
	if ev.MonoNs > m.lastMono {
		m.lastMono = ev.MonoNs
	}
	t := m.thread(ev.Tid)

	// Segment level: the OOM's free-bytes query, if any, is the thread's
	// very next call.
	if t.oomPending && !(ev.Call == CallGetMemInfo && ev.Outcome == OutcomeReturned) {
		m.inferOOMFree(t)
	}
	// A run of page maps (or unmaps) ends with the thread's first other call.
	if t.run.active && !t.run.continues(ev) {
		m.flushRun(t)
	}

	switch {
	case ev.Call.IsVMM():
		m.applyVMM(t, ev)
	case ev.Call.IsMalloc():
		if m.cfg.Level == LevelTensor {
			m.applyTensorLevelMalloc(t, ev)
		} else {
			m.applyMalloc(t, ev)
		}
	case ev.Call == CallFree:
		m.applyFree(t, ev)
	case ev.Call == CallSetDevice || ev.Call == CallGetDevice:
		if dev := int(int32(ev.Arg)); ev.Outcome == OutcomeReturned && dev >= 0 && dev < MaxDevices {
			t.device, t.deviceKnown = dev, true
		} else if ev.Outcome == OutcomeReturned {
			m.counters.InvalidDevices++
		} else {
			m.counters.FailedCalls++
		}
	case ev.Call == CallGetMemInfo:
		m.applyMemInfo(t, ev)
	case ev.Call.IsTensorAlloc() && m.cfg.Level == LevelTensor:
		m.applyTensorAlloc(t, ev)
	case ev.Call.IsTensorFree() && m.cfg.Level == LevelTensor:
		m.applyTensorFree(ev)
	}
}

// newSegment adds a segment of one free block.
func (m *Model) newSegment(dev int, addr, size, stream uint64, small bool) *segment {
	if old := m.segments[addr]; old != nil {
		m.counters.AllocsOverLive++
	}
	seg := &segment{device: dev, addr: addr, size: size, stream: stream, small: small}
	seg.head = &block{addr: addr, size: size, seg: seg, mapped: true}
	m.addSegment(seg)
	m.device(dev).reserved += size
	return seg
}

// dropSegment forgets a segment and its blocks.
func (m *Model) dropSegment(seg *segment) {
	d := m.device(seg.device)
	for b := seg.head; b != nil; b = b.next {
		if b.mapped {
			d.reserved -= b.size
		}
		if m.blocks[b.addr] == b {
			delete(m.blocks, b.addr)
		}
		if b.allocated {
			d.allocated -= b.size
			d.active -= b.size
		}
	}
	delete(m.segments, seg.addr)
	m.removeSegmentIndex(seg.addr)
}

func (m *Model) applyMalloc(t *threadState, ev *Event) {
	switch ev.Outcome {
	case OutcomeReturned:
		if ev.Size == 0 || ev.Addr == 0 {
			m.counters.FailedCalls++ // the runtime never returns these: a corrupt record
			return
		}
		// torch_npu's small-pool segments are exactly kSmallBuffer; large
		// ones are 20 MiB or multiples of 2 MiB of at least 10 MiB.
		seg := m.newSegment(t.device, ev.Addr, ev.Size, 0, ev.Size == smallBuffer)
		m.record(seg.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentAlloc, Addr: ev.Addr, Size: ev.Size})
	case OutcomeOOM:
		m.counters.OOMs++
		abs := m.record(t.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionOOM, Size: ev.Size})
		t.oomPending, t.oomDevice, t.oomEntry = true, t.device, abs
	default:
		m.counters.FailedCalls++
	}
}

// applyTensorLevelMalloc handles a runtime allocation when the caching
// allocator's own calls are observed too.
func (m *Model) applyTensorLevelMalloc(t *threadState, ev *Event) {
	switch {
	case !ev.Ctx.Valid:
		// Not made by the caching allocator: torch's snapshot does not show it.
		if ev.Outcome == OutcomeReturned {
			m.counters.RuntimeAllocsOutside++
			m.outside[ev.Addr] = ev.Size
		} else {
			m.counters.FailedCalls++
		}
	case ev.Outcome == OutcomeReturned && (ev.Size == 0 || ev.Addr == 0):
		m.counters.FailedCalls++ // the runtime never returns these: a corrupt record
	case ev.Outcome == OutcomeReturned:
		dev := t.device
		if ev.Ctx.HasDevice {
			dev = ev.Ctx.Device
		}
		var stream uint64
		if ev.Ctx.HasStream {
			stream = ev.Ctx.Stream
		}
		small := isSmallRequest(m.cfg.Alloc.RoundSize(ev.Ctx.Size))
		seg := m.newSegment(dev, ev.Addr, ev.Size, stream, small)
		m.record(seg.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentAlloc, Addr: ev.Addr, Size: ev.Size, Stream: stream})
	case ev.Outcome == OutcomeOOM:
		// torch_npu now frees its cache and retries; the oom entry comes
		// only if that fails too, after it asks for free memory.
		t.allocFailed = true
	default:
		m.counters.FailedCalls++
	}
}

func (m *Model) applyFree(t *threadState, ev *Event) {
	if ev.Addr == 0 {
		m.counters.FreesOfNull++
		return
	}
	seg := m.segments[ev.Addr]
	if seg == nil {
		if _, ok := m.outside[ev.Addr]; ok {
			delete(m.outside, ev.Addr)
			return
		}
		if ev.Size != 0 {
			// The kernel saw this allocation; its record was lost. Its
			// segment_alloc is recorded just before the free (same time),
			// so the segment exists only there in a replay: placed anywhere
			// earlier it could overlap segments that lived at the same
			// address before it.
			m.counters.SegmentFreesAllocLost++
			m.dropOverlapping(ev.Addr, ev.Size)
			e := TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentAlloc, Addr: ev.Addr, Size: ev.Size}
			m.record(t.device, e)
			e.Action = ActionSegmentFree
			m.record(t.device, e)
			return
		}
		m.counters.SegmentFreesUnknown++
		if m.cfg.Level == LevelSegment {
			m.record(t.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentFree, Addr: ev.Addr})
		}
		return
	}
	for b := seg.head; b != nil; b = b.next {
		if b.allocated {
			// The allocator releases only wholly free segments: these
			// blocks' frees were lost. Record them first.
			m.counters.SegmentsFreedWithLiveBlocks++
			m.releaseBlocks(seg)
			break
		}
	}
	m.dropSegment(seg)
	m.record(seg.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentFree, Addr: seg.addr, Size: seg.size, Stream: seg.stream})
}

func (m *Model) applyMemInfo(t *threadState, ev *Event) {
	if ev.Outcome != OutcomeReturned {
		m.counters.FailedCalls++
		return
	}
	dev := t.device
	if ev.Ctx.HasDevice {
		dev = ev.Ctx.Device
	}
	d := m.device(dev)
	d.memInfoKnown, d.memInfoFree, d.memInfoReserved = true, ev.Addr, d.reserved
	if t.oomPending {
		t.oomPending = false
		if e := m.device(t.oomDevice).ring.At(t.oomEntry); e != nil {
			e.Addr = ev.Addr
		}
	}
	if m.cfg.Level == LevelTensor && ev.Ctx.Valid && t.allocFailed {
		// The caching allocator's out-of-memory report: after its retries
		// failed it asks for free memory, records oom with the rounded
		// request, and throws.
		t.allocFailed = false
		m.counters.OOMs++
		var stream uint64
		if ev.Ctx.HasStream {
			stream = ev.Ctx.Stream
		}
		m.record(dev, TraceEntry{MonoNs: ev.MonoNs, Action: ActionOOM, Addr: ev.Addr,
			Size: m.cfg.Alloc.RoundSize(ev.Ctx.Size), Stream: stream})
	}
}

// OOMPending reports whether an oom entry still waits for the free-bytes
// figure of the aclrtGetMemInfo call torch_npu makes after a failed
// allocation: a snapshot taken now would carry an estimate.
func (m *Model) OOMPending() bool {
	for _, t := range m.threads {
		if t.oomPending {
			return true
		}
	}
	return false
}

// inferOOMFree settles a pending oom entry that no aclrtGetMemInfo followed.
func (m *Model) inferOOMFree(t *threadState) {
	t.oomPending = false
	m.counters.OOMFreeInferred++
	if e := m.device(t.oomDevice).ring.At(t.oomEntry); e != nil {
		e.Addr = m.estimateFree(t.oomDevice)
	}
}

// estimateFree is the device's free memory as last observed by
// aclrtGetMemInfo, less what was reserved since; 0 when it was never
// observed.
func (m *Model) estimateFree(dev int) uint64 {
	d := m.device(dev)
	if !d.memInfoKnown {
		return 0
	}
	free := int64(d.memInfoFree) - (int64(d.reserved) - int64(d.memInfoReserved))
	if free < 0 {
		return 0
	}
	return uint64(free)
}

// Snapshot is a deep copy of the model's state.
type Snapshot struct {
	Level      Level
	Segments   []Segment      // sorted by (Device, Address)
	Traces     [][]TraceEntry // index: device; oldest first
	Pools      []PoolID
	MaxEntries int
	// Overwritten counts, per device, trace entries lost to ring wrapping.
	Overwritten []uint64
	Counters    Counters
}

// appendSegments appends seg as torch reports it: an ordinary segment
// whole; an expandable one as one segment per contiguous mapped range.
func appendSegments(out []Segment, seg *segment) []Segment {
	typ := SegmentLarge
	if seg.small {
		typ = SegmentSmall
	}
	var cur *Segment
	for b := seg.head; b != nil; b = b.next {
		if !b.mapped {
			cur = nil
			continue
		}
		if cur == nil {
			out = append(out, Segment{Device: seg.device, Address: b.addr, Stream: seg.stream, Type: typ, Expandable: seg.expandable})
			cur = &out[len(out)-1]
		}
		st := BlockInactive
		if b.allocated {
			st = BlockActiveAllocated
		}
		cur.Blocks = append(cur.Blocks, Block{Address: b.addr, Size: b.size, RequestedSize: b.requested, State: st})
		cur.TotalSize += b.size
	}
	return out
}

// Snapshot copies the model's state. An oom entry still waiting for its
// free-bytes query gets an estimate in the copy (counted as inferred there);
// the model keeps waiting, so a later snapshot can carry the observed value.
func (m *Model) Snapshot() *Snapshot {
	v := m.View()
	s := &v.Snapshot
	s.Traces = make([][]TraceEntry, v.Devices())
	for dev := range s.Traces {
		s.Traces[dev] = make([]TraceEntry, v.TraceLen(dev))
		for i := range s.Traces[dev] {
			s.Traces[dev][i] = v.TraceEntry(dev, i)
		}
	}
	return s
}

// View is the model's state for writing a snapshot without copying the
// trace rings, which may hold millions of entries: segments are copied
// (Snapshot.Traces is left empty), traces are read from the rings. It is
// valid until the model next changes, so it must be used, and dropped, on
// the goroutine that applies events.
type View struct {
	Snapshot
	rings []*Ring
	// Estimated free bytes for oom entries still waiting for theirs,
	// by device and position.
	patches map[[2]int]uint64
}

// View returns the model's state as a View (see Snapshot for what an oom
// entry waiting for its free-bytes figure shows).
func (m *Model) View() *View {
	for _, t := range m.threads {
		if t.run.active {
			m.flushRun(t)
		}
	}
	v := &View{Snapshot: Snapshot{
		Level:       m.cfg.Level,
		Segments:    make([]Segment, 0, len(m.segments)),
		Pools:       append([]PoolID(nil), m.pools...),
		MaxEntries:  m.cfg.MaxEntries,
		Overwritten: make([]uint64, len(m.devices)),
		Counters:    m.counters,
	}}
	for _, seg := range m.segments {
		v.Segments = appendSegments(v.Segments, seg)
	}
	sort.Slice(v.Segments, func(i, j int) bool {
		a, b := &v.Segments[i], &v.Segments[j]
		if a.Device != b.Device {
			return a.Device < b.Device
		}
		return a.Address < b.Address
	})
	for i, d := range m.devices {
		v.rings = append(v.rings, d.ring)
		v.Overwritten[i] = d.ring.Overwritten()
	}
	for _, t := range m.threads {
		if !t.oomPending {
			continue
		}
		v.Counters.OOMFreeInferred++
		ring := m.devices[t.oomDevice].ring
		if ring.At(t.oomEntry) != nil {
			if v.patches == nil {
				v.patches = make(map[[2]int]uint64)
			}
			pos := int(t.oomEntry - (ring.Appended() - uint64(ring.Len())))
			v.patches[[2]int{t.oomDevice, pos}] = m.estimateFree(t.oomDevice)
		}
	}
	return v
}

// Devices is the number of device traces.
func (v *View) Devices() int { return len(v.rings) }

// TraceLen is the number of entries in a device's trace.
func (v *View) TraceLen(dev int) int { return v.rings[dev].Len() }

// TraceEntry returns a device's i-th entry, oldest first.
func (v *View) TraceEntry(dev, i int) TraceEntry {
	e := v.rings[dev].Get(i)
	if a, ok := v.patches[[2]int{dev, i}]; ok {
		e.Addr = a
	}
	return e
}
