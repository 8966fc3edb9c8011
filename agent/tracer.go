// Package agent is npuprobe's kernel-facing half: it loads the BPF
// programs, finds the CANN runtime in a target process, attaches uprobes,
// and reads and decodes the ring buffer into allocmodel events.
//
// Invariants:
//   - A process is added to the BPF filter before any probe is attached, so
//     its first call after attach is recorded.
//   - Each probed symbol is attached once, at the file the process binds it
//     in, never at every file that defines it.
//   - Events come out in ring-buffer order; per-CPU sequence gaps (records
//     the kernel could not reserve) are counted, never hidden.
package agent

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/bpf"
)

// DefaultRingBufferBytes holds about 130,000 records: several seconds of a
// busy allocator, so a reader stalled by a snapshot write loses nothing.
const DefaultRingBufferBytes = 8 << 20

// Options configure a Tracer.
type Options struct {
	// RingBufferBytes is the BPF ring buffer's size: a power of two, at
	// least one page.
	RingBufferBytes int
	// TraceAll makes every process that reaches a probe traced (--all);
	// probes are then attached system-wide, once per library file.
	TraceAll bool
	// StopOnLoad stops a watched process right after it dlopen()s the
	// runtime or torch_npu, so the agent attaches before its first call.
	StopOnLoad bool
	// Floor attaches a program that does nothing at every probe point
	// instead of the real ones: the cost of the uprobes alone, the floor
	// npuprobe's overhead is measured against (benchmarks only).
	Floor bool
}

// probeSpec names the BPF programs attached to one runtime function.
type probeSpec struct {
	symbol string
	entry  string // uprobe program, "" for none
	ret    string // uretprobe program, "" for none
}

// runtimeProbes are the CANN runtime functions traced at segment level.
var runtimeProbes = []probeSpec{
	{"aclrtMalloc", bpf.NpuprobeProgUprobeAclrtMalloc, bpf.NpuprobeProgUretprobeAclrtMalloc},
	{"aclrtMallocAlign32", bpf.NpuprobeProgUprobeAclrtMallocAlign32, bpf.NpuprobeProgUretprobeAclrtMallocAlign32},
	{"aclrtMallocCached", bpf.NpuprobeProgUprobeAclrtMallocCached, bpf.NpuprobeProgUretprobeAclrtMallocCached},
	{"aclrtFree", bpf.NpuprobeProgUprobeAclrtFree, ""},
	{"aclrtSetDevice", bpf.NpuprobeProgUprobeAclrtSetDevice, bpf.NpuprobeProgUretprobeAclrtSetDevice},
	{"aclrtGetDevice", bpf.NpuprobeProgUprobeAclrtGetDevice, bpf.NpuprobeProgUretprobeAclrtGetDevice},
	{"aclrtGetMemInfo", bpf.NpuprobeProgUprobeAclrtGetMemInfo, bpf.NpuprobeProgUretprobeAclrtGetMemInfo},
	{"aclrtReserveMemAddress", bpf.NpuprobeProgUprobeAclrtReserveMemAddress, bpf.NpuprobeProgUretprobeAclrtReserveMemAddress},
	{"aclrtReleaseMemAddress", bpf.NpuprobeProgUprobeAclrtReleaseMemAddress, ""},
	{"aclrtMallocPhysical", bpf.NpuprobeProgUprobeAclrtMallocPhysical, bpf.NpuprobeProgUretprobeAclrtMallocPhysical},
	{"aclrtFreePhysical", bpf.NpuprobeProgUprobeAclrtFreePhysical, ""},
	{"aclrtMapMem", bpf.NpuprobeProgUprobeAclrtMapMem, bpf.NpuprobeProgUretprobeAclrtMapMem},
	{"aclrtUnmapMem", bpf.NpuprobeProgUprobeAclrtUnmapMem, ""},
}

// Without these two there is nothing to trace.
var requiredSymbols = []string{"aclrtMalloc", "aclrtFree"}

// torchProbe names the BPF programs attached to one torch_npu function.
// These are hidden symbols (torch_npu builds with -fvisibility=hidden):
// resolvable only from .symtab or a debug file.
type torchProbe struct {
	what     string   // for messages
	names    []string // mangled names; the first one found is used
	entry    string
	ret      string // attached as a uprobe at every return instruction (see retsites.go)
	required bool   // without it there is no tensor level
}

