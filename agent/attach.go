package agent

import (
	"errors"
	"fmt"
	"os"
	"path"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/bpf"
)

// attachKey identifies one attached probe. pid is 0 for a probe that fires
// in every process mapping the file (--all), else the process it is limited
// to.
type attachKey struct {
	dev, ino uint64
	offset   uint64
	prog     string
	ret      bool
	pid      int
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

// attachment collects what one Attach call attached, to undo it on failure.
type attachment struct {
	t    *Tracer
	pid  int // the process whose mappings are being attached
	keys []attachKey
}

func (a *attachment) undo() {
	for _, k := range a.keys {
		if l := a.t.links[k]; l != nil {
			l.Close()
			delete(a.t.links, k)
		}
	}
}

// Attach starts tracing pid: it adds the process to the BPF filter and
// attaches the runtime probes where the process binds them, limited to this
// process, then, as the options ask, torch_npu's caching-allocator probes.
// On failure nothing stays attached.
func (t *Tracer) Attach(pid int, opts AttachOptions) (*Target, error) {
	return t.attach(pid, opts, pid)
}

// AttachSystemWide attaches the probes for the libraries pid maps, firing
// in every process that maps the same files (--all). Files already probed
// are skipped. A process without the runtime gets ErrNoRuntime.
func (t *Tracer) AttachSystemWide(pid int, opts AttachOptions) (*Target, error) {
	return t.attach(pid, opts, 0)
}

func (t *Tracer) attach(pid int, opts AttachOptions, filterPID int) (target *Target, err error) {
	st, err := checkProcess(pid)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(runtimeProbes))
	for i, p := range runtimeProbes {
		names[i] = p.symbol
	}
	// LD_PRELOADed libraries come first in the global scope, and torch_npu
	// (since 2026-04) binds through it when LD_PRELOAD is set.
	var preload []string
	if env, err := ReadEnviron(pid); err == nil {
		preload = strings.FieldsFunc(env["LD_PRELOAD"], func(r rune) bool { return r == ' ' || r == ':' })
	}
	sites, files, err := resolveSymbols(pid, names, requiredSymbols[0], preload)
	if err != nil {
		return nil, mapsError(pid, err)
	}
	defer closeELFs(files)
	for _, req := range requiredSymbols {
		if sites[req] == nil {
			return nil, &Error{Kind: ErrNoRuntime,
				What: fmt.Sprintf("process %d (%s) has no CANN runtime mapped: no mapped library defines %s", pid, st.Name, req),
				Fix: "check the PID is the training process and that it has imported torch_npu (libascendcl.so or libacl_rt.so must appear in /proc/" +
					fmt.Sprint(pid) + "/maps), or pass --wait to attach when it loads the runtime"}
		}
	}

	a := &attachment{t: t, pid: pid}
	defer func() {
		if err != nil {
			a.undo()
		}
	}()
	if filterPID != 0 {
		tgid, one := uint32(pid), uint32(1)
		if err := t.coll.Maps[bpf.NpuprobeMapTracedTgids].Update(&tgid, &one, ebpf.UpdateAny); err != nil {
			return nil, fmt.Errorf("add process %d to the BPF filter: %w", pid, err)
		}
		defer func() {
			if err != nil {
				t.coll.Maps[bpf.NpuprobeMapTracedTgids].Delete(&tgid)
			}
		}()
	}

	target = &Target{PID: pid, Name: st.Name, Level: allocmodel.LevelSegment,
		Attached: make(map[string]string), AlsoDefined: make(map[string][]string)}
	for _, p := range runtimeProbes {
		site := sites[p.symbol]
		if site == nil {
			target.Missing = append(target.Missing, p.symbol)
			continue
		}
		// Return probe first: a call entering between the two attaches is
		// then seen returning without an entry (counted), instead of
		// leaving an entry that never returns.
		if err := a.at(site.elf.file, site.elf.mapping, p.symbol, site.offset, filterPID, p.ret, true); err != nil {
			return nil, err
		}
		if err := a.at(site.elf.file, site.elf.mapping, p.symbol, site.offset, filterPID, p.entry, false); err != nil {
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
	if err := a.torch(pid, filterPID, target, opts); err != nil {
		return nil, err
	}
	return target, nil
}

func mapsError(pid int, err error) error {
	if errors.Is(err, os.ErrPermission) {
		return &Error{Kind: ErrPrivilege, What: fmt.Sprintf("cannot read the memory map of process %d", pid), Err: err,
			Fix: "run as root or grant CAP_SYS_PTRACE"}
	}
	if errors.Is(err, os.ErrNotExist) {
		return noProcessError(pid)
	}
	return fmt.Errorf("read mappings of process %d: %w", pid, err)
}

// torch attaches the caching-allocator probes in libtorch_npu.so when its
// hidden symbols can be resolved. At LevelAuto an unresolvable library
// leaves the target at segment level with TensorUnavailable saying why.
func (a *attachment) torch(pid, filterPID int, target *Target, opts AttachOptions) error {
	unavailable := func(why string) error {
		if opts.Level == LevelTensor {
			return &Error{Kind: ErrNoSymbols, What: fmt.Sprintf("tensor level unavailable for process %d: %s", pid, why), Fix: symbolsFix}
		}
		target.TensorUnavailable = fmt.Sprintf("tensor level unavailable for process %d: %s; tracing segments only (%s)", pid, why, symbolsFix)
		return nil
	}
	elfs, err := targetELFs(pid)
	if err != nil {
		return mapsError(pid, err)
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
	// Before the probes, so no runtime call made inside a torch_npu
	// allocation can miss its context (see torch_probes_attached).
	if err := a.t.coll.Variables["torch_probes_attached"].Set(uint32(1)); err != nil {
		return fmt.Errorf("enable torch_npu context: %w", err)
	}
	for _, c := range plan {
		// Return sites first, for the same reason as return probes first.
		for _, site := range c.fn.returns.offsets {
			if c.p.ret == "" {
				break
			}
			if err := a.at(f, lib.mapping, c.p.what, c.fn.offset+site, filterPID, c.p.ret, false); err != nil {
				return err
			}
		}
		if err := a.at(f, lib.mapping, c.p.what, c.fn.offset, filterPID, c.p.entry, false); err != nil {
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

// at attaches prog at a file offset of file (opened from mapping m), as a
// uretprobe if ret, once: a probe already attached there (same file,
// offset, program and process filter) is left as it is.
//
// "Same file" is the file the kernel puts the uprobe on, the real one
// under an overlay mount (realFileKey): two containers of one image see it
// through two mounts, and probing it twice would record every call twice.
func (a *attachment) at(file *os.File, m Mapping, symbol string, offset uint64, filterPID int, prog string, ret bool) error {
	if prog == "" {
		return nil
	}
	if a.t.opts.Floor {
		prog = bpf.NpuprobeProgUprobeNoop
	}
	dev, ino, err := realFileKey(a.pid, m.Path, file)
	if err != nil {
		return err
	}
	key := attachKey{dev: dev, ino: ino, offset: offset, prog: prog, ret: ret, pid: filterPID}
	if _, done := a.t.links[key]; done {
		return nil
	}
	// The uprobe API takes a path; /proc/self/fd/N names exactly the file
	// opened (and verified) by the caller, whatever mount namespace the
	// target lives in.
	exe, err := link.OpenExecutable(fmt.Sprintf("/proc/self/fd/%d", file.Fd()))
	if err != nil {
		return fmt.Errorf("open %s: %w", file.Name(), err)
	}
	opts := &link.UprobeOptions{Address: offset, PID: filterPID}
	var l link.Link
	if ret {
		l, err = exe.Uretprobe(symbol, a.t.coll.Programs[prog], opts)
	} else {
		l, err = exe.Uprobe(symbol, a.t.coll.Programs[prog], opts)
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
	a.t.links[key] = l
	a.keys = append(a.keys, key)
	return nil
}

// Forget stops tracing pid: its process-limited probes are detached, and
// it leaves the BPF filter, the watch list and the live-allocation map.
// Call it when the process has exited.
func (t *Tracer) Forget(pid int) {
	for k, l := range t.links {
		if k.pid == pid {
			l.Close()
			delete(t.links, k)
		}
	}
	tgid := uint32(pid)
	t.coll.Maps[bpf.NpuprobeMapTracedTgids].Delete(&tgid)
	t.coll.Maps[bpf.NpuprobeMapWatchedTgids].Delete(&tgid)
	t.forgetLive(tgid)
}
