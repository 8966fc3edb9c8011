package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/clock"
	"github.com/npuprobe/npuprobe/output"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// How often the calibration of CLOCK_MONOTONIC against CLOCK_REALTIME is
// refreshed between snapshots (every snapshot recalibrates too).
const calibrationInterval = time.Minute

// pollInterval bounds how long the event loop waits for a record before it
// looks at requests (signals, exits, status).
const pollInterval = 100 * time.Millisecond

// oomSettle is how long after an OOM its snapshot waits: torch_npu asks for
// the device's free memory right after the failure, and the oom entry
// should carry that figure. The snapshot waits for that query's record
// (the failing thread may be descheduled before it makes the call, for
// longer than oomSettle on a loaded machine), at most oomSettleMax of wall
// time; after that the entry carries the model's estimate (counted in
// oom_device_free_inferred).
const (
	oomSettle    = 2 * time.Millisecond
	oomSettleMax = 250 * time.Millisecond
)

// request asks the event loop to write snapshots once every event up to
// a moment has been applied.
type request struct {
	reason string // "signal", "exit", "final", "oom"
	at     int64  // CLOCK_MONOTONIC when asked: events up to here are included
	stop   bool   // stop tracing after writing
	// only, if set, limits the request to one process.
	only *traced
	// exit: only has exited; forget it after writing.
	exit bool
	// pid, if set, limits the request to that process (control API).
	pid int
	// reply, if set, receives the written paths (control API).
	reply chan<- dumpReply
	// settleBy, for an OOM, is the wall-clock time after which the snapshot
	// is written even if the oom entry still waits for its free bytes.
	settleBy time.Time
}

// ready reports whether r may be served: an OOM's snapshot waits until the
// oom entry has its free-bytes figure, or until settleBy.
func (r *request) ready() bool {
	return r.reason != "oom" || !r.only.model.OOMPending() || time.Now().After(r.settleBy)
}

// sessionOptions are the command-line choices a session runs with.
type sessionOptions struct {
	maxEntries int
	attach     agent.AttachOptions
	// wait: a process without the runtime is watched until it loads it.
	wait bool
	// all: trace every process that maps the runtime, now or later.
	all bool
	// dumpOnOOM: write a snapshot the moment an allocation fails for lack
	// of device memory.
	dumpOnOOM bool
	// device, if ≥ 0, is the device of threads npuprobe never saw choose one.
	device int
	// finalName, if set, names the single final snapshot (the demo's
	// --out), which replaces an existing file of that name.
	finalName string
}

// session runs the event loop: ring buffer → model → snapshots. All model
// access happens on the loop's goroutine, so the model needs no locks.
type session struct {
	opts      sessionOptions
	tracer    *agent.Tracer
	tracker   *clock.Tracker
	conv      *clock.Converter
	clk       clock.Source
	stopSteps func()
	dir       *output.Dir
	host      string
	procs     map[uint32]*traced
	watching  map[uint32]*watched
	requests  chan request
	status    *statusLine
	log       io.Writer

	// exec'd processes to look at again (--all), and when.
	execChecks []execCheck
	// Ring-buffer losses already resynced from the kernel's live map.
	lossSynced uint64
	// Records from processes npuprobe does not trace: BPF filters them,
	// so this stays 0 (checked by a test).
	foreign uint64
	metrics *metrics
}

func newSession(tracer *agent.Tracer, dir *output.Dir, opts sessionOptions, log io.Writer) *session {
	// In a pod the host name is the pod's; the DaemonSet passes the
	// node's name (downward API) so snapshot names say which machine.
	host := os.Getenv("NODE_NAME")
	if host == "" {
		host, _ = os.Hostname()
	}
	clk := clock.System{}
	tracker := clock.NewTracker(clk, clock.DefaultPairs)
	// A wall-clock step (settimeofday, an NTP step) is noticed the moment it
	// happens, so events before it keep the old offset.
	stopSteps := func() {}
	if det, err := clock.NewStepDetector(); err != nil {
		fmt.Fprintf(log, "npuprobe: cannot watch for wall-clock steps (%v); a step will be seen at the next calibration\n", err)
	} else {
		stopSteps = tracker.WatchSteps(det)
	}
	return &session{
		opts:      opts,
		tracer:    tracer,
		tracker:   tracker,
		conv:      tracker.Converter(),
		clk:       clk,
		stopSteps: stopSteps,
		dir:       dir,
		host:      host,
		procs:     make(map[uint32]*traced),
		watching:  make(map[uint32]*watched),
		requests:  make(chan request, 16),
		log:       log,
		metrics:   newMetrics(),
	}
}