// torchProbes are the entry points of torch_npu's caching allocator that
// every allocation and free passes through whatever the compiler inlined:
// allocate is virtual (libtorch calls it through c10::Allocator), and
// local_raw_delete is stored as a function pointer in every DataPtr.
// NpuCachingAllocator::malloc is called directly and may be inlined, so it
// only lends the stream and device it carries; it never decides whether an
// allocation is seen.
var torchProbes = []torchProbe{
	{"NpuCachingAllocator::allocate", []string{
		"_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator8allocateEm",
		"_ZNK7c10_npu19NPUCachingAllocator19NpuCachingAllocator8allocateEm", // const before torch_npu 2.3
	}, bpf.NpuprobeProgUprobeTorchAllocate, bpf.NpuprobeProgUprobeTorchAllocateReturn, true},
	{"local_raw_delete", []string{"_ZN7c10_npu19NPUCachingAllocator16local_raw_deleteEPv"},
		bpf.NpuprobeProgUprobeTorchLocalRawDelete, "", true},
	{"NpuCachingAllocator::raw_alloc", []string{"_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator9raw_allocEm"},
		bpf.NpuprobeProgUprobeTorchRawAlloc, bpf.NpuprobeProgUprobeTorchRawAllocReturn, false},
	{"NpuCachingAllocator::raw_alloc_with_stream", []string{"_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator21raw_alloc_with_streamEmPv"},
		bpf.NpuprobeProgUprobeTorchRawAllocWithStream, bpf.NpuprobeProgUprobeTorchRawAllocWithStreamReturn, false},
	{"NpuCachingAllocator::raw_delete", []string{"_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator10raw_deleteEPv"},
		bpf.NpuprobeProgUprobeTorchRawDelete, "", false},
	{"NpuCachingAllocator::malloc", []string{"_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator6mallocEPPvimS2_"},
		bpf.NpuprobeProgUprobeTorchMalloc, bpf.NpuprobeProgUprobeTorchMallocReturn, false},
}

// Level is the level of detail asked for.
type Level int

const (
	LevelAuto    Level = iota // tensor when torch_npu's symbols resolve, else segment
	LevelSegment              // runtime calls only
	LevelTensor               // tensor level or fail
)

// AttachOptions configure Attach.
type AttachOptions struct {
	Level Level
	// DebugDirs are searched for debug files (build-id and debuglink
	// layouts) before /usr/lib/debug.
	DebugDirs []string
}

// Tracer owns the loaded BPF objects and the ring buffer reader.
type Tracer struct {
	opts   Options
	coll   *ebpf.Collection
	reader *ringbuf.Reader
	rec    ringbuf.Record
	// Every probe attached, so that nothing is attached twice and a
	// process's probes can be detached when it goes.
	links map[attachKey]link.Link
	// Per-CPU sequence tracking: the next number expected from each CPU.
	nextSeq []uint64
	gapped  uint64 // records missing from per-CPU sequences
	badRecs uint64 // records that failed to decode
}

// NewTracer checks privileges and kernel features, then loads the BPF
// programs. Nothing is attached yet.
func NewTracer(opts Options) (*Tracer, error) {
	if err := checkPrivileges(); err != nil {
		return nil, err
	}
	if opts.RingBufferBytes == 0 {
		opts.RingBufferBytes = DefaultRingBufferBytes
	}
	page := os.Getpagesize()
	if n := opts.RingBufferBytes; n < page || n&(n-1) != 0 {
		return nil, fmt.Errorf("ring buffer size %d is not a power of two of at least %d bytes", n, page)
	}
	if err := features.HaveMapType(ebpf.RingBuf); err != nil {
		return nil, &Error{Kind: ErrKernelFeature, What: "this kernel has no BPF ring buffer", Err: err,
			Fix: "npuprobe needs Linux 5.8 or newer"}
	}
	// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, &Error{Kind: ErrPrivilege, What: "cannot raise the locked-memory limit for BPF maps", Err: err,
			Fix: "run as root or grant CAP_SYS_RESOURCE"}
	}
	spec, err := bpf.LoadNpuprobe()
	if err != nil {
		return nil, err
	}
	spec.Maps[bpf.NpuprobeMapEvents].MaxEntries = uint32(opts.RingBufferBytes)
	for name, on := range map[string]bool{"cfg_trace_all": opts.TraceAll, "cfg_stop_on_load": opts.StopOnLoad} {
		v, ok := spec.Variables[name]
		if !ok {
			return nil, fmt.Errorf("BPF object has no %s", name)
		}
		var val uint32
		if on {
			val = 1
		}
		if err := v.Set(val); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
	}
	if err := spec.Variables["cfg_wakeup_bytes"].Set(uint64(opts.RingBufferBytes / 4)); err != nil {
		return nil, fmt.Errorf("set cfg_wakeup_bytes: %w", err)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
			return nil, privilegeError(err)
		}
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, &Error{Kind: ErrKernelFeature, What: "the kernel's BPF verifier rejected npuprobe's programs",
				Err: fmt.Errorf("%+v", ve), Fix: "report this with your kernel version (uname -r)"}
		}
		return nil, fmt.Errorf("load BPF programs: %w", err)
	}
	reader, err := ringbuf.NewReader(coll.Maps[bpf.NpuprobeMapEvents])
	if err != nil {
		coll.Close()
		return nil, fmt.Errorf("open ring buffer: %w", err)
	}
	t := &Tracer{opts: opts, coll: coll, reader: reader, links: make(map[attachKey]link.Link)}
	if opts.TraceAll {
		// Processes appearing: their libraries are looked at on exec.
		l, err := link.Tracepoint("sched", "sched_process_exec", coll.Programs[bpf.NpuprobeProgTracepointSchedProcessExec], nil)
		if err != nil {
			t.Close()
			return nil, &Error{Kind: ErrKernelFeature, What: "cannot attach to the sched_process_exec tracepoint", Err: err,
				Fix: "--all needs tracepoints (CONFIG_TRACEPOINTS) and tracefs"}
		}
		t.links[attachKey{prog: bpf.NpuprobeProgTracepointSchedProcessExec}] = l
	}
	return t, nil
}

