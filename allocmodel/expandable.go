package allocmodel

// Expandable segments (expandable_segments:True).
//
// torch_npu reserves a large virtual address range per (stream, pool)
// with aclrtReserveMemAddress and maps physical pages into it on demand:
// aclrtMallocPhysical (or a recycled handle, with no runtime call) then one
// aclrtMapMem per page, and one segment_map trace entry for the whole range
// mapped by one allocator operation; unmapping likewise page by page with
// one segment_unmap. Its snapshot shows one segment per contiguous mapped
// range.
//
// The model keeps each reservation as a segment (expandable) whose blocks
// cover the whole reservation, mapped or not, as torch's blocks do. A run
// of consecutive page maps (unmaps) by one thread, ended by the thread's
// next other call, becomes one segment_map (segment_unmap) entry, stamped
// at its last page. Physical handles are remembered with their device
// (aclrtMallocPhysical's prop->location.id), which attributes the mapping
// exactly even when the handle is recycled.

// vmmRun is a run of page maps or unmaps in progress on one thread.
type vmmRun struct {
	active     bool
	unmap      bool
	seg        *segment
	start, end uint64
	device     int
	stream     uint64
	monoNs     int64
}

// continues reports whether ev carries on the run rather than ending it:
// the next page of the same kind, or, while unmapping, the release or
// caching of the page's physical handle.
func (r *vmmRun) continues(ev *Event) bool {
	switch ev.Call {
	case CallMapMem:
		return !r.unmap && ev.Outcome == OutcomeReturned && ev.Addr == r.end
	case CallUnmapMem:
		return r.unmap
	case CallFreePhysical:
		return r.unmap
	}
	return false
}

type physHandle struct {
	device int
	size   uint64
}

func (m *Model) applyVMM(t *threadState, ev *Event) {
	switch ev.Call {
	case CallReserveMemAddress:
		if ev.Outcome != OutcomeReturned {
			m.countFailure(t, ev)
			return
		}
		if ev.Size == 0 || ev.Addr == 0 {
			m.counters.FailedCalls++
			return
		}
		m.newReservation(t, ev.Addr, ev.Size, ev)
	case CallReleaseMemAddress:
		if seg := m.segments[ev.Addr]; seg != nil && seg.expandable {
			m.dropSegment(seg)
		}
	case CallMallocPhysical:
		if ev.Outcome != OutcomeReturned {
			m.countFailure(t, ev)
			return
		}
		dev := int(uint32(ev.Arg))
		if dev >= MaxDevices {
			m.counters.InvalidDevices++
			dev = t.device
		}
		m.handles[ev.Addr] = physHandle{device: dev, size: ev.Size}
	case CallFreePhysical:
		delete(m.handles, ev.Addr)
	case CallMapMem:
		if ev.Outcome != OutcomeReturned {
			m.countFailure(t, ev)
			return
		}
		if ev.Size == 0 {
			m.counters.FailedCalls++
			return
		}
		dev := t.device
		if ev.Ctx.HasDevice {
			dev = ev.Ctx.Device
		}
		if h, ok := m.handles[ev.Arg]; ok {
			dev = h.device
		}
		if t.run.active && t.run.continues(ev) {
			t.run.end += ev.Size
			t.run.monoNs = ev.MonoNs
			return
		}
		seg := m.segmentContaining(ev.Addr)
		if seg == nil || !seg.expandable {
			m.counters.MapsOutsideReservation++
			return
		}
		if _, ok := m.pages[seg.addr]; !ok {
			m.pages[seg.addr] = ev.Size
		}
		t.run = vmmRun{active: true, seg: seg, start: ev.Addr, end: ev.Addr + ev.Size, device: dev, stream: ev.Ctx.Stream, monoNs: ev.MonoNs}
	case CallUnmapMem:
		seg := m.segmentContaining(ev.Addr)
		if seg == nil || !seg.expandable {
			m.counters.MapsOutsideReservation++
			return
		}
		b := m.blockContaining(seg, ev.Addr)
		if b == nil || !b.mapped {
			return
		}
		// The call has no size argument; BPF reports the mapping's size
		// when it saw it mapped, else it is the reservation's page size.
		page := ev.Size
		if page == 0 {
			page = m.pageSize(seg)
		}
		if t.run.active && t.run.unmap && t.run.seg == seg && ev.Addr == t.run.end {
			t.run.end += page
			t.run.monoNs = ev.MonoNs
			return
		}
		if t.run.active {
			m.flushRun(t)
		}
		t.run = vmmRun{active: true, unmap: true, seg: seg, start: ev.Addr, end: ev.Addr + page, device: seg.device, stream: seg.stream, monoNs: ev.MonoNs}
	}
}