// run is the event loop. It returns when nothing is left to trace or wait
// for, or a stopping request was served.
//
// Requests (signals, exits, OOMs) are served in order once every event
// recorded before them has been applied: when the ring buffer is drained,
// or when an event stamped after the request arrives, whichever comes
// first, so a busy process cannot postpone a snapshot indefinitely.
func (s *session) run() error {
	defer s.stopSteps()
	defer s.continueStopped()
	var ev allocmodel.Event
	var pending []request
	lastCal := time.Now()
	lastCollect := time.Now()
	applied := 0
	for {
		deadline := time.Now().Add(pollInterval)
		switch {
		case len(pending) > 0 && !pending[0].ready():
			deadline = time.Now().Add(time.Millisecond) // an OOM waits for its free bytes
		case len(pending) > 0:
			deadline = time.Now() // only drain what is already buffered
		}
		s.tracer.SetDeadline(deadline)
		err := s.tracer.Read(&ev)
		switch {
		case err == nil:
			for len(pending) > 0 && ev.MonoNs > pending[0].at && pending[0].ready() {
				if s.serve(&pending[0]) {
					return nil
				}
				pending = pending[1:]
			}
			pending = s.apply(&ev, pending)
			applied++
			if applied%1024 == 0 && time.Since(lastCollect) > pollInterval {
				// Under sustained load the ring buffer never drains:
				// requests, exits and metrics are looked at here too.
				pending = s.collect(pending)
				s.publish()
				lastCollect = time.Now()
			}
			continue
		case errors.Is(err, os.ErrDeadlineExceeded):
		default:
			return fmt.Errorf("read ring buffer: %w", err)
		}

		// The ring buffer is drained up to now: the model is as current as
		// the kernel, the moment to resync after losses and to serve
		// everything asked.
		s.resyncIfLost()
		for len(pending) > 0 && pending[0].ready() {
			if s.serve(&pending[0]) {
				return nil
			}
			pending = pending[1:]
		}
		pending = s.collect(pending)
		lastCollect = time.Now()
		if len(pending) > 0 {
			continue
		}
		s.pollWatched()
		s.runExecChecks()
		if len(s.procs) == 0 && len(s.watching) == 0 && !s.opts.all {
			s.status.clear()
			return nil
		}
		if time.Since(lastCal) > calibrationInterval {
			s.tracker.Recalibrate()
			lastCal = time.Now()
		}
		s.publish()
		s.status.maybePrint(s.statusText)
	}
}

// apply hands one event to its process's model, or to the machinery that
// starts tracing processes.
func (s *session) apply(ev *allocmodel.Event, pending []request) []request {
	switch ev.Call {
	case allocmodel.CallDlopen:
		s.onLibraryLoaded(int(ev.Tgid), ev.Stopped)
		return pending
	case allocmodel.CallExec:
		s.onExec(int(ev.Tgid))
		return pending
	}
	p := s.procs[ev.Tgid]
	if p == nil && s.opts.all {
		p = s.adopt(int(ev.Tgid))
	}
	if p == nil {
		s.foreign++
		return pending
	}
	ooms := p.model.Counters().OOMs
	p.model.Apply(ev)
	if s.opts.dumpOnOOM && p.model.Counters().OOMs > ooms {
		pending = append(pending, request{reason: "oom", only: p, at: ev.MonoNs + int64(oomSettle), settleBy: time.Now().Add(oomSettleMax)})
	}
	return pending
}

// collect turns signals and process exits into requests stamped now.
func (s *session) collect(pending []request) []request {
	for {
		select {
		case r := <-s.requests:
			pending = append(pending, r)
			continue
		default:
		}
		break
	}
	for pid, w := range s.watching {
		select {
		case <-w.exited:
			fmt.Fprintf(s.log, "npuprobe: process %d exited without loading the CANN runtime\n", pid)
			s.tracer.Forget(int(pid))
			delete(s.watching, pid)
		default:
		}
	}
	for _, p := range s.procs {
		if p.exiting {
			continue
		}
		select {
		case <-p.exited:
			// Its last events are in the ring buffer before this moment.
			p.exiting = true
			pending = append(pending, request{reason: "exit", at: s.clk.Monotonic(), only: p, exit: true})
		default:
		}
	}
	return pending
}

// serve writes the requested snapshots; it reports whether to stop.
func (s *session) serve(r *request) bool {
	var paths []string
	if r.only != nil {
		if s.procs[uint32(r.only.target.PID)] == r.only {
			for _, path := range s.writeSnapshot(r.only, r.reason) {
				switch r.reason {
				case "exit":
					fmt.Fprintf(s.log, "npuprobe: process %d exited; wrote %s\n", r.only.target.PID, path)
				case "oom":
					fmt.Fprintf(s.log, "npuprobe: process %d ran out of device memory; wrote %s\n", r.only.target.PID, path)
				default:
					fmt.Fprintf(s.log, "npuprobe: wrote %s\n", path)
				}
				paths = append(paths, path)
			}
		}
		if r.exit {
			s.tracer.Forget(r.only.target.PID)
			delete(s.procs, uint32(r.only.target.PID))
		}
	} else {
		var which []*traced
		if r.pid != 0 {
			if p := s.procs[uint32(r.pid)]; p != nil {
				which = append(which, p)
			} else if r.reply != nil {
				r.reply <- dumpReply{Error: fmt.Sprintf("process %d is not traced", r.pid)}
				return r.stop
			}
		} else {
			for _, p := range s.procs {
				which = append(which, p)
			}
		}
		for _, p := range which {
			for _, path := range s.writeSnapshot(p, r.reason) {
				fmt.Fprintf(s.log, "npuprobe: wrote %s\n", path)
				paths = append(paths, path)
			}
		}
	}
	s.publish()
	if r.reply != nil {
		r.reply <- dumpReply{Paths: paths}
	}
	return r.stop
}

// resyncIfLost rebuilds every traced process's segments and blocks from
// the kernel's live map when the ring buffer lost records since the last
// resync: trace entries are lost, the state need not be.
func (s *session) resyncIfLost() {
	loss, err := s.tracer.Loss()
	if err != nil || loss.RingBufferFull == s.lossSynced {
		return
	}
	for pid, p := range s.procs {
		live, err := s.tracer.Live(int(pid))
		if err != nil {
			fmt.Fprintf(s.log, "npuprobe: process %d: %v; its state may be off until the next resync\n", pid, err)
			continue
		}
		p.model.Resync(live)
	}
	s.lossSynced = loss.RingBufferFull
}
