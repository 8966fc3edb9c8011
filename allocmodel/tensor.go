package allocmodel

// Tensor level: the caching allocator's blocks.
//
// What is observed and what is inferred:
//   - observed: each allocation's returned pointer and requested size (from
//     NpuCachingAllocator::allocate / raw_alloc), each free's pointer (from
//     local_raw_delete / raw_delete), each segment the allocator obtains or
//     releases (runtime calls made inside the allocator), streams and devices
//     where the allocator's malloc is observed;
//   - inferred: the block sizes (torch_npu's round_size, with the target's
//     own configuration), whether a block is split (should_split) and merged
//     on free, and so requested_size of free blocks and block boundaries.
//     The pointer the allocator returns is observed, so which block best fit
//     chose is never guessed, and a disagreement with the rules is noticed
//     and repaired (counted in Counters).
//   - not observed: frees deferred by stream events (recordStream): blocks
//     go from active_allocated to inactive at the free call, with
//     free_requested and free_completed back to back.

// DataPtr device type of an NPU tensor (c10::DeviceType::PrivateUse1).
const deviceTypePrivateUse1 = 20

func (m *Model) applyTensorAlloc(t *threadState, ev *Event) {
	t.allocFailed = false
	if ev.Call == CallTorchAllocate && ev.Arg>>8 == deviceTypePrivateUse1 {
		// The DataPtr says which device the tensor is on: that is the
		// thread's current device, also for its later runtime calls.
		t.device, t.deviceKnown = int(ev.Arg&0xff), true
	}
	if ev.Addr == 0 {
		return // a zero-size request: no block
	}
	size := m.cfg.Alloc.RoundSize(ev.Size)
	b := m.blockForAlloc(ev.Addr)
	if b == nil {
		m.counters.AllocsUnplaceable++
		return
	}
	d := m.device(b.seg.device)
	if b.allocated {
		// Its free's record was lost: record the free now, so the trace
		// replays.
		m.counters.AllocsOverLiveBlock++
		m.freeLost(b, ev.MonoNs)
		m.mergeFree(b)
		if b = m.blockForAlloc(ev.Addr); b == nil || b.allocated {
			m.counters.AllocsUnplaceable++
			return
		}
	}
	if !fits(b, size) {
		// The allocation runs past the end of the model's segment (or its
		// mapped range): the real segment here is another, larger one,
		// whose records were lost. Placing the block would put it outside
		// its segment in the trace; the resync that follows lost records
		// brings both in.
		m.counters.AllocsUnplaceable++
		return
	}
	b = m.claim(b, size, ev.MonoNs)
	b.allocated = true
	b.requested = ev.Size
	d.allocated += b.size
	d.active += b.size
	stream := b.seg.stream
	if ev.Ctx.HasStream {
		stream = ev.Ctx.Stream
	}
	m.record(b.seg.device, TraceEntry{MonoNs: ev.MonoNs, Action: ActionAlloc, Addr: ev.Addr, Size: ev.Size, Stream: stream})
}

func (m *Model) applyTensorFree(ev *Event) {
	if ev.Addr == 0 {
		m.counters.FreesOfNull++
		return
	}
	b := m.blocks[ev.Addr]
	if b == nil || !b.allocated {
		m.counters.FreesOfUnknownBlocks++
		return
	}
	seg := b.seg
	d := m.device(seg.device)
	d.allocated -= b.size
	d.active -= b.size
	b.allocated = false
	// No stream events are observed, so the block is free at once.
	e := TraceEntry{MonoNs: ev.MonoNs, Addr: b.addr, Size: b.requested, Stream: seg.stream}
	e.Action = ActionFreeRequested
	m.record(seg.device, e)
	e.Action = ActionFreeCompleted
	m.record(seg.device, e)
	m.mergeFree(b)
}