// countFailure handles a failed VMM call: inside the caching allocator an
// out-of-memory failure leads to its OOM report; elsewhere, at segment
// level, it is the OOM itself.
func (m *Model) countFailure(t *threadState, ev *Event) {
	if ev.Outcome != OutcomeOOM {
		m.counters.FailedCalls++
		return
	}
	if m.cfg.Level == LevelTensor && ev.Ctx.Valid {
		t.allocFailed = true
		return
	}
	m.counters.OOMs++
	abs := m.record(t.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionOOM, Size: ev.Size})
	t.oomPending, t.oomDevice, t.oomEntry = true, t.device, abs
}

// newReservation adds a reservation as an expandable segment of one
// unmapped block. Its device is learned when pages are mapped.
func (m *Model) newReservation(t *threadState, addr, size uint64, ev *Event) {
	if old := m.segments[addr]; old != nil {
		m.counters.AllocsOverLive++
	}
	dev := t.device
	if ev.Ctx.HasDevice {
		dev = ev.Ctx.Device
	}
	seg := &segment{device: dev, addr: addr, size: size, stream: ev.Ctx.Stream, expandable: true}
	if ev.Ctx.Valid {
		seg.small = isSmallRequest(m.cfg.Alloc.RoundSize(ev.Ctx.Size))
	}
	seg.head = &block{addr: addr, size: size, seg: seg}
	m.addSegment(seg)
}

// pageSize is the reservation's page size, learned from its maps (2 MiB
// if it was never seen mapping).
func (m *Model) pageSize(seg *segment) uint64 {
	if p, ok := m.pages[seg.addr]; ok && p > 0 {
		return p
	}
	return smallBuffer
}

func (m *Model) blockContaining(seg *segment, addr uint64) *block {
	for b := seg.head; b != nil; b = b.next {
		if addr >= b.addr && addr < b.addr+b.size {
			return b
		}
	}
	return nil
}

// flushRun applies a finished run of page maps or unmaps to the blocks and
// records its one segment_map or segment_unmap entry.
func (m *Model) flushRun(t *threadState) {
	r := t.run
	t.run = vmmRun{}
	if !r.active || r.end <= r.start {
		return
	}
	seg := r.seg
	if m.segments[seg.addr] != seg {
		return // the reservation was released meanwhile
	}
	// A reservation's first mapping tells its device.
	if !r.unmap && !m.anyMapped(seg) {
		seg.device = r.device
	}
	m.setMapped(seg, r.start, r.end, !r.unmap)
	action := ActionSegmentMap
	if r.unmap {
		action = ActionSegmentUnmap
	}
	m.record(seg.device, TraceEntry{MonoNs: r.monoNs, Action: action, Addr: r.start, Size: r.end - r.start, Stream: seg.stream})
}

func (m *Model) anyMapped(seg *segment) bool {
	for b := seg.head; b != nil; b = b.next {
		if b.mapped {
			return true
		}
	}
	return false
}

// setMapped marks [start, end) of seg mapped or unmapped as torch_npu's
// map_block and unmap_block do, down to which block object survives (a
// free block's requested_size is reported): the block whose pages change
// keeps its identity, new blocks (requested 0) take the parts before and
// after, and it then absorbs neighbours in its new state. Only free
// blocks change state.
func (m *Model) setMapped(seg *segment, start, end uint64, mapped bool) {
	d := m.device(seg.device)
	for b := seg.head; b != nil; {
		next := b.next
		bEnd := b.addr + b.size
		if bEnd <= start || b.addr >= end || b.mapped == mapped || b.allocated {
			b = next
			continue
		}
		if b.addr < start {
			m.split(b, start-b.addr) // a new block before
			continue                 // b now starts at start
		}
		if bEnd > end {
			m.splitHigh(b, end-b.addr) // a new block after
		}
		b.mapped = mapped
		if mapped {
			d.reserved += b.size
		} else {
			d.reserved -= b.size
		}
		m.mergeFree(b)
		b = b.next
	}
}

// splitHigh cuts b at size bytes, keeping b as the low part: a new block
// (requested 0) takes the rest.
func (m *Model) splitHigh(b *block, size uint64) *block {
	nb := &block{addr: b.addr + size, size: b.size - size, seg: b.seg, prev: b, next: b.next, mapped: b.mapped}
	if b.next != nil {
		b.next.prev = nb
	}
	b.next = nb
	b.size = size
	if m.cfg.Level == LevelTensor {
		m.blocks[nb.addr] = nb
	}
	return nb
}
