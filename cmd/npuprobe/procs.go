package main

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
)

// traced is one process being traced and its rebuilt allocator.
type traced struct {
	target  *agent.Target
	model   *allocmodel.Model
	conf    allocmodel.AllocConf
	env     map[string]string
	exited  <-chan struct{}
	exiting bool // its exit snapshot is requested
}

// watched is a process waiting to load the CANN runtime (--wait, --all).
type watched struct {
	exited    <-chan struct{}
	lastCheck time.Time
}

// execCheck is a look at an exec'd process's libraries, due at a time.
type execCheck struct {
	pid int
	due time.Time
}

// add starts tracing pid, limited to that process. With opts.wait, a
// process that has not loaded the runtime yet is watched instead.
func (s *session) add(pid int) (*traced, error) {
	exited, err := agent.WatchExit(pid)
	if err != nil {
		return nil, err
	}
	target, err := s.tracer.Attach(pid, s.opts.attach)
	if errors.Is(err, agent.ErrNoRuntime) && s.opts.wait {
		if err := s.tracer.Watch(pid); err != nil {
			return nil, err
		}
		s.watching[uint32(pid)] = &watched{exited: exited, lastCheck: time.Now()}
		fmt.Fprintf(s.log, "npuprobe: process %d has not loaded the CANN runtime yet; waiting for it to dlopen it\n", pid)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return s.track(pid, target, exited), nil
}

// track creates the model of a process whose probes are attached.
func (s *session) track(pid int, target *agent.Target, exited <-chan struct{}) *traced {
	// The allocator configuration decides block sizes and splits.
	conf := allocmodel.DefaultAllocConf()
	env, err := agent.ReadEnviron(pid)
	if err != nil {
		fmt.Fprintf(s.log, "npuprobe: cannot read the environment of process %d (%v); assuming torch_npu's default allocator configuration\n", pid, err)
	} else if conf, err = allocmodel.AllocConfFromEnv(env); err != nil {
		fmt.Fprintf(s.log, "npuprobe: process %d: %v; assuming torch_npu's default allocator configuration\n", pid, err)
	}
	p := &traced{
		target: target,
		model: allocmodel.New(allocmodel.Config{
			Level:         target.Level,
			MaxEntries:    s.opts.maxEntries,
			Alloc:         conf,
			DefaultDevice: s.opts.defaultDevice(env),
		}),
		conf:   conf,
		env:    env,
		exited: exited,
	}
	s.procs[uint32(pid)] = p
	return p
}

// adopt starts tracing a process that reached a probe under --all.
func (s *session) adopt(pid int) *traced {
	exited, err := agent.WatchExit(pid)
	if err != nil {
		return nil // gone already: its records are dropped, as they would be unused
	}
	target, err := s.tracer.AttachSystemWide(pid, s.opts.attach)
	if err != nil {
		fmt.Fprintf(s.log, "npuprobe: process %d: %v\n", pid, err)
		return nil
	}
	p := s.track(pid, target, exited)
	fmt.Fprintf(s.log, "npuprobe: tracing process %d (%s) at %s level\n", pid, target.Name, target.Level)
	return p
}

// onLibraryLoaded handles a dlopen of the runtime or torch_npu by a
// watched process: attach, then let the process run on if BPF stopped it.
func (s *session) onLibraryLoaded(pid int, stopped bool) {
	defer func() {
		if stopped {
			if err := agent.Continue(pid); err != nil {
				fmt.Fprintf(s.log, "npuprobe: %v\n", err)
			}
		}
	}()
	if s.opts.all {
		// New library files get their probes, system-wide; the process
		// itself is adopted at its first probed call.
		if _, err := s.tracer.AttachSystemWide(pid, s.opts.attach); err != nil && !errors.Is(err, agent.ErrNoRuntime) {
			fmt.Fprintf(s.log, "npuprobe: process %d: %v\n", pid, err)
		}
		return
	}
	w := s.watching[uint32(pid)]
	if w == nil {
		if p := s.procs[uint32(pid)]; p != nil && p.target.Level == allocmodel.LevelSegment && s.opts.attach.Level != agent.LevelSegment {
			// torch_npu loaded after the runtime: attach its probes now.
			if t, err := s.tracer.Attach(pid, s.opts.attach); err == nil && t.Level == allocmodel.LevelTensor {
				fmt.Fprintf(s.log, "npuprobe: process %d loaded torch_npu; tensor level from now on\n", pid)
				p.target = t
				p.model.SetLevel(allocmodel.LevelTensor)
			}
		}
		return
	}
	s.tryAttachWatched(pid, w)
}

// tryAttachWatched attaches a watched process if it now maps the runtime.
func (s *session) tryAttachWatched(pid int, w *watched) {
	w.lastCheck = time.Now()
	target, err := s.tracer.Attach(pid, s.opts.attach)
	if errors.Is(err, agent.ErrNoRuntime) {
		return
	}
	delete(s.watching, uint32(pid))
	if err != nil {
		fmt.Fprintf(s.log, "npuprobe: process %d loaded the CANN runtime but cannot be traced: %v\n", pid, err)
		return
	}
	if target.Level != allocmodel.LevelTensor || s.opts.attach.Level == agent.LevelSegment {
		// Keep watching dlopen for torch_npu, which may come later.
	} else {
		s.tracer.Unwatch(pid)
	}
	s.track(pid, target, w.exited)
	reportAttach(s.log, target)
}

// pollWatched looks at watched processes once a second, in case a library
// was loaded without dlopen (or its probe was missed).
func (s *session) pollWatched() {
	for pid, w := range s.watching {
		if time.Since(w.lastCheck) > time.Second {
			s.tryAttachWatched(int(pid), w)
		}
	}
}

// onExec schedules looks at a process that replaced its image (--all): the
// dynamic linker maps its libraries within milliseconds.
func (s *session) onExec(pid int) {
	now := time.Now()
	for _, d := range []time.Duration{20 * time.Millisecond, 300 * time.Millisecond, 3 * time.Second} {
		s.execChecks = append(s.execChecks, execCheck{pid: pid, due: now.Add(d)})
	}
}

func (s *session) runExecChecks() {
	now := time.Now()
	keep := s.execChecks[:0]
	for _, c := range s.execChecks {
		if now.Before(c.due) {
			keep = append(keep, c)
			continue
		}
		s.lookAtProcess(c.pid)
	}
	s.execChecks = keep
}

// lookAtProcess attaches (system-wide) the runtime probes and the dlopen
// watch for the library files pid maps, for --all.
func (s *session) lookAtProcess(pid int) {
	if err := s.tracer.Watch(pid); err != nil && !errors.Is(err, agent.ErrNoRuntime) && !errors.Is(err, agent.ErrNoProcess) {
		fmt.Fprintf(s.log, "npuprobe: process %d: %v\n", pid, err)
	}
	if _, err := s.tracer.AttachSystemWide(pid, s.opts.attach); err != nil &&
		!errors.Is(err, agent.ErrNoRuntime) && !errors.Is(err, agent.ErrNoProcess) {
		fmt.Fprintf(s.log, "npuprobe: process %d: %v\n", pid, err)
	}
}

// startAll looks at every process on the host (--all).
func (s *session) startAll() error {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		s.lookAtProcess(pid)
	}
	return nil
}

// continueStopped makes sure no process stays stopped because of npuprobe,
// whatever way the session ends: records still in the ring buffer may
// announce a process BPF stopped at a dlopen.
func (s *session) continueStopped() {
	var ev allocmodel.Event
	s.tracer.SetDeadline(time.Now())
	for s.tracer.Read(&ev) == nil {
		if ev.Call == allocmodel.CallDlopen && ev.Stopped {
			agent.Continue(int(ev.Tgid))
		}
	}
}

// defaultDevice is the device of threads whose device npuprobe never saw:
// --device if given, else the process's LOCAL_RANK (torchrun gives each
// process one device and sets LOCAL_RANK to it), else 0.
func (o sessionOptions) defaultDevice(env map[string]string) int {
	if o.device >= 0 {
		return o.device
	}
	if v, err := strconv.Atoi(env["LOCAL_RANK"]); err == nil && v >= 0 && v < allocmodel.MaxDevices {
		return v
	}
	return 0
}
