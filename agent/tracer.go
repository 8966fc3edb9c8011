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
	// Attached lists each probed symbol with the file (as the target
	// sees it) it was attached in.
	Attached map[string]string
	// Missing lists optional symbols no mapped file defines.
	Missing []string
	// AlsoDefined lists, per symbol, other files defining it that were
	// deliberately not attached.
	AlsoDefined map[string][]string
}

// Attach starts tracing pid: it adds the process to the BPF filter and
// attaches the runtime probes where the process binds them.
func (t *Tracer) Attach(pid int) (*Target, error) {
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

	target := &Target{PID: pid, Name: st.Name, Attached: make(map[string]string), AlsoDefined: make(map[string][]string)}
	for _, p := range runtimeProbes {
		site := sites[p.symbol]
		if site == nil {
			target.Missing = append(target.Missing, p.symbol)
			continue
		}
		// The uprobe API takes a path; /proc/self/fd/N names exactly the
		// file opened (and verified) above, whatever mount namespace the
		// target lives in.
		exe, err := link.OpenExecutable(fmt.Sprintf("/proc/self/fd/%d", site.elf.file.Fd()))
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", site.elf.mapping.Path, err)
		}
		opts := &link.UprobeOptions{Address: site.offset, PID: pid}
		// Return probe first: a call entering between the two attaches is
		// then seen returning without an entry (counted), instead of leaving
		// an entry that never returns.
		if p.ret != "" {
			if err := t.attachOne(exe, p.symbol, p.ret, opts, true); err != nil {
				return nil, err
			}
		}
		if p.entry != "" {
			if err := t.attachOne(exe, p.symbol, p.entry, opts, false); err != nil {
				return nil, err
			}
		}
		target.Attached[p.symbol] = site.elf.mapping.Path
		if len(site.others) > 0 {
			target.AlsoDefined[p.symbol] = site.others
		}
	}
	return target, nil
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
