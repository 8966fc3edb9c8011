package allocmodel

// Ring is one device's trace history with the semantics of torch's
// per-device TraceEntry ring: append until full, then overwrite the oldest
// entry in place; read out oldest to newest.
//
// Entries are addressed by their absolute index (0 for the first entry ever
// appended), so a caller can come back to an entry it appended earlier (an
// OOM entry whose free-bytes figure arrives with the next call) and learn
// whether it has been overwritten meanwhile.
//
// Storage grows in fixed chunks rather than by doubling one slice: a ring of
// a million entries then never holds a half-empty doubled array or a copy
// made while growing, which would double its memory at the worst moment.
type Ring struct {
	chunks   [][]TraceEntry // all full but the last; chunkLen entries each
	held     int            // entries stored
	capacity int            // 0: unbounded
	appended uint64         // entries ever appended
}

// chunkLen entries (48 bytes each) make a 3 MiB chunk.
const chunkLen = 1 << 16

// NewRing returns a ring that keeps the newest capacity entries; capacity 0
// keeps every entry.
func NewRing(capacity int) *Ring {
	if capacity < 0 {
		capacity = 0
	}
	return &Ring{capacity: capacity}
}

// slot returns the storage of slot i (0 ≤ i < held).
func (r *Ring) slot(i int) *TraceEntry {
	return &r.chunks[i/chunkLen][i%chunkLen]
}

// Append stores e, overwriting the oldest entry when the ring is full, and
// returns e's absolute index.
func (r *Ring) Append(e TraceEntry) uint64 {
	abs := r.appended
	r.appended++
	if r.capacity == 0 || r.held < r.capacity {
		if n := len(r.chunks); n == 0 || len(r.chunks[n-1]) == chunkLen {
			size := chunkLen
			if r.capacity > 0 {
				size = min(chunkLen, r.capacity-r.held)
			}
			r.chunks = append(r.chunks, make([]TraceEntry, 0, size))
		}
		last := len(r.chunks) - 1
		r.chunks[last] = append(r.chunks[last], e)
		r.held++
		return abs
	}
	*r.slot(int(abs % uint64(r.capacity))) = e
	return abs
}

// At returns the entry with absolute index abs, or nil if it was overwritten
// or never appended. The pointer is valid until the next Append.
func (r *Ring) At(abs uint64) *TraceEntry {
	if abs >= r.appended || abs < r.appended-uint64(r.held) {
		return nil
	}
	if r.capacity == 0 {
		return r.slot(int(abs))
	}
	return r.slot(int(abs % uint64(r.capacity)))
}

// Len is the number of entries held.
func (r *Ring) Len() int { return r.held }

// Capacity is the most entries the ring holds; 0 means unbounded.
func (r *Ring) Capacity() int { return r.capacity }

// Appended is the number of entries ever appended.
func (r *Ring) Appended() uint64 { return r.appended }

// Overwritten is the number of entries lost to wrapping.
func (r *Ring) Overwritten() uint64 { return r.appended - uint64(r.held) }

// Get returns the i-th held entry, oldest first (0 ≤ i < Len).
func (r *Ring) Get(i int) TraceEntry {
	return *r.At(r.appended - uint64(r.held) + uint64(i))
}

// AppendTo appends the held entries, oldest first, to dst and returns it.
func (r *Ring) AppendTo(dst []TraceEntry) []TraceEntry {
	for i := 0; i < r.held; i++ {
		dst = append(dst, r.Get(i))
	}
	return dst
}

// Entries returns a copy of the held entries, oldest first.
func (r *Ring) Entries() []TraceEntry {
	return r.AppendTo(make([]TraceEntry, 0, r.held))
}
