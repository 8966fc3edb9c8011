// Package allocmodel rebuilds a torch_npu process's device-memory state
// (segments, blocks, per-device trace rings) from the runtime calls npuprobe
// observes. It is pure Go: no BPF, no system calls, no clocks.
//
// Invariants:
//   - Apply is the only mutator, and events are applied in the order the
//     ring buffer delivered them. Trace entries are appended in that same
//     order, which is the order memory_viz replays them in.
//   - Each trace entry goes to the ring of the device the event is
//     attributed to; rings never share entries.
//   - Live segments are keyed by base address; an allocation at a live base
//     (a free was lost) replaces the old segment and is counted, never
//     silently merged.
//   - What the model infers rather than observes is counted in Counters and
//     labelled in the snapshot (see Level).
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
	// LevelTensor: the caching allocator's entry points are observed too.
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

// Torch's small-pool segment size (kSmallBuffer). At segment level a segment
// of exactly this size is taken to belong to the small pool: large-pool
// segments are 20 MiB, or multiples of 2 MiB of at least 10 MiB.
const smallSegmentSize = 2 << 20

// Config holds the model's settings.
type Config struct {
	// MaxEntries caps each device's trace ring; 0 keeps every entry.
	MaxEntries int
	// DefaultDevice is the device of threads whose device the model never
	// saw (set before attach): runtime allocation calls carry no device.
	DefaultDevice int
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
	// allocated (allocated before attach). Their segment_free entries carry
	// size 0: the size is not knowable from the free call.
	SegmentFreesUnknown uint64
	FreesOfNull         uint64 // aclrtFree(NULL): no entry, the runtime rejects it
	// AllocsOverLive counts allocations returning the base of a segment the
	// model still held live: the matching free was lost.
	AllocsOverLive uint64
	FailedCalls    uint64 // calls that failed with a code other than out-of-memory
	OOMs           uint64
	// OOMFreeInferred counts oom entries whose device_free was estimated
	// from earlier aclrtGetMemInfo results, because the process did not
	// query free memory right after the failure as torch_npu does.
	OOMFreeInferred uint64
}

// Stats is a cheap summary for status lines and metrics.
type Stats struct {
	Events        uint64
	LiveSegments  int
	ReservedBytes uint64
}

type threadState struct {
	device      int
	deviceKnown bool
	// An oom entry waiting for the free-bytes figure of the aclrtGetMemInfo
	// call torch_npu makes right after a failed allocation.
	oomPending bool
	oomDevice  int
	oomEntry   uint64 // absolute ring index
}

type deviceState struct {
	ring     *Ring
	reserved uint64
	// Last aclrtGetMemInfo result on this device, and the bytes reserved
	// then, to estimate free memory at an OOM that is not followed by one.
	memInfoKnown    bool
	memInfoFree     uint64
	memInfoReserved uint64
}

// Model is the rebuilt allocator state of one process.
type Model struct {
	cfg      Config
	level    Level
	segments map[uint64]*Segment
	devices  []*deviceState
	threads  map[uint32]*threadState
	pools    []PoolID
	counters Counters
}

// New returns an empty model at segment level.
func New(cfg Config) *Model {
	if cfg.DefaultDevice < 0 {
		cfg.DefaultDevice = 0
	}
	return &Model{
		cfg:      cfg,
		level:    LevelSegment,
		segments: make(map[uint64]*Segment),
		threads:  make(map[uint32]*threadState),
		pools:    []PoolID{{0, 0}},
	}
}

// Level reports what the model can see.
func (m *Model) Level() Level { return m.level }

// Stats summarises the model.
func (m *Model) Stats() Stats {
	s := Stats{Events: m.counters.Events, LiveSegments: len(m.segments)}
	for _, d := range m.devices {
		s.ReservedBytes += d.reserved
	}
	return s
}

