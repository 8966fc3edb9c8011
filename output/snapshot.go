// Package output writes npuprobe's snapshots in the pickle format PyTorch's
// memory_viz reads, and writes files so that no reader ever sees a partial
// one.
//
// Invariants:
//   - Only opcodes memory_viz understands are written, at protocol 4, and
//     every integer is within ±2^53 (otherwise writing fails).
//   - Every trace entry and block is its own dict; only strings and pool-id
//     tuples are shared.
//   - Snapshot files appear under their final name complete or not at all:
//     written to a temporary file in the same directory, synced, renamed.
package output

import (
	"fmt"
	"io"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// Setting is one allocator_settings entry. Value is a string, bool, int,
// int64, uint64, float64, or []Setting (a nested dict).
type Setting struct {
	Key   string
	Value any
}

// Source is what a snapshot is written from: segments, pools, and one
// trace per device read entry by entry, oldest first, with TimeUs set. A
// Source lets a snapshot be written straight from the model's rings, with
// no copy of millions of entries (see allocmodel.View).
type Source interface {
	SnapshotSegments() []allocmodel.Segment
	SnapshotPools() []allocmodel.PoolID
	Devices() int
	TraceLen(dev int) int
	// TraceEntry is called for i = 0, 1, ... in order for each device.
	TraceEntry(dev, i int) allocmodel.TraceEntry
}

// WriteSnapshot writes snap as the dict memory_viz expects:
// {'segments', 'device_traces', 'allocator_settings'}. Every trace entry
// must already carry TimeUs.
func WriteSnapshot(w io.Writer, snap *allocmodel.Snapshot, settings []Setting) error {
	return WriteSnapshotFrom(w, copied{snap}, settings)
}

// copied is a Source over a deep-copied snapshot.
type copied struct{ s *allocmodel.Snapshot }

func (c copied) SnapshotSegments() []allocmodel.Segment { return c.s.Segments }
func (c copied) SnapshotPools() []allocmodel.PoolID     { return c.s.Pools }
func (c copied) Devices() int                           { return len(c.s.Traces) }
func (c copied) TraceLen(dev int) int                   { return len(c.s.Traces[dev]) }
func (c copied) TraceEntry(dev, i int) allocmodel.TraceEntry {
	return c.s.Traces[dev][i]
}

// WriteSnapshotFrom writes the snapshot src describes.
func WriteSnapshotFrom(w io.Writer, src Source, settings []Setting) error {
	pools := src.SnapshotPools()
	segments := src.SnapshotSegments()
	e := NewEncoder(w)
	e.BeginDict(3)

	e.Key("segments")
	e.BeginList(len(segments))
	for i := range segments {
		e.Elem()
		writeSegment(e, pools, &segments[i])
	}
	e.EndList()

	// One inner list per device up to the highest used, even if empty:
	// the viewer indexes device_traces by segment device.
	e.Key("device_traces")
	e.BeginList(src.Devices())
	for dev := 0; dev < src.Devices(); dev++ {
		e.Elem()
		n := src.TraceLen(dev)
		e.BeginList(n)
		for i := 0; i < n; i++ {
			e.Elem()
			t := src.TraceEntry(dev, i)
			writeEntry(e, pools, &t)
		}
		e.EndList()
	}
	e.EndList()

	e.Key("allocator_settings")
	writeSettings(e, settings)

	e.EndDict()
	return e.Close()
}

func pool(pools []allocmodel.PoolID, i uint16) allocmodel.PoolID {
	if int(i) < len(pools) {
		return pools[i]
	}
	return allocmodel.PoolID{}
}

func writeSegment(e *Encoder, pools []allocmodel.PoolID, s *allocmodel.Segment) {
	var allocated, active, requested uint64
	for _, b := range s.Blocks {
		if b.State == allocmodel.BlockActiveAllocated {
			allocated += b.Size
		}
		if b.State != allocmodel.BlockInactive {
			active += b.Size
			requested += b.RequestedSize
		}
	}
	e.BeginDict(12)
	e.Key("device")
	e.Int(int64(s.Device))
	e.Key("address")
	e.Uint(s.Address)
	e.Key("total_size")
	e.Uint(s.TotalSize)
	e.Key("allocated_size")
	e.Uint(allocated)
	e.Key("active_size")
	e.Uint(active)
	e.Key("requested_size")
	e.Uint(requested)
	e.Key("stream")
	e.Uint(s.Stream)
	e.Key("segment_type")
	e.String(s.Type.String())
	e.Key("segment_pool_id")
	p := pool(pools, s.Pool)
	e.IntPair(p[0], p[1])
	e.Key("is_expandable")
	e.Bool(s.Expandable)
	e.Key("frames")
	e.BeginList(0)
	e.EndList()
	e.Key("blocks")
	e.BeginList(len(s.Blocks))
	for _, b := range s.Blocks {
		e.Elem()
		e.BeginDict(5)
		e.Key("address")
		e.Uint(b.Address)
		e.Key("size")
		e.Uint(b.Size)
		e.Key("requested_size")
		e.Uint(b.RequestedSize)
		e.Key("state")
		e.String(b.State.String())
		e.Key("frames")
		e.BeginList(0)
		e.EndList()
		e.EndDict()
	}
	e.EndList()
	e.EndDict()
}

func writeEntry(e *Encoder, pools []allocmodel.PoolID, t *allocmodel.TraceEntry) {
	e.BeginDict(6)
	e.Key("action")
	e.String(t.Action.String())
	if t.Action == allocmodel.ActionOOM {
		// torch keeps the device's free bytes in addr and writes it as
		// device_free instead of addr (the CLI's trace view needs it).
		e.Key("device_free")
	} else {
		e.Key("addr")
	}
	e.Uint(t.Addr)
	e.Key("size")
	e.Uint(t.Size)
	e.Key("stream")
	e.Uint(t.Stream)
	e.Key("time_us")
	e.Int(t.TimeUs)
	e.Key("pool_id")
	p := pool(pools, t.Pool)
	e.IntPair(p[0], p[1])
	e.EndDict()
}

func writeSettings(e *Encoder, settings []Setting) {
	e.BeginDict(len(settings))
	for _, s := range settings {
		e.Key(s.Key)
		writeValue(e, s.Value)
	}
	e.EndDict()
}

func writeValue(e *Encoder, v any) {
	switch v := v.(type) {
	case string:
		e.String(v)
	case bool:
		e.Bool(v)
	case int:
		e.Int(int64(v))
	case int64:
		e.Int(v)
	case uint64:
		e.Uint(v)
	case float64:
		e.Float(v)
	case []Setting:
		writeSettings(e, v)
	case nil:
		e.None()
	default:
		e.fail(fmt.Errorf("pickle: unsupported setting value %T", v))
	}
}
