package snapshot

import (
	"fmt"
	"io"
	"path/filepath"

	"github.com/npuprobe/npuprobe/output"
)

// Write writes s as a protocol-4 pickle with output.Encoder: known keys in
// torch's order, then the file's other keys as read. Absent optional keys
// stay absent. Every segment, block and trace entry is its own dict.
func Write(w io.Writer, s *Snapshot) error {
	e := output.NewEncoder(w)
	n := 2 + len(s.Extra)
	if s.AllocatorSettings != nil {
		n++
	}
	if s.ExternalAnnotations.Set {
		n++
	}
	e.BeginDict(n)
	e.Key("segments")
	e.BeginList(len(s.Segments))
	for i := range s.Segments {
		e.Elem()
		writeSegment(e, &s.Segments[i])
	}
	e.EndList()
	e.Key("device_traces")
	e.BeginList(len(s.DeviceTraces))
	for _, tr := range s.DeviceTraces {
		e.Elem()
		e.BeginList(len(tr))
		for i := range tr {
			e.Elem()
			writeEntry(e, &tr[i])
		}
		e.EndList()
	}
	e.EndList()
	if s.AllocatorSettings != nil {
		e.Key("allocator_settings")
		writeValue(e, s.AllocatorSettings)
	}
	if s.ExternalAnnotations.Set {
		e.Key("external_annotations")
		writeValue(e, s.ExternalAnnotations.V)
	}
	writeExtra(e, s.Extra)
	e.EndDict()
	return e.Close()
}

// WriteFile writes s to path atomically (a temporary file in the same
// directory, synced, then renamed over path), mode 0600 like every file
// npuprobe writes.
func WriteFile(path string, s *Snapshot) error {
	dir, err := output.OpenDir(filepath.Dir(path))
	if err != nil {
		return fmt.Errorf("cannot write %s: %w", path, err)
	}
	defer dir.Close()
	_, err = dir.ReplaceFile(filepath.Base(path), func(w io.Writer) error { return Write(w, s) })
	return err
}

func count(opts ...bool) int {
	n := 0
	for _, o := range opts {
		if o {
			n++
		}
	}
	return n
}

func writeSegment(e *output.Encoder, s *Segment) {
	e.BeginDict(4 + count(s.AllocatedSize.Set, s.ActiveSize.Set, s.RequestedSize.Set, s.Stream.Set,
		s.SegmentType.Set, s.SegmentPoolID.Set, s.IsExpandable.Set, s.Frames.Set) + len(s.Extra))
	e.Key("device")
	e.Int(int64(s.Device))
	e.Key("address")
	e.Int(s.Address)
	e.Key("total_size")
	e.Int(s.TotalSize)
	optInt(e, "allocated_size", s.AllocatedSize)
	optInt(e, "active_size", s.ActiveSize)
	optInt(e, "requested_size", s.RequestedSize)
	optInt(e, "stream", s.Stream)
	if s.SegmentType.Set {
		e.Key("segment_type")
		e.String(s.SegmentType.V)
	}
	optPair(e, "segment_pool_id", s.SegmentPoolID)
	if s.IsExpandable.Set {
		e.Key("is_expandable")
		e.Bool(s.IsExpandable.V)
	}
	optFrames(e, "frames", s.Frames)
	e.Key("blocks")
	e.BeginList(len(s.Blocks))
	for i := range s.Blocks {
		b := &s.Blocks[i]
		e.Elem()
		e.BeginDict(2 + count(b.Address.Set, b.RequestedSize.Set, b.Frames.Set) + len(b.Extra))
		optInt(e, "address", b.Address)
		e.Key("size")
		e.Int(b.Size)
		optInt(e, "requested_size", b.RequestedSize)
		e.Key("state")
		e.String(b.State)
		optFrames(e, "frames", b.Frames)
		writeExtra(e, b.Extra)
		e.EndDict()
	}
	e.EndList()
	writeExtra(e, s.Extra)
	e.EndDict()
}

func writeEntry(e *output.Encoder, t *TraceEntry) {
	e.BeginDict(2 + count(t.Addr.Set, t.DeviceFree.Set, t.Stream.Set, t.TimeUs.Set, t.Frames.Set, t.PoolID.Set) + len(t.Extra))
	e.Key("action")
	e.String(t.Action)
	optInt(e, "addr", t.Addr)
	optInt(e, "device_free", t.DeviceFree)
	e.Key("size")
	e.Int(t.Size)
	optInt(e, "stream", t.Stream)
	optInt(e, "time_us", t.TimeUs)
	optFrames(e, "frames", t.Frames)
	optPair(e, "pool_id", t.PoolID)
	writeExtra(e, t.Extra)
	e.EndDict()
}

func optInt(e *output.Encoder, key string, v Opt[int64]) {
	if v.Set {
		e.Key(key)
		e.Int(v.V)
	}
}

func optPair(e *output.Encoder, key string, v Opt[[2]int64]) {
	if v.Set {
		e.Key(key)
		e.IntPair(v.V[0], v.V[1])
	}
}

func optFrames(e *output.Encoder, key string, v Opt[[]Frame]) {
	if !v.Set {
		return
	}
	e.Key(key)
	e.BeginList(len(v.V))
	for i := range v.V {
		f := &v.V[i]
		e.Elem()
		e.BeginDict(2 + count(f.Line.Set) + len(f.Extra))
		e.Key("filename")
		e.String(f.Filename)
		e.Key("name")
		e.String(f.Name)
		optInt(e, "line", f.Line)
		writeExtra(e, f.Extra)
		e.EndDict()
	}
	e.EndList()
}

func writeExtra(e *output.Encoder, items []Item) {
	for _, it := range items {
		writeItem(e, it)
	}
}

func writeItem(e *output.Encoder, it Item) {
	if k, ok := it.Key.(string); ok {
		e.Key(k)
	} else {
		e.Item()
		writeValue(e, it.Key)
	}
	writeValue(e, it.Value)
}

// writeValue writes a generic value. Pairs of ints go through IntPair (the
// only memoized containers), other tuples are written out.
func writeValue(e *output.Encoder, v Value) {
	switch v := v.(type) {
	case nil:
		e.None()
	case bool:
		e.Bool(v)
	case int64:
		e.Int(v)
	case int:
		e.Int(int64(v))
	case float64:
		e.Float(v)
	case string:
		e.String(v)
	case List:
		e.BeginList(len(v))
		for _, x := range v {
			e.Elem()
			writeValue(e, x)
		}
		e.EndList()
	case Tuple:
		if len(v) == 2 {
			a, ok1 := v[0].(int64)
			b, ok2 := v[1].(int64)
			if ok1 && ok2 {
				e.IntPair(a, b)
				return
			}
		}
		e.BeginTuple(len(v))
		for _, x := range v {
			writeValue(e, x)
		}
		e.EndTuple(len(v))
	case *Dict:
		e.BeginDict(len(v.Items))
		for _, it := range v.Items {
			writeItem(e, it)
		}
		e.EndDict()
	default:
		e.Fail(fmt.Errorf("pickle: cannot write a value of type %T", v))
	}
}
