package agent

import (
	"fmt"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/bpf"
)

// Kinds of the live map's keys (enum live_kind in npuprobe.bpf.c).
const (
	liveSegment     = 1
	liveBlock       = 2
	liveMapping     = 3
	liveReservation = 4
)

// Live reads what the kernel knows pid holds right now: the live map,
// which BPF updates on every call whether or not the call's record reached
// user space. The model resyncs from it after records were lost.
func (t *Tracer) Live(pid int) (allocmodel.LiveState, error) {
	var st allocmodel.LiveState
	var k bpf.NpuprobeLiveKey
	var v bpf.NpuprobeLiveVal
	it := t.coll.Maps[bpf.NpuprobeMapLive].Iterate()
	for it.Next(&k, &v) {
		if k.Tgid != uint32(pid) {
			continue
		}
		a := allocmodel.LiveAllocation{Addr: k.Addr, Size: v.Size, Stream: v.Stream, Device: int(v.Device),
			ByAllocator: v.Flags&flagCtx != 0 || k.Kind == liveBlock}
		switch k.Kind {
		case liveSegment:
			st.Segments = append(st.Segments, a)
		case liveBlock:
			st.Blocks = append(st.Blocks, a)
		case liveMapping:
			st.Mappings = append(st.Mappings, a)
		case liveReservation:
			st.Reservations = append(st.Reservations, a)
		}
	}
	if err := it.Err(); err != nil {
		return st, fmt.Errorf("read live allocations: %w", err)
	}
	return st, nil
}

// forgetLive deletes a process's entries from the live map.
func (t *Tracer) forgetLive(tgid uint32) {
	m := t.coll.Maps[bpf.NpuprobeMapLive]
	var k bpf.NpuprobeLiveKey
	var v bpf.NpuprobeLiveVal
	var dead []bpf.NpuprobeLiveKey
	it := m.Iterate()
	for it.Next(&k, &v) {
		if k.Tgid == tgid {
			dead = append(dead, k)
		}
	}
	for i := range dead {
		m.Delete(&dead[i])
	}
}