// blockForAlloc returns the block an allocation at ptr was served from, or
// nil if ptr lies in no known segment. Normally that is the free block
// starting at ptr. Otherwise the model repairs its own state:
//   - ptr inside a free block: another thread's allocation split that block
//     and has not been recorded yet (it returned later). The block is split
//     at ptr; the low part stays free for that allocation.
//   - ptr inside an allocated block, beyond what the block's request needs:
//     torch split the block where the model did not. The block is cut to
//     its rounded request and the search goes on in the remainder.
func (m *Model) blockForAlloc(ptr uint64) *block {
	if b := m.blocks[ptr]; b != nil {
		return b
	}
	seg := m.segmentContaining(ptr)
	if seg == nil {
		return nil
	}
	for b := seg.head; b != nil; b = b.next {
		if ptr < b.addr || ptr >= b.addr+b.size {
			continue
		}
		if !b.allocated {
			if ptr == b.addr {
				m.blocks[ptr] = b // the index had lost it
				return b
			}
			low := m.split(b, ptr-b.addr)
			if m.cfg.Alloc.ExpandableSegments && b.mapped {
				// torch_npu's alignment split (base_addr_aligned_kb): the
				// old block object keeps the unaligned low part, a new
				// one takes the aligned rest.
				m.counters.AlignmentSplits++
				low.requested, b.requested = b.requested, 0
			} else {
				m.counters.OutOfOrderSplits++
				low.requested = 0
			}
			return b
		}
		need := m.cfg.Alloc.RoundSize(b.requested)
		if need < b.size && ptr >= b.addr+need {
			m.counters.BlockSplitsRepaired++
			d := m.device(seg.device)
			d.allocated -= b.size - need
			d.active -= b.size - need
			head := m.split(b, need) // head: the allocated part
			head.allocated, head.requested = true, b.requested
			b.allocated, b.requested = false, 0
			return m.blockForAlloc(ptr)
		}
		return nil
	}
	return nil
}

// fits reports whether an allocation of size bytes starting at b fits in b
// and the blocks after it in the same mapped state, up to the segment's
// end. It stops as soon as it does: normally at b itself.
func fits(b *block, size uint64) bool {
	n := b.size
	for x := b.next; n < size && x != nil && x.mapped == b.mapped; x = x.next {
		n += x.size
	}
	return n >= size
}

// claim makes the free block b fit an allocation of size bytes, as the
// allocator just did: normally by splitting off the rest (should_split).
// A block too small means the model missed frees after it (their records
// were lost): the following blocks are freed (with their entries, at
// monoNs) and merged in until the allocation fits.
// The caller checks that it can (fits).
func (m *Model) claim(b *block, size uint64, monoNs int64) *block {
	for b.size < size && b.next != nil && b.next.mapped == b.mapped {
		n := b.next
		if n.allocated {
			m.freeLost(n, monoNs)
		}
		b.size += n.size
		b.next = n.next
		if n.next != nil {
			n.next.prev = b
		}
		delete(m.blocks, n.addr)
		m.counters.BlocksMergedRepaired++
	}
	if b.size > size && m.cfg.Alloc.shouldSplit(b.seg.small, b.size, size) {
		b = m.split(b, size)
	}
	return b
}

// freeLost frees an allocated block whose free record was lost, recording
// the free at monoNs so the trace replays to the state.
func (m *Model) freeLost(b *block, monoNs int64) {
	d := m.device(b.seg.device)
	d.allocated -= b.size
	d.active -= b.size
	b.allocated = false
	e := TraceEntry{MonoNs: monoNs, Addr: b.addr, Size: b.requested, Stream: b.seg.stream, Action: ActionFreeRequested}
	m.record(b.seg.device, e)
	e.Action = ActionFreeCompleted
	m.record(b.seg.device, e)
}

// split cuts size bytes off the front of b as torch does: a new block takes
// the low part; b becomes the remainder and keeps its requested_size. It
// returns the new block.
func (m *Model) split(b *block, size uint64) *block {
	nb := &block{addr: b.addr, size: size, seg: b.seg, prev: b.prev, next: b, mapped: b.mapped}
	if b.prev != nil {
		b.prev.next = nb
	} else {
		b.seg.head = nb
	}
	b.prev = nb
	b.addr += size
	b.size -= size
	m.blocks[nb.addr] = nb
	m.blocks[b.addr] = b
	return nb
}

// mergeFree merges the freed block b with free neighbours in the same
// mapping state: b absorbs them and keeps its own requested_size, as
// torch_npu's try_merge_blocks does.
func (m *Model) mergeFree(b *block) {
	if p := b.prev; p != nil && !p.allocated && p.mapped == b.mapped {
		delete(m.blocks, b.addr)
		b.addr = p.addr
		b.size += p.size
		b.prev = p.prev
		if p.prev != nil {
			p.prev.next = b
		} else {
			b.seg.head = b
		}
		m.blocks[b.addr] = b
	}
	if n := b.next; n != nil && !n.allocated && n.mapped == b.mapped {
		delete(m.blocks, n.addr)
		b.size += n.size
		b.next = n.next
		if n.next != nil {
			n.next.prev = b
		}
	}
}
