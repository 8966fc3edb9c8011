package agent

import (
	"errors"
	"fmt"
	"path"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/npuprobe/npuprobe/bpf"
)

// Watching for a library that is not loaded yet. A process started a
// moment ago (python train.py) maps the CANN runtime and torch_npu only when
// it imports torch_npu, through dlopen. npuprobe probes dlopen in the
// process's C library; when a dlopen of the runtime or torch_npu returns,
// the BPF program stops the process (SIGSTOP, with Options.StopOnLoad) and
// tells the agent, which attaches and continues it (Continue): no call from
// the library's first one is missed. Calls made by the libraries' own
// initialisers during that dlopen are not seen.

// Watch makes npuprobe notice when pid dlopen()s the runtime or torch_npu:
// it attaches the dlopen probes in pid's C library, limited to pid (or, for
// a tracer with TraceAll, in every process using that library), and adds
// pid to the watch list.
func (t *Tracer) Watch(pid int) error {
	if _, err := checkProcess(pid); err != nil {
		return err
	}
	if err := t.attachDlopen(pid); err != nil {
		return err
	}
	if t.opts.TraceAll {
		return nil // with cfg_trace_all, every process is watched
	}
	tgid, one := uint32(pid), uint32(1)
	if err := t.coll.Maps[bpf.NpuprobeMapWatchedTgids].Update(&tgid, &one, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("watch process %d: %w", pid, err)
	}
	return nil
}

// Unwatch removes pid from the watch list (its runtime is attached).
func (t *Tracer) Unwatch(pid int) {
	tgid := uint32(pid)
	t.coll.Maps[bpf.NpuprobeMapWatchedTgids].Delete(&tgid)
}

// attachDlopen finds dlopen where pid binds it: libc.so.6 since glibc 2.34,
// libdl.so.2 before (where libc's own dlopen is internal).
func (t *Tracer) attachDlopen(pid int) error {
	elfs, err := targetELFs(pid)
	if err != nil {
		return mapsError(pid, err)
	}
	var libc, libdl *mappedELF
	for _, e := range elfs {
		base := path.Base(e.mapping.Path)
		switch {
		case strings.HasPrefix(base, "libc.so"), strings.HasPrefix(base, "libc-"):
			libc = e
		case strings.HasPrefix(base, "libdl.so"), strings.HasPrefix(base, "libdl-"):
			libdl = e
		}
	}
	filterPID := pid
	if t.opts.TraceAll {
		filterPID = 0
	}
	for _, e := range []*mappedELF{libc, libdl} {
		if e == nil {
			continue
		}
		if err := e.load(pid); err != nil {
			continue
		}
		defer e.close()
		v, ok := e.syms.defined["dlopen"]
		if !ok {
			continue
		}
		off, err := fileOffset(e.syms.progs, v)
		if err != nil {
			continue
		}
		a := &attachment{t: t, pid: pid}
		if err := a.at(e.file, e.mapping, "dlopen", off, filterPID, bpf.NpuprobeProgUretprobeDlopen, true); err != nil {
			return err
		}
		if err := a.at(e.file, e.mapping, "dlopen", off, filterPID, bpf.NpuprobeProgUprobeDlopen, false); err != nil {
			a.undo()
			return err
		}
		return nil
	}
	return &Error{Kind: ErrNoRuntime, What: fmt.Sprintf("process %d maps no C library defining dlopen", pid),
		Fix: "npuprobe can wait only for processes that load the runtime with dlopen; attach once it is loaded"}
}

// Continue resumes a process the BPF program stopped at a runtime dlopen.
// It is safe to call for a process that is not stopped.
func Continue(pid int) error {
	if err := unix.Kill(pid, unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("continue process %d: %w", pid, err)
	}
	return nil
}
