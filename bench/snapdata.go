package bench

import (
	"bufio"
	"encoding/json"
	"io"
	"strconv"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/output"
)

// SyntheticSnapshot builds a snapshot the size the issue asks for: entries
// trace entries on device 0 and segs segments, each tiled by several
// blocks (small-pool segments 4–16, large ones 2–6), with the actions,
// addresses and sizes of a training run at tensor level. Every entry
// carries TimeUs, as WriteSnapshot requires.
func SyntheticSnapshot(entries, segs int, seed uint64) (*allocmodel.Snapshot, []output.Setting) {
	r := newRNG(seed)
	snap := &allocmodel.Snapshot{
		Level:       allocmodel.LevelTensor,
		Pools:       []allocmodel.PoolID{{0, 0}},
		MaxEntries:  DefaultMaxEntries,
		Overwritten: []uint64{0},
	}
	addr := uint64(deviceHBM)
	for range segs {
		seg := allocmodel.Segment{Address: addr, Stream: benchStrm}
		var nblocks int
		if r.intn(100) < 30 {
			seg.Type, seg.TotalSize, nblocks = allocmodel.SegmentSmall, 2*mib, 4+r.intn(13)
		} else {
			seg.TotalSize, nblocks = segmentSize(r)&^511, 2+r.intn(5)
			if seg.TotalSize < 2*mib {
				seg.TotalSize = 20 * mib
			}
		}
		// Cut the segment into nblocks pieces, multiples of 512 bytes.
		left := seg.TotalSize
		at := addr
		for i := range nblocks {
			size := left
			if i < nblocks-1 {
				size = max(512, (left/uint64(nblocks-i))&^511)
				size = max(512, (size/2+r.next()%size)&^511)
				if size >= left {
					size = left
				}
			}
			b := allocmodel.Block{Address: at, Size: size}
			if r.intn(100) < 60 {
				b.State = allocmodel.BlockActiveAllocated
				b.RequestedSize = size - uint64(r.intn(480))
			}
			seg.Blocks = append(seg.Blocks, b)
			at += size
			left -= size
			if left == 0 {
				break
			}
		}
		snap.Segments = append(snap.Segments, seg)
		addr += (seg.TotalSize + 2*mib) &^ (2*mib - 1)
	}
	trace := make([]allocmodel.TraceEntry, entries)
	mono := int64(1e12)
	timeUs := int64(1_760_000_000_000_000) // late 2025, unix µs
	for i := range trace {
		mono += int64(2000 + r.intn(18000))
		timeUs = mono/1000 + 1_760_000_000_000_000 - 1e9
		seg := &snap.Segments[r.intn(len(snap.Segments))]
		b := seg.Blocks[r.intn(len(seg.Blocks))]
		e := allocmodel.TraceEntry{MonoNs: mono, TimeUs: timeUs, Addr: b.Address, Size: b.Size - uint64(r.intn(480)), Stream: benchStrm}
		switch p := r.intn(1000); {
		case p < 400:
			e.Action = allocmodel.ActionAlloc
		case p < 690:
			e.Action = allocmodel.ActionFreeRequested
		case p < 980:
			e.Action = allocmodel.ActionFreeCompleted
		case p < 990:
			e.Action, e.Addr, e.Size = allocmodel.ActionSegmentAlloc, seg.Address, seg.TotalSize
		case p < 999:
			e.Action, e.Addr, e.Size = allocmodel.ActionSegmentFree, seg.Address, seg.TotalSize
		default:
			e.Action, e.Addr, e.Size = allocmodel.ActionOOM, 3<<30+r.next()%(1<<30), 64*mib+r.next()%(64*mib)
		}
		trace[i] = e
	}
	snap.Traces = [][]allocmodel.TraceEntry{trace}
	settings := []output.Setting{
		{Key: "npuprobe_version", Value: "bench"},
		{Key: "npuprobe_level", Value: "tensor"},
		{Key: "npuprobe_host", Value: "bench-host"},
		{Key: "npuprobe_pid", Value: 4242},
		{Key: "trace_alloc_max_entries", Value: DefaultMaxEntries},
		{Key: "trace_alloc_overflowed", Value: false},
		{Key: "npuprobe_dropped_events", Value: uint64(0)},
		{Key: "npuprobe_model", Value: []output.Setting{
			{Key: "events", Value: uint64(entries)},
			{Key: "resyncs", Value: uint64(0)},
		}},
		{Key: "npuprobe_clock", Value: []output.Setting{
			{Key: "offset_us", Value: int64(1_759_999_999_000_000)},
			{Key: "uncertainty_ns", Value: 1500.5},
		}},
	}
	return snap, settings
}

