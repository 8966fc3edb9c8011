package allocmodel

import "sort"

// Resync brings the model in line with what the kernel says the process
// holds, after records were lost (the ring buffer was full). Segments,
// mappings and allocated blocks are made to match live, and every change
// is also written to the trace, stamped at the resync (the latest event
// applied), so that replaying the trace still arrives at the state the
// snapshot shows: memory_viz replays it backwards from that state. Those
// entries are counted (ResyncEntries); their time is the resync's, not the
// lost event's.
//
// Call it when every record written before live was read has been applied
// (the ring buffer was drained), or records still queued will undo some of
// its changes.
func (m *Model) Resync(live LiveState) {
	m.counters.Resyncs++
	for _, t := range m.threads {
		if t.run.active {
			m.flushRun(t)
		}
	}
	var liveBlocks map[uint64]LiveAllocation
	if m.cfg.Level == LevelTensor {
		liveBlocks = byAddr(live.Blocks, nil)
		m.resyncFreeBlocks(liveBlocks)
	}
	m.resyncSegments(live.Segments)
	m.resyncReservations(live.Reservations, live.Mappings)
	if m.cfg.Level == LevelTensor {
		m.resyncAllocBlocks(liveBlocks)
	}
}

// synth records an entry a resync made up.
func (m *Model) synth(dev int, e TraceEntry) {
	e.MonoNs = m.lastMono
	m.record(dev, e)
	m.counters.ResyncEntries++
}

func byAddr(list []LiveAllocation, keep func(LiveAllocation) bool) map[uint64]LiveAllocation {
	out := make(map[uint64]LiveAllocation, len(list))
	for _, a := range list {
		if keep == nil || keep(a) {
			out[a.Addr] = a
		}
	}
	return out
}

// resyncFreeBlocks frees blocks the model holds allocated that the process
// has freed, or has freed and allocated again for another request (the
// block's size may differ: it is allocated afresh by resyncAllocBlocks).
func (m *Model) resyncFreeBlocks(live map[uint64]LiveAllocation) {
	var freed []*block
	for _, seg := range m.segments {
		for b := seg.head; b != nil; b = b.next {
			if a, ok := live[b.addr]; b.allocated && (!ok || a.Size != b.requested) {
				freed = append(freed, b)
			}
		}
	}
	sort.Slice(freed, func(i, j int) bool { return freed[i].addr < freed[j].addr })
	for _, b := range freed {
		m.freeLost(b, m.lastMono)
		m.counters.ResyncEntries += 2
		m.mergeFree(b)
		m.counters.ResyncBlocksChanged++
	}
}

// resyncAllocBlocks allocates blocks the process holds that the model has
// free, where the model can place them.
func (m *Model) resyncAllocBlocks(live map[uint64]LiveAllocation) {
	for _, a := range sortedByAddr(live) {
		if b := m.blocks[a.Addr]; b != nil && b.allocated {
			continue // the same allocation (resyncFreeBlocks freed changed ones)
		}
		b := m.blockForAlloc(a.Addr)
		size := m.cfg.Alloc.RoundSize(a.Size)
		if b == nil || b.allocated || !b.mapped || !fits(b, size) {
			continue // in memory the model does not know
		}
		b = m.claim(b, size, m.lastMono)
		b.allocated, b.requested = true, a.Size
		d := m.device(b.seg.device)
		d.allocated += b.size
		d.active += b.size
		m.synth(b.seg.device, TraceEntry{Action: ActionAlloc, Addr: b.addr, Size: a.Size, Stream: b.seg.stream})
		m.counters.ResyncBlocksChanged++
	}
}

func (m *Model) resyncSegments(list []LiveAllocation) {
	// At tensor level only the caching allocator's segments belong in the
	// snapshot.
	want := byAddr(list, func(a LiveAllocation) bool { return m.cfg.Level != LevelTensor || a.ByAllocator })
	var gone []*segment
	for addr, seg := range m.segments {
		if a, ok := want[addr]; !seg.expandable && (!ok || a.Size != seg.size) {
			gone = append(gone, seg)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].addr < gone[j].addr })
	for _, seg := range gone {
		m.releaseBlocks(seg)
		m.dropSegment(seg)
		m.synth(seg.device, TraceEntry{Action: ActionSegmentFree, Addr: seg.addr, Size: seg.size, Stream: seg.stream})
		m.counters.ResyncSegmentsRemoved++
	}
	for _, a := range sortedByAddr(want) {
		if m.segments[a.Addr] != nil {
			continue
		}
		dev := a.Device
		if dev < 0 {
			dev = m.cfg.DefaultDevice
		}
		seg := m.newSegment(dev, a.Addr, a.Size, a.Stream, a.Size == smallBuffer)
		m.synth(seg.device, TraceEntry{Action: ActionSegmentAlloc, Addr: a.Addr, Size: a.Size, Stream: a.Stream})
		m.counters.ResyncSegmentsAdded++
	}
}