func (m *Model) device(d int) *deviceState {
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

// Apply updates the model with one event.
func (m *Model) Apply(ev *Event) {
	m.counters.Events++
	t := m.thread(ev.Tid)

	// The OOM's free-bytes query, if any, is the thread's very next call.
	if t.oomPending && !(ev.Call == CallGetMemInfo && ev.Outcome == OutcomeReturned) {
		m.inferOOMFree(t)
	}

	switch {
	case ev.Call.IsMalloc():
		m.applyMalloc(t, ev)
	case ev.Call == CallFree:
		m.applyFree(t, ev)
	case ev.Call == CallSetDevice || ev.Call == CallGetDevice:
		if ev.Outcome == OutcomeReturned {
			t.device, t.deviceKnown = int(int32(ev.Arg)), true
		} else {
			m.counters.FailedCalls++
		}
	case ev.Call == CallGetMemInfo:
		m.applyMemInfo(t, ev)
	}
}

func (m *Model) applyMalloc(t *threadState, ev *Event) {
	switch ev.Outcome {
	case OutcomeReturned:
		dev := t.device
		if old := m.segments[ev.Addr]; old != nil {
			m.counters.AllocsOverLive++
			m.device(old.Device).reserved -= old.TotalSize
		}
		seg := &Segment{
			Device:    dev,
			Address:   ev.Addr,
			TotalSize: ev.Size,
			Type:      SegmentLarge,
		}
		if ev.Size == smallSegmentSize {
			seg.Type = SegmentSmall
		}
		seg.Blocks = []Block{{Address: ev.Addr, Size: ev.Size, State: BlockInactive}}
		m.segments[ev.Addr] = seg
		d := m.device(dev)
		d.reserved += ev.Size
		d.ring.Append(TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentAlloc, Addr: ev.Addr, Size: ev.Size})
	case OutcomeOOM:
		m.counters.OOMs++
		d := m.device(t.device)
		abs := d.ring.Append(TraceEntry{MonoNs: ev.MonoNs, Action: ActionOOM, Size: ev.Size})
		t.oomPending, t.oomDevice, t.oomEntry = true, t.device, abs
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
		m.counters.SegmentFreesUnknown++
		m.device(t.device).ring.Append(TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentFree, Addr: ev.Addr})
		return
	}
	delete(m.segments, ev.Addr)
	d := m.device(seg.Device)
	d.reserved -= seg.TotalSize
	d.ring.Append(TraceEntry{MonoNs: ev.MonoNs, Action: ActionSegmentFree, Addr: seg.Address, Size: seg.TotalSize, Stream: seg.Stream, Pool: seg.Pool})
}

func (m *Model) applyMemInfo(t *threadState, ev *Event) {
	if ev.Outcome != OutcomeReturned {
		m.counters.FailedCalls++
		return
	}
	d := m.device(t.device)
	d.memInfoKnown, d.memInfoFree, d.memInfoReserved = true, ev.Addr, d.reserved
	if t.oomPending {
		t.oomPending = false
		if e := m.device(t.oomDevice).ring.At(t.oomEntry); e != nil {
			e.Addr = ev.Addr
		}
	}
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

// Snapshot copies the model's state. An oom entry still waiting for its
// free-bytes query gets an estimate in the copy (counted as inferred there);
// the model keeps waiting, so a later snapshot can carry the observed value.
func (m *Model) Snapshot() *Snapshot {
	s := &Snapshot{
		Level:       m.level,
		Segments:    make([]Segment, 0, len(m.segments)),
		Traces:      make([][]TraceEntry, len(m.devices)),
		Pools:       append([]PoolID(nil), m.pools...),
		MaxEntries:  m.cfg.MaxEntries,
		Overwritten: make([]uint64, len(m.devices)),
		Counters:    m.counters,
	}
	for _, seg := range m.segments {
		c := *seg
		c.Blocks = append([]Block(nil), seg.Blocks...)
		s.Segments = append(s.Segments, c)
	}
	sort.Slice(s.Segments, func(i, j int) bool {
		a, b := &s.Segments[i], &s.Segments[j]
		if a.Device != b.Device {
			return a.Device < b.Device
		}
		return a.Address < b.Address
	})
	for i, d := range m.devices {
		s.Traces[i] = d.ring.Entries()
		s.Overwritten[i] = d.ring.Overwritten()
	}
	for _, t := range m.threads {
		if !t.oomPending {
			continue
		}
		s.Counters.OOMFreeInferred++
		ring := m.devices[t.oomDevice].ring
		if ring.At(t.oomEntry) != nil {
			pos := t.oomEntry - (ring.Appended() - uint64(ring.Len()))
			s.Traces[t.oomDevice][pos].Addr = m.estimateFree(t.oomDevice)
		}
	}
	return s
}
