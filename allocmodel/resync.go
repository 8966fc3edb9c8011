package allocmodel

import "sort"

// Resync brings the model in line with what the kernel says the process
// holds, after records were lost (the ring buffer was full). Lost records
// cannot be recovered as trace entries, but the state can: segments,
// mappings and allocated blocks are made to match live. Nothing is added
// to the trace; every change is counted.
//
// Call it when every record written before live was read has been applied
// (the ring buffer was drained), or some changes will be undone by the
// records still queued.
func (m *Model) Resync(live LiveState) {
	m.counters.Resyncs++
	for _, t := range m.threads {
		if t.run.active {
			m.flushRun(t)
		}
	}
	m.resyncSegments(live.Segments)
	m.resyncReservations(live.Reservations, live.Mappings)
	if m.cfg.Level == LevelTensor {
		m.resyncBlocks(live.Blocks)
	}
}

func (m *Model) resyncSegments(live []LiveAllocation) {
	want := make(map[uint64]LiveAllocation, len(live))
	for _, a := range live {
		// At tensor level only the caching allocator's segments belong in
		// the snapshot.
		if m.cfg.Level == LevelTensor && !a.ByAllocator {
			continue
		}
		want[a.Addr] = a
	}
	for addr, seg := range m.segments {
		if seg.expandable {
			continue
		}
		if a, ok := want[addr]; !ok || a.Size != seg.size {
			m.dropSegment(seg)
			m.counters.ResyncSegmentsRemoved++
		}
	}
	for _, a := range sortedByAddr(want) {
		if m.segments[a.Addr] != nil {
			continue
		}
		dev := a.Device
		if dev < 0 {
			dev = m.cfg.DefaultDevice
		}
		m.newSegment(dev, a.Addr, a.Size, a.Stream, a.Size == smallBuffer)
		m.counters.ResyncSegmentsAdded++
	}
}

func (m *Model) resyncReservations(reservations, mappings []LiveAllocation) {
	want := make(map[uint64]LiveAllocation, len(reservations))
	for _, r := range reservations {
		want[r.Addr] = r
	}
	for addr, seg := range m.segments {
		if seg.expandable {
			if r, ok := want[addr]; !ok || r.Size != seg.size {
				m.dropSegment(seg)
				m.counters.ResyncSegmentsRemoved++
			}
		}
	}
	for _, r := range sortedByAddr(want) {
		if m.segments[r.Addr] == nil {
			dev := r.Device
			if dev < 0 {
				dev = m.cfg.DefaultDevice
			}
			seg := &segment{device: dev, addr: r.Addr, size: r.Size, stream: r.Stream, expandable: true}
			seg.head = &block{addr: r.Addr, size: r.Size, seg: seg}
			m.segments[r.Addr] = seg
			if m.cfg.Level == LevelTensor {
				m.blocks[r.Addr] = seg.head
			}
			m.counters.ResyncSegmentsAdded++
		}
	}
	// Mapped pages: mark exactly the live mappings mapped.
	mapped := make(map[*segment][][2]uint64)
	for _, mp := range mappings {
		if seg := m.segmentContaining(mp.Addr); seg != nil && seg.expandable {
			mapped[seg] = append(mapped[seg], [2]uint64{mp.Addr, mp.Addr + mp.Size})
			if h, ok := m.handles[mp.Stream]; ok && !m.anyMapped(seg) {
				seg.device = h.device
			}
		}
	}
	for _, seg := range m.segments {
		if !seg.expandable {
			continue
		}
		ranges := mapped[seg]
		sort.Slice(ranges, func(i, j int) bool { return ranges[i][0] < ranges[j][0] })
		pos := seg.addr
		for _, r := range ranges {
			if r[0] > pos {
				m.setMapped(seg, pos, r[0], false)
			}
			m.setMapped(seg, r[0], r[1], true)
			pos = r[1]
		}
		if pos < seg.addr+seg.size {
			m.setMapped(seg, pos, seg.addr+seg.size, false)
		}
	}
}

func (m *Model) resyncBlocks(live []LiveAllocation) {
	want := make(map[uint64]LiveAllocation, len(live))
	for _, b := range live {
		want[b.Addr] = b
	}
	// Allocated in the model, freed in reality: free it.
	var freed []*block
	for _, seg := range m.segments {
		for b := seg.head; b != nil; b = b.next {
			if _, ok := want[b.addr]; b.allocated && !ok {
				freed = append(freed, b)
			}
		}
	}
	for _, b := range freed {
		d := m.device(b.seg.device)
		d.allocated -= b.size
		d.active -= b.size
		b.allocated = false
		m.mergeFree(b)
		m.counters.ResyncBlocksChanged++
	}
	// Allocated in reality, not in the model: allocate it where it lies.
	for _, a := range sortedByAddr(want) {
		b := m.blocks[a.Addr]
		if b != nil && b.allocated {
			if b.requested != a.Size {
				b.requested = a.Size
				m.counters.ResyncBlocksChanged++
			}
			continue
		}
		b = m.blockForAlloc(a.Addr)
		if b == nil || b.allocated {
			continue // in memory the model does not know
		}
		size := m.cfg.Alloc.RoundSize(a.Size)
		if b.size > size && m.cfg.Alloc.shouldSplit(b.seg.small, b.size, size) {
			b = m.split(b, size)
		}
		b.allocated, b.requested = true, a.Size
		d := m.device(b.seg.device)
		d.allocated += b.size
		d.active += b.size
		m.counters.ResyncBlocksChanged++
	}
}

func sortedByAddr(set map[uint64]LiveAllocation) []LiveAllocation {
	out := make([]LiveAllocation, 0, len(set))
	for _, a := range set {
		out = append(out, a)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr < out[j].Addr })
	return out
}