// WriteSnapshotJSON writes the dict WriteSnapshot pickles, as JSON with the
// same keys in the same order (pool ids as lists), for Python to build the
// same object and pickle it itself.
func WriteSnapshotJSON(w io.Writer, snap *allocmodel.Snapshot, settings []output.Setting) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	u := func(v uint64) { bw.WriteString(strconv.FormatUint(v, 10)) }
	i := func(v int64) { bw.WriteString(strconv.FormatInt(v, 10)) }
	s := func(v string) { b, _ := json.Marshal(v); bw.Write(b) }
	bw.WriteString(`{"segments":[`)
	for k := range snap.Segments {
		seg := &snap.Segments[k]
		if k > 0 {
			bw.WriteByte(',')
		}
		var allocated, active, requested uint64
		for _, b := range seg.Blocks {
			if b.State == allocmodel.BlockActiveAllocated {
				allocated += b.Size
			}
			if b.State != allocmodel.BlockInactive {
				active += b.Size
				requested += b.RequestedSize
			}
		}
		bw.WriteString(`{"device":`)
		i(int64(seg.Device))
		bw.WriteString(`,"address":`)
		u(seg.Address)
		bw.WriteString(`,"total_size":`)
		u(seg.TotalSize)
		bw.WriteString(`,"allocated_size":`)
		u(allocated)
		bw.WriteString(`,"active_size":`)
		u(active)
		bw.WriteString(`,"requested_size":`)
		u(requested)
		bw.WriteString(`,"stream":`)
		u(seg.Stream)
		bw.WriteString(`,"segment_type":`)
		s(seg.Type.String())
		bw.WriteString(`,"segment_pool_id":[0,0],"is_expandable":`)
		bw.WriteString(strconv.FormatBool(seg.Expandable))
		bw.WriteString(`,"frames":[],"blocks":[`)
		for j, b := range seg.Blocks {
			if j > 0 {
				bw.WriteByte(',')
			}
			bw.WriteString(`{"address":`)
			u(b.Address)
			bw.WriteString(`,"size":`)
			u(b.Size)
			bw.WriteString(`,"requested_size":`)
			u(b.RequestedSize)
			bw.WriteString(`,"state":`)
			s(b.State.String())
			bw.WriteString(`,"frames":[]}`)
		}
		bw.WriteString(`]}`)
	}
	bw.WriteString(`],"device_traces":[`)
	for d, trace := range snap.Traces {
		if d > 0 {
			bw.WriteByte(',')
		}
		bw.WriteByte('[')
		for k := range trace {
			e := &trace[k]
			if k > 0 {
				bw.WriteByte(',')
			}
			bw.WriteString(`{"action":`)
			s(e.Action.String())
			if e.Action == allocmodel.ActionOOM {
				bw.WriteString(`,"device_free":`)
			} else {
				bw.WriteString(`,"addr":`)
			}
			u(e.Addr)
			bw.WriteString(`,"size":`)
			u(e.Size)
			bw.WriteString(`,"stream":`)
			u(e.Stream)
			bw.WriteString(`,"time_us":`)
			i(e.TimeUs)
			bw.WriteString(`,"pool_id":[0,0]}`)
		}
		bw.WriteByte(']')
	}
	bw.WriteString(`],"allocator_settings":`)
	writeSettingsJSON(bw, settings)
	bw.WriteString("}\n")
	return bw.Flush()
}

func writeSettingsJSON(bw *bufio.Writer, settings []output.Setting) {
	bw.WriteByte('{')
	for k, st := range settings {
		if k > 0 {
			bw.WriteByte(',')
		}
		b, _ := json.Marshal(st.Key)
		bw.Write(b)
		bw.WriteByte(':')
		if nested, ok := st.Value.([]output.Setting); ok {
			writeSettingsJSON(bw, nested)
			continue
		}
		b, _ = json.Marshal(st.Value)
		bw.Write(b)
	}
	bw.WriteByte('}')
}