// Close detaches every probe and frees the BPF objects.
func (t *Tracer) Close() error {
	for k, l := range t.links {
		l.Close()
		delete(t.links, k)
	}
	err := t.reader.Close()
	t.coll.Close()
	return err
}

// SetDeadline bounds how long Read waits for a record; the zero time
// waits forever.
func (t *Tracer) SetDeadline(d time.Time) { t.reader.SetDeadline(d) }

// Flush makes a blocked Read return the records already in the ring
// buffer, then ringbuf.ErrFlushed.
func (t *Tracer) Flush() error { return t.reader.Flush() }

// ErrFlushed is returned by Read after Flush once the buffer is drained.
var ErrFlushed = ringbuf.ErrFlushed

// Read waits for the next record and decodes it into ev. It returns
// os.ErrDeadlineExceeded when the deadline passes with no record.
func (t *Tracer) Read(ev *allocmodel.Event) error {
	for {
		if err := t.reader.ReadInto(&t.rec); err != nil {
			return err
		}
		if err := DecodeRecord(t.rec.RawSample, ev); err != nil {
			t.badRecs++
			continue
		}
		t.trackSeq(ev.CPU, ev.Seq)
		return nil
	}
}

func (t *Tracer) trackSeq(cpu uint16, seq uint64) {
	for int(cpu) >= len(t.nextSeq) {
		t.nextSeq = append(t.nextSeq, 0)
	}
	if seq > t.nextSeq[cpu] {
		t.gapped += seq - t.nextSeq[cpu]
	}
	t.nextSeq[cpu] = seq + 1
}

// Loss sums what the tracer knows was lost.
type Loss struct {
	// RingBufferFull: records the kernel could not reserve (full buffer).
	RingBufferFull uint64
	// SequenceGaps: records missing from the per-CPU sequences as seen by
	// the reader; equals RingBufferFull once the reader has caught up.
	SequenceGaps uint64
	// UnpairedReturns: returns whose entry was never seen (attached
	// mid-call, or the entry was evicted).
	UnpairedReturns uint64
	// PendingFull: entries that could not be stored for pairing.
	PendingFull uint64
	// ReadFailed: output pointers the kernel could not read.
	ReadFailed uint64
	// LiveFull: live allocations the kernel could not store for resync.
	LiveFull uint64
	// Stopped: processes stopped at a runtime dlopen.
	Stopped uint64
	// BadRecords: records that failed to decode.
	BadRecords uint64
}

// Loss reads the kernel's per-CPU counters and the reader's own.
func (t *Tracer) Loss() (Loss, error) {
	sum := func(idx uint32) (uint64, error) {
		var perCPU []uint64
		if err := t.coll.Maps[bpf.NpuprobeMapCounters].Lookup(&idx, &perCPU); err != nil {
			return 0, err
		}
		var s uint64
		for _, v := range perCPU {
			s += v
		}
		return s, nil
	}
	var l Loss
	var err error
	// Indexes are enum npu_counter in npuprobe.bpf.c.
	if l.RingBufferFull, err = sum(1); err != nil {
		return l, err
	}
	if l.UnpairedReturns, err = sum(2); err != nil {
		return l, err
	}
	if l.PendingFull, err = sum(3); err != nil {
		return l, err
	}
	if l.ReadFailed, err = sum(4); err != nil {
		return l, err
	}
	if l.LiveFull, err = sum(5); err != nil {
		return l, err
	}
	if l.Stopped, err = sum(6); err != nil {
		return l, err
	}
	l.SequenceGaps = t.gapped
	l.BadRecords = t.badRecs
	return l, nil
}
