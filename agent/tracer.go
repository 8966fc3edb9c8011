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
	"path"
	"strings"
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
	coll   *ebpf.Collection
	reader *ringbuf.Reader
	rec    ringbuf.Record
	links  []link.Link
	// Per-CPU sequence tracking: the next number expected from each CPU.
	nextSeq []uint64
	seqSeen []bool
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
	return &Tracer{coll: coll, reader: reader}, nil
}

// Close detaches every probe and frees the BPF objects.
func (t *Tracer) Close() error {
	for _, l := range t.links {
		l.Close()
	}
	t.links = nil
	err := t.reader.Close()
	t.coll.Close()
	return err
}

// Target describes a process being traced.
type Target struct {
	PID  int
	Name string // comm
	// Level is what was attached: allocmodel.LevelTensor when torch_npu's
	// allocator is probed too.
	Level allocmodel.Level
	// TensorUnavailable says, in one line, why tensor level was not
	// attached and how to get it; empty at tensor level.
	TensorUnavailable string
	// TorchSymbols says where torch_npu's hidden symbols came from.
	TorchSymbols string
	// Attached lists each probed symbol with the file (as the target
	// sees it) it was attached in.
	Attached map[string]string
	// Missing lists optional symbols no mapped file defines.
	Missing []string
	// AlsoDefined lists, per symbol, other files defining it that were
	// deliberately not attached.
	AlsoDefined map[string][]string
	// Warnings are things the user should know about what is attached.
	Warnings []string
}

// Attach starts tracing pid: it adds the process to the BPF filter and
// attaches the runtime probes where the process binds them, then, as the
// options ask, torch_npu's caching-allocator probes.
func (t *Tracer) Attach(pid int, opts AttachOptions) (*Target, error) {
	st, err := checkProcess(pid)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(runtimeProbes))
	for i, p := range runtimeProbes {
		names[i] = p.symbol
	}
	sites, files, err := resolveSymbols(pid, names, requiredSymbols[0])
	if err != nil {
		if errors.Is(err, os.ErrPermission) {
			return nil, &Error{Kind: ErrPrivilege, What: fmt.Sprintf("cannot read the memory map of process %d", pid), Err: err,
				Fix: "run as root or grant CAP_SYS_PTRACE"}
		}
		if errors.Is(err, os.ErrNotExist) {
			return nil, noProcessError(pid)
		}
		return nil, fmt.Errorf("read mappings of process %d: %w", pid, err)
	}
	defer closeELFs(files)
	for _, req := range requiredSymbols {
		if sites[req] == nil {
			return nil, &Error{Kind: ErrNoRuntime,
				What: fmt.Sprintf("process %d (%s) has no CANN runtime mapped: no mapped library defines %s", pid, st.Name, req),
				Fix:  "check the PID is the training process, and that it has imported torch_npu (libascendcl.so or libacl_rt.so must appear in /proc/" + fmt.Sprint(pid) + "/maps)"}
		}
	}

	tgid := uint32(pid)
	one := uint32(1)
	if err := t.coll.Maps[bpf.NpuprobeMapTracedTgids].Update(&tgid, &one, ebpf.UpdateAny); err != nil {
		return nil, fmt.Errorf("add process %d to the BPF filter: %w", pid, err)
	}

	target := &Target{PID: pid, Name: st.Name, Level: allocmodel.LevelSegment,
		Attached: make(map[string]string), AlsoDefined: make(map[string][]string)}
	for _, p := range runtimeProbes {
		site := sites[p.symbol]
		if site == nil {
			target.Missing = append(target.Missing, p.symbol)
			continue
		}
		if err := t.attachAt(site.elf.file, p.symbol, site.offset, pid, p.entry, p.ret); err != nil {
			return nil, err
		}
		target.Attached[p.symbol] = site.elf.mapping.Path
		if len(site.others) > 0 {
			target.AlsoDefined[p.symbol] = site.others
		}
	}
	if opts.Level == LevelSegment {
		return target, nil
	}
	if err := t.attachTorch(pid, target, opts); err != nil {
		return nil, err
	}
	return target, nil
}

