package allocmodel

// Ring is one device's trace history with the semantics of torch's
// per-device TraceEntry ring: append until full, then overwrite the oldest
// entry in place; read out oldest to newest.
//
// Entries are addressed by their absolute index (0 for the first entry ever
// appended), so a caller can come back to an entry it appended earlier (an
// OOM entry whose free-bytes figure arrives with the next call) and learn
// whether it has been overwritten meanwhile.
type Ring struct {
	entries  []TraceEntry
	capacity int    // 0: unbounded
	appended uint64 // entries ever appended
}

// NewRing returns a ring that keeps the newest capacity entries; capacity 0
// keeps every entry.
func NewRing(capacity int) *Ring {
	if capacity < 0 {
		capacity = 0
	}
	return &Ring{capacity: capacity}
}

// Append stores e, overwriting the oldest entry when the ring is full, and
// returns e's absolute index.
func (r *Ring) Append(e TraceEntry) uint64 {
	abs := r.appended
	r.appended++
	if r.capacity == 0 || len(r.entries) < r.capacity {
		r.entries = append(r.entries, e)
		return abs
	}
	r.entries[abs%uint64(r.capacity)] = e
	return abs
}

// At returns the entry with absolute index abs, or nil if it was overwritten
// or never appended. The pointer is valid until the next Append.
func (r *Ring) At(abs uint64) *TraceEntry {
	if abs >= r.appended || abs < r.appended-uint64(len(r.entries)) {
		return nil
	}
	if r.capacity == 0 {
		return &r.entries[abs]
	}
	return &r.entries[abs%uint64(r.capacity)]
}

// Len is the number of entries held.
func (r *Ring) Len() int { return len(r.entries) }

// Capacity is the most entries the ring holds; 0 means unbounded.
func (r *Ring) Capacity() int { return r.capacity }

// Appended is the number of entries ever appended.
func (r *Ring) Appended() uint64 { return r.appended }

// Overwritten is the number of entries lost to wrapping.
func (r *Ring) Overwritten() uint64 { return r.appended - uint64(len(r.entries)) }

// AppendTo appends the held entries, oldest first, to dst and returns it.
func (r *Ring) AppendTo(dst []TraceEntry) []TraceEntry {
	if r.capacity == 0 || r.appended <= uint64(r.capacity) {
		return append(dst, r.entries...)
	}
	oldest := int(r.appended % uint64(r.capacity))
	dst = append(dst, r.entries[oldest:]...)
	return append(dst, r.entries[:oldest]...)
}

// Entries returns a copy of the held entries, oldest first.
func (r *Ring) Entries() []TraceEntry {
	return r.AppendTo(make([]TraceEntry, 0, len(r.entries)))
}
