// Package snapshot reads and writes PyTorch memory snapshots (the pickles
// pytorch.org/memory_viz opens) of any origin: npuprobe's, torch_npu's
// (`torch.npu.memory._dump_snapshot` and the C++ protocol-2 pickler of its
// OOM dumps), and CUDA's. It also holds the tools built on them: augment
// (time_us for torch_npu dumps from an npuprobe recording), merge (per-rank
// files into one, a device per rank), stats (a summary) and plot (an HTML
// page).
//
// Reading validates the pickle opcodes before decoding (protocol 2-4, the
// opcodes memory_viz understands, no data after STOP), decodes with
// github.com/nlpodyssey/gopickle, then checks every key the format requires
// and the type of every known key (see /work/shared/spec/snapshot-format.md).
// Every problem is one *FormatError naming the file and the place; malformed
// input never panics.
//
// Writing keeps npuprobe's rules (package output): protocol 4, only opcodes
// memory_viz reads, integers within ±2^53, and no object shared through the
// memo but strings and int pairs.
package snapshot

// Value is a generic pickled value: nil (None), bool, int64, float64,
// string, List, Tuple or *Dict.
type Value = any

// List is a pickled list.
type List []Value

// Tuple is a pickled tuple.
type Tuple []Value

// Dict is a pickled dict, in insertion order.
type Dict struct {
	Items []Item
}

// Item is one key/value pair of a Dict.
type Item struct {
	Key   Value
	Value Value
}

// Get returns the value of a string key.
func (d *Dict) Get(key string) (Value, bool) {
	if d == nil {
		return nil, false
	}
	for i := range d.Items {
		if k, ok := d.Items[i].Key.(string); ok && k == key {
			return d.Items[i].Value, true
		}
	}
	return nil, false
}

// Set replaces the value of a string key, or appends the key.
func (d *Dict) Set(key string, v Value) {
	for i := range d.Items {
		if k, ok := d.Items[i].Key.(string); ok && k == key {
			d.Items[i].Value = v
			return
		}
	}
	d.Items = append(d.Items, Item{Key: key, Value: v})
}

// Opt is an optional field: Set says whether the key was present.
type Opt[T any] struct {
	V   T
	Set bool
}

// Some returns a present optional value.
func Some[T any](v T) Opt[T] { return Opt[T]{V: v, Set: true} }

// Snapshot is a memory snapshot dict (§1 of the format).
type Snapshot struct {
	Segments []Segment
	// DeviceTraces[d] is device d's trace, oldest first.
	DeviceTraces [][]TraceEntry
	// AllocatorSettings is nil when the key is absent (torch_npu).
	AllocatorSettings *Dict
	// ExternalAnnotations (CUDA) is kept as read.
	ExternalAnnotations Opt[List]
	// Extra holds any other top-level key, in file order.
	Extra []Item
	// Protocol is the pickle protocol of the file read (0 if built).
	Protocol int
}

// Segment is one entry of segments (§2).
type Segment struct {
	Device        int
	Address       int64
	TotalSize     int64
	AllocatedSize Opt[int64]
	ActiveSize    Opt[int64]
	RequestedSize Opt[int64]
	Stream        Opt[int64]
	SegmentType   Opt[string]
	SegmentPoolID Opt[[2]int64]
	IsExpandable  Opt[bool]
	Frames        Opt[[]Frame]
	Blocks        []Block
	Extra         []Item
}

// Block is one block of a segment (§3).
type Block struct {
	Address       Opt[int64]
	Size          int64
	RequestedSize Opt[int64]
	State         string
	Frames        Opt[[]Frame]
	Extra         []Item
}

// Block states.
const (
	StateActiveAllocated   = "active_allocated"
	StateActivePendingFree = "active_pending_free"
	StateInactive          = "inactive"
)

// IsActive reports whether the block is held by a tensor or awaiting its
// stream events.
func (b *Block) IsActive() bool {
	return b.State == StateActiveAllocated || b.State == StateActivePendingFree
}

// TraceEntry is one entry of a device trace (§5).
type TraceEntry struct {
	Action string
	// Addr is the address; absent on oom entries, which carry DeviceFree.
	Addr       Opt[int64]
	DeviceFree Opt[int64]
	Size       int64
	Stream     Opt[int64]
	TimeUs     Opt[int64]
	Frames     Opt[[]Frame]
	PoolID     Opt[[2]int64]
	Extra      []Item
}

// Trace actions (§6).
const (
	ActionAlloc             = "alloc"
	ActionFreeRequested     = "free_requested"
	ActionFreeCompleted     = "free_completed"
	ActionSegmentAlloc      = "segment_alloc"
	ActionSegmentFree       = "segment_free"
	ActionSegmentMap        = "segment_map"
	ActionSegmentUnmap      = "segment_unmap"
	ActionSnapshot          = "snapshot"
	ActionOOM               = "oom"
	ActionWorkspaceSnapshot = "workspace_snapshot"
)

// AddrOrFree is the entry's address, or for oom its device_free.
func (e *TraceEntry) AddrOrFree() int64 {
	if e.Addr.Set {
		return e.Addr.V
	}
	return e.DeviceFree.V
}

// Frame is one stack frame (§4).
type Frame struct {
	Filename string
	Name     string
	Line     Opt[int64]
	Extra    []Item
}

// Devices returns the number of devices the snapshot describes: the length
// of device_traces, or more if a segment names a higher device.
func (s *Snapshot) Devices() int {
	n := len(s.DeviceTraces)
	for i := range s.Segments {
		if s.Segments[i].Device >= n {
			n = s.Segments[i].Device + 1
		}
	}
	return n
}

// UsedDevices lists, in order, the devices with a trace entry or a segment.
func (s *Snapshot) UsedDevices() []int {
	used := make([]bool, s.Devices())
	for d, tr := range s.DeviceTraces {
		if len(tr) > 0 {
			used[d] = true
		}
	}
	for i := range s.Segments {
		used[s.Segments[i].Device] = true
	}
	var out []int
	for d, u := range used {
		if u {
			out = append(out, d)
		}
	}
	return out
}

// Setting returns allocator_settings[key].
func (s *Snapshot) Setting(key string) (Value, bool) {
	return s.AllocatorSettings.Get(key)
}