// attachTorch attaches the caching-allocator probes in libtorch_npu.so when
// its hidden symbols can be resolved. At LevelAuto an unresolvable library
// leaves the target at segment level with TensorUnavailable saying why.
func (t *Tracer) attachTorch(pid int, target *Target, opts AttachOptions) error {
	unavailable := func(why string) error {
		if opts.Level == LevelTensor {
			return &Error{Kind: ErrNoSymbols, What: fmt.Sprintf("tensor level unavailable for process %d: %s", pid, why), Fix: symbolsFix}
		}
		target.TensorUnavailable = fmt.Sprintf("tensor level unavailable for process %d: %s; tracing segments only (%s)", pid, why, symbolsFix)
		return nil
	}
	elfs, err := targetELFs(pid)
	if err != nil {
		return fmt.Errorf("read mappings of process %d: %w", pid, err)
	}
	var lib *mappedELF
	for _, e := range elfs {
		if strings.HasPrefix(path.Base(e.mapping.Path), "libtorch_npu.so") {
			lib = e
			break
		}
	}
	if lib == nil {
		return unavailable("no libtorch_npu.so is mapped")
	}
	f, err := openMappedFile(pid, lib.mapping)
	if err != nil {
		return unavailable(fmt.Sprintf("cannot open %s: %v", lib.mapping.Path, err))
	}
	defer f.Close()
	var want []string
	for _, p := range torchProbes {
		want = append(want, p.names...)
	}
	funcs, src, tried, err := resolveHidden(pid, f, lib.mapping.Path, want, opts.DebugDirs)
	if err != nil {
		return unavailable(fmt.Sprintf("%s: %v", lib.mapping.Path, err))
	}
	type chosen struct {
		p  torchProbe
		fn hiddenFunc
	}
	var plan []chosen
	for _, p := range torchProbes {
		var fn *hiddenFunc
		for _, n := range p.names {
			if h, ok := funcs[n]; ok {
				fn = &h
				break
			}
		}
		switch {
		case fn == nil && p.required:
			why := fmt.Sprintf("%s has no symbol for %s (it is stripped, and no debug file was found", lib.mapping.Path, p.what)
			if len(tried) > 0 {
				why += "; looked at " + strings.Join(tried, ", ")
			}
			return unavailable(why + ")")
		case fn == nil:
			target.Missing = append(target.Missing, p.what)
		case p.ret != "" && fn.returns.err != nil && p.required:
			return unavailable(fmt.Sprintf("cannot find where %s in %s returns: %v", p.what, lib.mapping.Path, fn.returns.err))
		case p.ret != "" && fn.returns.err != nil:
			target.Missing = append(target.Missing, p.what)
		default:
			if p.ret != "" && fn.returns.tailCalls > 0 {
				target.Warnings = append(target.Warnings, fmt.Sprintf(
					"%s leaves through %d tail calls; allocations returned that way are not seen", p.what, fn.returns.tailCalls))
			}
			plan = append(plan, chosen{p, *fn})
		}
	}
	for _, c := range plan {
		// Return sites first, for the same reason as return probes first.
		if c.p.ret != "" {
			for _, site := range c.fn.returns.offsets {
				if err := t.attachAt(f, c.p.what, c.fn.offset+site, pid, c.p.ret, ""); err != nil {
					return err
				}
			}
		}
		if err := t.attachAt(f, c.p.what, c.fn.offset, pid, c.p.entry, ""); err != nil {
			return err
		}
		target.Attached[c.p.what] = lib.mapping.Path
	}
	target.Level = allocmodel.LevelTensor
	target.TorchSymbols = src.String()
	return nil
}

const symbolsFix = "tensor level needs torch_npu's hidden symbols: use an unstripped libtorch_npu.so, or install its debug file " +
	"(torch_npu's build keeps it in build/dbg/) under /usr/lib/debug or pass --debug-dir DIR"

// attachAt attaches entry and return programs at a file offset of file.
func (t *Tracer) attachAt(file *os.File, symbol string, offset uint64, pid int, entry, ret string) error {
	// The uprobe API takes a path; /proc/self/fd/N names exactly the file
	// opened (and verified) by the caller, whatever mount namespace the
	// target lives in.
	exe, err := link.OpenExecutable(fmt.Sprintf("/proc/self/fd/%d", file.Fd()))
	if err != nil {
		return fmt.Errorf("open %s: %w", file.Name(), err)
	}
	opts := &link.UprobeOptions{Address: offset, PID: pid}
	// Return probe first: a call entering between the two attaches is then
	// seen returning without an entry (counted), instead of leaving an entry
	// that never returns.
	if ret != "" {
		if err := t.attachOne(exe, symbol, ret, opts, true); err != nil {
			return err
		}
	}
	if entry != "" {
		if err := t.attachOne(exe, symbol, entry, opts, false); err != nil {
			return err
		}
	}
	return nil
}

func (t *Tracer) attachOne(exe *link.Executable, symbol, prog string, opts *link.UprobeOptions, ret bool) error {
	var l link.Link
	var err error
	if ret {
		l, err = exe.Uretprobe(symbol, t.coll.Programs[prog], opts)
	} else {
		l, err = exe.Uprobe(symbol, t.coll.Programs[prog], opts)
	}
	if err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
			return privilegeError(err)
		}
		if errors.Is(err, os.ErrNotExist) {
			return &Error{Kind: ErrKernelFeature, What: "cannot attach uprobe to " + symbol, Err: err,
				Fix: "npuprobe needs a kernel with CONFIG_UPROBE_EVENTS"}
		}
		return fmt.Errorf("attach to %s: %w", symbol, err)
	}
	t.links = append(t.links, l)
	return nil
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
		t.seqSeen = append(t.seqSeen, false)
	}
	if seq > t.nextSeq[cpu] {
		t.gapped += seq - t.nextSeq[cpu]
	}
	t.nextSeq[cpu] = seq + 1
	t.seqSeen[cpu] = true
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
	l.SequenceGaps = t.gapped
	l.BadRecords = t.badRecs
	return l, nil
}
