package bench

import (
	"slices"
	"sort"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// Event streams as the kernel would record them, built from the same
// allocation patterns the fixtures drive (tests/fixture/workload): a
// segment-level stream like segment_workload's (runtime mallocs and frees
// of torch_npu-sized segments from two threads, with the device and
// free-memory queries torch_npu makes) and a tensor-level stream like a
// training loop's (persistent parameters, then per iteration a forward pass
// allocating activations and a backward pass freeing them, through a
// caching allocator that follows torch_npu's round_size / best-fit /
// should_split / merge rules, so the model never has to repair anything).

const (
	kib = 1 << 10
	mib = 1 << 20

	benchTgid = 4242
	deviceHBM = 0x100000000000 // base of the fake device heap
	heapSize  = 1 << 40        // 1 TiB of device address space
	devType   = 20             // c10::DeviceType::PrivateUse1
	benchStrm = 0x7f0000001000 // the stream every tensor uses
)

// rng is xorshift64*, deterministic across Go versions.
type rng uint64

func newRNG(seed uint64) *rng {
	z := seed + 0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	z ^= z >> 31
	if z == 0 {
		z = 1
	}
	r := rng(z)
	return &r
}

func (r *rng) next() uint64 {
	x := uint64(*r)
	x ^= x >> 12
	x ^= x << 25
	x ^= x >> 27
	*r = rng(x)
	return x * 2685821657736338717
}

func (r *rng) intn(n int) int { return int(r.next() % uint64(n)) }

// logUniform draws from [lo, hi) with a log-uniform density.
func (r *rng) logUniform(lo, hi uint64) uint64 {
	// Pick the power of two, then a uniform value inside it.
	lb, hb := log2(lo), log2(hi)
	b := lb + r.intn(hb-lb)
	base := uint64(1) << b
	v := base + r.next()%base
	return max(lo, min(v, hi-1))
}

func log2(v uint64) int {
	n := 0
	for v > 1 {
		v >>= 1
		n++
	}
	return n
}

// emitter stamps events the way the BPF side does: per-CPU sequence
// numbers, monotonic time, the tgid.
type emitter struct {
	r    *rng
	seq  [2]uint64
	mono int64
	n    int
	max  int
	emit func(*allocmodel.Event)
}

func (e *emitter) full() bool { return e.n >= e.max }

func (e *emitter) send(ev allocmodel.Event, tid uint32) {
	if e.full() {
		return
	}
	cpu := uint16(tid % 2)
	e.mono += int64(2000 + e.r.intn(18000)) // 2–20 µs apart
	ev.Seq = e.seq[cpu]
	e.seq[cpu]++
	ev.MonoNs = e.mono
	ev.Tgid = benchTgid
	ev.Tid = tid
	ev.CPU = cpu
	e.emit(&ev)
	e.n++
}

// devHeap hands out device addresses first fit, 64-byte aligned, as the
// fake runtime does.
type devHeap struct {
	holes [][2]uint64 // [start, end), sorted, disjoint, not touching
}

func newDevHeap() *devHeap { return &devHeap{holes: [][2]uint64{{deviceHBM, deviceHBM + heapSize}}} }

func (h *devHeap) alloc(size uint64) uint64 {
	size = (size + 63) &^ 63
	for i, hole := range h.holes {
		if hole[1]-hole[0] >= size {
			addr := hole[0]
			if hole[1]-hole[0] == size {
				h.holes = slices.Delete(h.holes, i, i+1)
			} else {
				h.holes[i][0] += size
			}
			return addr
		}
	}
	panic("bench: device heap exhausted")
}

func (h *devHeap) free(addr, size uint64) {
	size = (size + 63) &^ 63
	end := addr + size
	i := sort.Search(len(h.holes), func(i int) bool { return h.holes[i][0] > addr })
	mergePrev := i > 0 && h.holes[i-1][1] == addr
	mergeNext := i < len(h.holes) && h.holes[i][0] == end
	switch {
	case mergePrev && mergeNext:
		h.holes[i-1][1] = h.holes[i][1]
		h.holes = slices.Delete(h.holes, i, i+1)
	case mergePrev:
		h.holes[i-1][1] = end
	case mergeNext:
		h.holes[i][0] = addr
	default:
		h.holes = slices.Insert(h.holes, i, [2]uint64{addr, end})
	}
}

// segmentSize draws a segment size as segment_workload does (torch_npu's
// caching allocator: 2 MiB small-pool segments, 20 MiB default large ones,
// k × 2 MiB rounded large requests, rarely an odd size).
func segmentSize(r *rng) uint64 {
	switch p := r.intn(100); {
	case p < 30:
		return 2 * mib
	case p < 55:
		return 20 * mib
	case p < 90:
		return uint64(5+r.intn(36)) * 2 * mib
	default:
		s := mib + r.next()%(3*mib)
		if s%32 == 0 {
			s += 1 + uint64(r.intn(31))
		}
		return s
	}
}

// SegmentEvents emits n segment-level events: two threads, each holding at
// most 64 segments, 55 % mallocs (70 % aclrtMallocAlign32, 30 %
// aclrtMalloc) and 45 % frees, plus each thread's aclrtGetDevice and an
// occasional aclrtGetMemInfo, as segment_workload.
func SegmentEvents(n int, seed uint64, emit func(*allocmodel.Event)) {
	r := newRNG(seed)
	e := &emitter{r: r, mono: 1e12, max: n, emit: emit}
	heap := newDevHeap()
	type live struct{ addr, size uint64 }
	tids := []uint32{benchTgid + 1, benchTgid + 2}
	owned := make([][]live, len(tids))
	for _, tid := range tids {
		e.send(allocmodel.Event{Call: allocmodel.CallGetDevice, Outcome: allocmodel.OutcomeReturned, Arg: 0}, tid)
	}
	for !e.full() {
		t := r.intn(len(tids))
		tid := tids[t]
		if r.intn(1000) == 0 {
			e.send(allocmodel.Event{Call: allocmodel.CallGetMemInfo, Outcome: allocmodel.OutcomeReturned,
				Arg: 1, Addr: 32 << 30, Size: 64 << 30}, tid)
			continue
		}
		if len(owned[t]) > 0 && (len(owned[t]) > 64 || r.intn(100) >= 55) {
			i := r.intn(len(owned[t]))
			s := owned[t][i]
			owned[t][i] = owned[t][len(owned[t])-1]
			owned[t] = owned[t][:len(owned[t])-1]
			heap.free(s.addr, s.size)
			// Frees are recorded at entry, with the size from the
			// kernel's live map.
			e.send(allocmodel.Event{Call: allocmodel.CallFree, Outcome: allocmodel.OutcomeEntry, Addr: s.addr, Size: s.size}, tid)
			continue
		}
		call := allocmodel.CallMallocAlign32
		if r.intn(100) >= 70 {
			call = allocmodel.CallMalloc
		}
		size := segmentSize(r)
		addr := heap.alloc(size)
		owned[t] = append(owned[t], live{addr, size})
		e.send(allocmodel.Event{Call: call, Outcome: allocmodel.OutcomeReturned, Addr: addr, Size: size}, tid)
	}
}

// cache is a caching allocator with torch_npu's default rules.
type cache struct {
	conf  allocmodel.AllocConf
	heap  *devHeap
	e     *emitter
	small []*gblock // free blocks of each pool, sorted by (size, addr)
	large []*gblock
	segs  map[uint64]*gblock // segment base → head block
}

type gblock struct {
	addr, size uint64
	req        uint64
	small      bool
	allocated  bool
	segBase    uint64
	segSize    uint64
	prev, next *gblock
}

func (c *cache) pool(small bool) *[]*gblock {
	if small {
		return &c.small
	}
	return &c.large
}

func blockLess(a *gblock, size, addr uint64) bool {
	return a.size < size || (a.size == size && a.addr < addr)
}

func (c *cache) insertFree(b *gblock) {
	p := c.pool(b.small)
	i := sort.Search(len(*p), func(i int) bool { return !blockLess((*p)[i], b.size, b.addr) })
	*p = slices.Insert(*p, i, b)
}

func (c *cache) removeFree(b *gblock) {
	p := c.pool(b.small)
	i := sort.Search(len(*p), func(i int) bool { return !blockLess((*p)[i], b.size, b.addr) })
	if i >= len(*p) || (*p)[i] != b {
		panic("bench: free block not in its pool")
	}
	*p = slices.Delete(*p, i, i+1)
}

func (c *cache) alloc(req uint64, tid uint32) *gblock {
	size := c.conf.RoundSize(req)
	small := size <= mib
	p := c.pool(small)
	i := sort.Search(len(*p), func(i int) bool { return !blockLess((*p)[i], size, 0) })
	var b *gblock
	if i < len(*p) {
		b = (*p)[i]
		c.removeFree(b)
	} else {
		// A new segment, as get_allocation_size chooses it.
		segSize := uint64(2 * mib)
		switch {
		case small:
		case size < 10*mib:
			segSize = 20 * mib
		default:
			segSize = (size + 2*mib - 1) / (2 * mib) * (2 * mib)
		}
		addr := c.heap.alloc(segSize)
		b = &gblock{addr: addr, size: segSize, small: small, segBase: addr, segSize: segSize}
		c.segs[addr] = b
		c.e.send(allocmodel.Event{Call: allocmodel.CallMallocAlign32, Outcome: allocmodel.OutcomeReturned,
			Addr: addr, Size: segSize, Ctx: allocmodel.Context{Valid: true, Size: req,
				HasStream: true, Stream: benchStrm, HasDevice: true, Device: 0}}, tid)
	}
	rem := b.size - size
	split := rem > mib
	if small {
		split = rem >= 512
	}
	if split {
		nb := &gblock{addr: b.addr, size: size, small: small, segBase: b.segBase, segSize: b.segSize, prev: b.prev, next: b}
		if b.prev != nil {
			b.prev.next = nb
		} else {
			c.segs[b.segBase] = nb
		}
		b.prev = nb
		b.addr += size
		b.size -= size
		c.insertFree(b)
		b = nb
	}
	b.allocated, b.req = true, req
	c.e.send(allocmodel.Event{Call: allocmodel.CallTorchAllocate, Outcome: allocmodel.OutcomeReturned,
		Addr: b.addr, Size: req, Arg: devType << 8,
		Ctx: allocmodel.Context{HasStream: true, Stream: benchStrm, HasDevice: true}}, tid)
	return b
}

func (c *cache) free(b *gblock, tid uint32) {
	c.e.send(allocmodel.Event{Call: allocmodel.CallTorchLocalRawDelete, Outcome: allocmodel.OutcomeEntry, Addr: b.addr}, tid)
	b.allocated, b.req = false, 0
	if p := b.prev; p != nil && !p.allocated {
		c.removeFree(p)
		b.addr, b.size, b.prev = p.addr, b.size+p.size, p.prev
		if p.prev != nil {
			p.prev.next = b
		} else {
			c.segs[b.segBase] = b
		}
	}
	if n := b.next; n != nil && !n.allocated {
		c.removeFree(n)
		b.size += n.size
		b.next = n.next
		if n.next != nil {
			n.next.prev = b
		}
	}
	c.insertFree(b)
}

// emptyCache releases every wholly free segment, in address order.
func (c *cache) emptyCache(tid uint32) {
	var bases []uint64
	for base, head := range c.segs {
		if !head.allocated && head.next == nil {
			bases = append(bases, base)
		}
	}
	slices.Sort(bases)
	for _, base := range bases {
		head := c.segs[base]
		c.removeFree(head)
		delete(c.segs, base)
		c.heap.free(base, head.segSize)
		c.e.send(allocmodel.Event{Call: allocmodel.CallFree, Outcome: allocmodel.OutcomeEntry, Addr: base, Size: head.segSize}, tid)
	}
}

// TensorEvents emits n tensor-level events of a training loop: 300
// persistent parameters, then iterations that allocate 200–800 activations
// (a fifth of them freed again at once, as temporaries) and free the rest
// in reverse order; every 20 iterations the cache is emptied. Sizes are
// 70 % small (512 B – 1 MiB) and 30 % large (1 – 64 MiB), log-uniform.
func TensorEvents(n int, seed uint64, emit func(*allocmodel.Event)) {
	r := newRNG(seed)
	e := &emitter{r: r, mono: 1e12, max: n, emit: emit}
	c := &cache{conf: allocmodel.DefaultAllocConf(), heap: newDevHeap(), e: e, segs: make(map[uint64]*gblock)}
	const mainTid, workerTid = benchTgid, benchTgid + 1
	size := func() uint64 {
		if r.intn(100) < 70 {
			return r.logUniform(512, mib)
		}
		return r.logUniform(mib, 64*mib)
	}
	e.send(allocmodel.Event{Call: allocmodel.CallSetDevice, Outcome: allocmodel.OutcomeReturned}, mainTid)
	e.send(allocmodel.Event{Call: allocmodel.CallSetDevice, Outcome: allocmodel.OutcomeReturned}, workerTid)
	for range 300 {
		c.alloc(size(), mainTid)
	}
	for it := 1; !e.full(); it++ {
		var acts []*gblock
		k := 200 + r.intn(600)
		for range k {
			tid := uint32(mainTid)
			if r.intn(10) == 0 {
				tid = workerTid // a data-loader or comm thread
			}
			b := c.alloc(size(), tid)
			if r.intn(5) == 0 {
				c.free(b, tid)
				continue
			}
			acts = append(acts, b)
		}
		for i := len(acts) - 1; i >= 0; i-- {
			c.free(acts[i], mainTid)
		}
		if it%20 == 0 {
			c.emptyCache(mainTid)
		}
	}
}

// Stream is a recorded event stream: records back to back.
type Stream struct {
	Name    string
	Level   allocmodel.Level
	Records []byte
}

// Len is the number of records.
func (s *Stream) Len() int { return len(s.Records) / RecordSize }

// NewSegmentStream records n SegmentEvents.
func NewSegmentStream(n int, seed uint64) *Stream {
	s := &Stream{Name: "segment", Level: allocmodel.LevelSegment, Records: make([]byte, 0, n*RecordSize)}
	SegmentEvents(n, seed, func(ev *allocmodel.Event) { s.Records = AppendRecord(s.Records, ev) })
	return s
}

// NewTensorStream records n TensorEvents.
func NewTensorStream(n int, seed uint64) *Stream {
	s := &Stream{Name: "tensor", Level: allocmodel.LevelTensor, Records: make([]byte, 0, n*RecordSize)}
	TensorEvents(n, seed, func(ev *allocmodel.Event) { s.Records = AppendRecord(s.Records, ev) })
	return s
}