func (m *Model) resyncReservations(reservations, mappings []LiveAllocation) {
	want := byAddr(reservations, nil)
	var gone []*segment
	for addr, seg := range m.segments {
		if r, ok := want[addr]; seg.expandable && (!ok || r.Size != seg.size) {
			gone = append(gone, seg)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].addr < gone[j].addr })
	for _, seg := range gone {
		for _, r := range mappedRanges(seg) {
			m.synth(seg.device, TraceEntry{Action: ActionSegmentUnmap, Addr: r[0], Size: r[1] - r[0], Stream: seg.stream})
		}
		m.dropSegment(seg)
		m.counters.ResyncSegmentsRemoved++
	}
	for _, r := range sortedByAddr(want) {
		if m.segments[r.Addr] != nil {
			continue
		}
		dev := r.Device
		if dev < 0 {
			dev = m.cfg.DefaultDevice
		}
		seg := &segment{device: dev, addr: r.Addr, size: r.Size, stream: r.Stream, expandable: true}
		seg.head = &block{addr: r.Addr, size: r.Size, seg: seg}
		m.addSegment(seg)
		m.counters.ResyncSegmentsAdded++
	}

	// Mapped pages: exactly the live mappings.
	mapped := make(map[*segment][][2]uint64)
	for _, mp := range mappings {
		if seg := m.segmentContaining(mp.Addr); seg != nil && seg.expandable {
			mapped[seg] = append(mapped[seg], [2]uint64{mp.Addr, mp.Addr + mp.Size})
			if h, ok := m.handles[mp.Stream]; ok && !m.anyMapped(seg) {
				seg.device = h.device
			}
		}
	}
	var segs []*segment
	for _, seg := range m.segments {
		if seg.expandable {
			segs = append(segs, seg)
		}
	}
	sort.Slice(segs, func(i, j int) bool { return segs[i].addr < segs[j].addr })
	for _, seg := range segs {
		want := normalize(mapped[seg])
		have := mappedRanges(seg)
		for _, r := range subtractRanges(have, want) {
			m.setMapped(seg, r[0], r[1], false)
			m.synth(seg.device, TraceEntry{Action: ActionSegmentUnmap, Addr: r[0], Size: r[1] - r[0], Stream: seg.stream})
		}
		for _, r := range subtractRanges(want, have) {
			m.setMapped(seg, r[0], r[1], true)
			m.synth(seg.device, TraceEntry{Action: ActionSegmentMap, Addr: r[0], Size: r[1] - r[0], Stream: seg.stream})
		}
	}
}

// mappedRanges lists seg's contiguous mapped ranges in address order.
func mappedRanges(seg *segment) [][2]uint64 {
	var out [][2]uint64
	for b := seg.head; b != nil; b = b.next {
		if !b.mapped {
			continue
		}
		if n := len(out); n > 0 && out[n-1][1] == b.addr {
			out[n-1][1] += b.size
		} else {
			out = append(out, [2]uint64{b.addr, b.addr + b.size})
		}
	}
	return out
}

// normalize sorts ranges and merges touching ones.
func normalize(r [][2]uint64) [][2]uint64 {
	sort.Slice(r, func(i, j int) bool { return r[i][0] < r[j][0] })
	var out [][2]uint64
	for _, x := range r {
		if n := len(out); n > 0 && x[0] <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], x[1])
			continue
		}
		out = append(out, x)
	}
	return out
}

// subtractRanges returns the parts of a (sorted, disjoint) not in b
// (sorted, disjoint).
func subtractRanges(a, b [][2]uint64) [][2]uint64 {
	var out [][2]uint64
	j := 0
	for _, r := range a {
		lo, hi := r[0], r[1]
		for j < len(b) && b[j][1] <= lo {
			j++
		}
		for k := j; k < len(b) && b[k][0] < hi; k++ {
			if b[k][0] > lo {
				out = append(out, [2]uint64{lo, b[k][0]})
			}
			lo = max(lo, b[k][1])
		}
		if lo < hi {
			out = append(out, [2]uint64{lo, hi})
		}
	}
	return out
}

func sortedByAddr(set map[uint64]LiveAllocation) []LiveAllocation {
	out := make([]LiveAllocation, 0, len(set))
	for _, a := range set {
		out = append(out, a)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr < out[j].Addr })
	return out
}
