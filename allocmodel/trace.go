package allocmodel

// Action is a TraceEntry's kind, spelled as torch spells it in snapshots.
type Action uint8

const (
	ActionAlloc         Action = iota + 1 // block handed to a tensor
	ActionFreeRequested                   // tensor released the block
	ActionFreeCompleted                   // block returned to the cache
	ActionSegmentAlloc                    // new segment from the runtime
	ActionSegmentFree                     // segment given back to the runtime
	ActionSegmentMap                      // expandable segment: pages mapped
	ActionSegmentUnmap                    // expandable segment: pages unmapped
	ActionOOM                             // allocation failed for lack of device memory
	ActionSnapshot                        // allocator snapshot taken
)

var actionNames = [...]string{
	ActionAlloc:         "alloc",
	ActionFreeRequested: "free_requested",
	ActionFreeCompleted: "free_completed",
	ActionSegmentAlloc:  "segment_alloc",
	ActionSegmentFree:   "segment_free",
	ActionSegmentMap:    "segment_map",
	ActionSegmentUnmap:  "segment_unmap",
	ActionOOM:           "oom",
	ActionSnapshot:      "snapshot",
}

// String returns torch's name for the action.
func (a Action) String() string {
	if int(a) < len(actionNames) && actionNames[a] != "" {
		return actionNames[a]
	}
	return "unknown"
}

// Actions lists every action, for writers that intern the names.
func Actions() []Action {
	out := make([]Action, 0, len(actionNames)-1)
	for a := ActionAlloc; int(a) < len(actionNames); a++ {
		out = append(out, a)
	}
	return out
}

// PoolID identifies a memory pool as torch does: (0, 0) is the default pool.
type PoolID [2]int64

// TraceEntry is one entry of a device's trace ring. It is kept small (48
// bytes, no pointers) because a ring may hold millions.
type TraceEntry struct {
	// MonoNs is when the event happened, CLOCK_MONOTONIC nanoseconds. The
	// model never converts it; the clock stage fills TimeUs in snapshot copies.
	MonoNs int64
	// TimeUs is unix microseconds, set only in snapshot copies.
	TimeUs int64
	// Addr is the block or segment address; for ActionOOM, the device's
	// free bytes (torch stores device_free in the same field).
	Addr   uint64
	Size   uint64
	Stream uint64
	Action Action
	// Pool indexes Snapshot.Pools.
	Pool uint16
}
