package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
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

// traced is one process being traced and its rebuilt allocator.
type traced struct {
	target  *agent.Target
	model   *allocmodel.Model
	conf    allocmodel.AllocConf
	exited  <-chan struct{}
	exiting bool // its exit snapshot is requested
}

// request asks the event loop to write snapshots once every event up to
// a moment has been applied.
type request struct {
	reason string // "signal", "exit", "final", ...
	at     int64  // CLOCK_MONOTONIC when asked: events up to here are included
	stop   bool   // stop tracing after writing
	// only, if set, limits the request to one process (its exit).
	only   *traced
	result chan<- []string
}

// session runs the event loop: ring buffer → model → snapshots. All model
// access happens on the loop's goroutine, so the model needs no locks.
type session struct {
	tracer     *agent.Tracer
	tracker    *clock.Tracker
	conv       *clock.Converter
	clk        clock.Source
	stopSteps  func()
	dir        *output.Dir
	host       string
	maxEntries int
	procs      map[uint32]*traced
	requests   chan request
	status     *statusLine
	attach     agent.AttachOptions
	// finalName, if set, names the single final snapshot (the demo's
	// --out), which replaces an existing file of that name.
	finalName string
	log       io.Writer
}

func newSession(tracer *agent.Tracer, dir *output.Dir, maxEntries int, log io.Writer) *session {
	host, _ := os.Hostname()
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
		tracer:     tracer,
		tracker:    tracker,
		conv:       tracker.Converter(),
		clk:        clk,
		stopSteps:  stopSteps,
		dir:        dir,
		host:       host,
		maxEntries: maxEntries,
		procs:      make(map[uint32]*traced),
		requests:   make(chan request, 16),
		log:        log,
	}
}

// add starts tracing pid.
func (s *session) add(pid int) (*traced, error) {
	exited, err := agent.WatchExit(pid)
	if err != nil {
		return nil, err
	}
	// The allocator configuration decides block sizes and splits; read it
	// before attaching so a bad value is reported before any event.
	conf := allocmodel.DefaultAllocConf()
	if env, err := agent.ReadEnviron(pid); err != nil {
		fmt.Fprintf(s.log, "npuprobe: cannot read the environment of process %d (%v); assuming torch_npu's default allocator configuration\n", pid, err)
	} else if conf, err = allocmodel.AllocConfFromEnv(env); err != nil {
		fmt.Fprintf(s.log, "npuprobe: process %d: %v; assuming torch_npu's default allocator configuration\n", pid, err)
	}
	target, err := s.tracer.Attach(pid, s.attach)
	if err != nil {
		return nil, err
	}
	p := &traced{
		target: target,
		model: allocmodel.New(allocmodel.Config{
			Level:      target.Level,
			MaxEntries: s.maxEntries,
			Alloc:      conf,
		}),
		conf:   conf,
		exited: exited,
	}
	s.procs[uint32(pid)] = p
	return p, nil
}

// requestSnapshot asks the loop for snapshots of every traced process and
// returns the written paths once they are on disk.
func (s *session) requestSnapshot(reason string, stop bool) []string {
	res := make(chan []string, 1)
	s.requests <- request{reason: reason, at: s.clk.Monotonic(), stop: stop, result: res}
	return <-res
}

// run is the event loop. It returns when no traced process is left or a
// stopping request was served.
//
// Requests (signals, exits) are served in order once every event recorded
// before them has been applied: when the ring buffer is drained, or when an
// event stamped after the request arrives, whichever comes first, so a busy
// process cannot postpone a snapshot indefinitely.
func (s *session) run() error {
	defer s.stopSteps()
	var ev allocmodel.Event
	var pending []request
	lastCal := time.Now()
	lastCollect := time.Now()
	applied := 0
	for {
		deadline := time.Now().Add(pollInterval)
		if len(pending) > 0 {
			deadline = time.Now() // only drain what is already buffered
		}
		s.tracer.SetDeadline(deadline)
		err := s.tracer.Read(&ev)
		switch {
		case err == nil:
			for len(pending) > 0 && ev.MonoNs > pending[0].at {
				if s.serve(&pending[0]) {
					return nil
				}
				pending = pending[1:]
			}
			s.apply(&ev)
			applied++
			if applied%1024 == 0 && time.Since(lastCollect) > pollInterval {
				pending = s.collect(pending)
				lastCollect = time.Now()
			}
			continue
		case errors.Is(err, os.ErrDeadlineExceeded):
		default:
			return fmt.Errorf("read ring buffer: %w", err)
		}

		// The ring buffer is drained up to now: serve everything asked.
		for len(pending) > 0 {
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
		if len(s.procs) == 0 {
			s.status.clear()
			return nil
		}
		if time.Since(lastCal) > calibrationInterval {
			s.tracker.Recalibrate()
			lastCal = time.Now()
		}
		s.status.maybePrint(s.statusText)
	}
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
	for _, p := range s.procs {
		if p.exiting {
			continue
		}
		select {
		case <-p.exited:
			// Its last events are in the ring buffer before this moment.
			p.exiting = true
			pending = append(pending, request{reason: "exit", at: s.clk.Monotonic(), only: p})
		default:
		}
	}
	return pending
}

func (s *session) apply(ev *allocmodel.Event) {
	if p := s.procs[ev.Tgid]; p != nil {
		p.model.Apply(ev)
	}
}

// serve writes the requested snapshots; it reports whether to stop.
func (s *session) serve(r *request) bool {
	var paths []string
	if r.only != nil {
		for _, path := range s.writeSnapshot(r.only, r.reason) {
			fmt.Fprintf(s.log, "npuprobe: process %d exited; wrote %s\n", r.only.target.PID, path)
			paths = append(paths, path)
		}
		delete(s.procs, uint32(r.only.target.PID))
	} else {
		for _, p := range s.procs {
			for _, path := range s.writeSnapshot(p, r.reason) {
				fmt.Fprintf(s.log, "npuprobe: wrote %s\n", path)
				paths = append(paths, path)
			}
		}
	}
	if r.result != nil {
		r.result <- paths
	}
	return r.stop
}

// writeSnapshot writes one snapshot of p and returns its path (none if
// writing failed, which is reported).
func (s *session) writeSnapshot(p *traced, reason string) []string {
	snap := p.model.Snapshot()
	s.tracker.Recalibrate()
	for _, trace := range snap.Traces {
		s.conv.StampTrace(trace)
	}
	loss, err := s.tracer.Loss()
	if err != nil {
		fmt.Fprintf(s.log, "npuprobe: reading loss counters: %v\n", err)
	}
	settings := s.settings(p, snap, loss, reason)
	write := func(w io.Writer) error { return output.WriteSnapshot(w, snap, settings) }
	s.status.clear()
	var path string
	if s.finalName != "" && (reason == "exit" || reason == "final") {
		path, err = s.dir.ReplaceFile(s.finalName, write)
	} else {
		path, err = s.dir.WriteFile(snapshotName(s.host, p.target.PID, time.Now(), reason), write)
	}
	if err != nil {
		fmt.Fprintf(s.log, "npuprobe: snapshot of process %d not written: %v\n", p.target.PID, err)
		return nil
	}
	return []string{path}
}

func (s *session) settings(p *traced, snap *allocmodel.Snapshot, loss agent.Loss, reason string) []output.Setting {
	var overwritten uint64
	for _, n := range snap.Overwritten {
		overwritten += n
	}
	var clockSettings []output.Setting
	for _, f := range s.tracker.Metadata().Fields() {
		clockSettings = append(clockSettings, output.Setting{Key: f.Key, Value: f.Value})
	}
	st := []output.Setting{
		{Key: "npuprobe_version", Value: version},
		{Key: "npuprobe_level", Value: snap.Level.String()},
	}
	if snap.Level == allocmodel.LevelSegment {
		note := "segment level: only CANN runtime calls were observed; " +
			"segments and their trace entries are exact, a segment's interior is not, so each segment is shown as one inactive block of its full size"
		if p.target.TensorUnavailable != "" {
			note += "; " + p.target.TensorUnavailable
		}
		st = append(st, output.Setting{Key: "npuprobe_level_note", Value: note})
	} else {
		st = append(st,
			output.Setting{Key: "npuprobe_level_note", Value: "tensor level: torch_npu's caching allocator was observed (allocate, local_raw_delete, raw_alloc/raw_delete); " +
				"block boundaries follow its round_size/should_split/merge rules with the process's own configuration, checked against every returned pointer; " +
				"frees deferred by stream events are not observed (free_requested and free_completed are recorded together)"},
			output.Setting{Key: "npuprobe_symbols", Value: p.target.TorchSymbols},
			output.Setting{Key: "npuprobe_alloc_conf", Value: []output.Setting{
				{Key: "source", Value: p.conf.Source},
				{Key: "value", Value: p.conf.Raw},
			}},
		)
	}
	st = append(st,
		output.Setting{Key: "npuprobe_host", Value: s.host},
		output.Setting{Key: "npuprobe_pid", Value: p.target.PID},
		output.Setting{Key: "npuprobe_process", Value: p.target.Name},
		output.Setting{Key: "npuprobe_reason", Value: reason},
		output.Setting{Key: "npuprobe_stream_note", Value: "stream is 0: runtime calls carry no stream"},
		output.Setting{Key: "npuprobe_device_note", Value: "device is the calling thread's, from aclrtSetDevice/aclrtGetDevice seen after attach; threads never seen setting one count as device 0"},
	)
	if snap.MaxEntries > 0 {
		st = append(st, output.Setting{Key: "trace_alloc_max_entries", Value: snap.MaxEntries})
	}
	st = append(st,
		output.Setting{Key: "trace_alloc_overflowed", Value: overwritten > 0},
		output.Setting{Key: "npuprobe_entries_overwritten", Value: overwritten},
		output.Setting{Key: "npuprobe_dropped_events", Value: loss.RingBufferFull},
		output.Setting{Key: "npuprobe_loss", Value: []output.Setting{
			{Key: "ring_buffer_full", Value: loss.RingBufferFull},
			{Key: "sequence_gaps", Value: loss.SequenceGaps},
			{Key: "returns_without_entry", Value: loss.UnpairedReturns},
			{Key: "entries_not_stored", Value: loss.PendingFull},
			{Key: "outputs_unreadable", Value: loss.ReadFailed},
			{Key: "records_undecodable", Value: loss.BadRecords},
		}},
		output.Setting{Key: "npuprobe_model", Value: []output.Setting{
			{Key: "events", Value: snap.Counters.Events},
			{Key: "segment_frees_size_unknown", Value: snap.Counters.SegmentFreesUnknown},
			{Key: "frees_of_null", Value: snap.Counters.FreesOfNull},
			{Key: "allocations_over_live_segment", Value: snap.Counters.AllocsOverLive},
			{Key: "failed_calls", Value: snap.Counters.FailedCalls},
			{Key: "ooms", Value: snap.Counters.OOMs},
			{Key: "oom_device_free_inferred", Value: snap.Counters.OOMFreeInferred},
			{Key: "tensor_frees_before_attach", Value: snap.Counters.FreesOfUnknownBlocks},
			{Key: "tensor_allocs_in_unknown_segments", Value: snap.Counters.AllocsUnplaceable},
			{Key: "allocations_over_live_block", Value: snap.Counters.AllocsOverLiveBlock},
			{Key: "out_of_order_splits", Value: snap.Counters.OutOfOrderSplits},
			{Key: "block_splits_repaired", Value: snap.Counters.BlockSplitsRepaired},
			{Key: "segments_freed_with_live_blocks", Value: snap.Counters.SegmentsFreedWithLiveBlocks},
			{Key: "runtime_allocations_outside_allocator", Value: snap.Counters.RuntimeAllocsOutside},
		}},
		output.Setting{Key: "npuprobe_clock", Value: clockSettings},
	)
	return st
}

// snapshotName builds a file name from the host name, the PID, the time and
// the reason. The host name comes from uname, which a container can set to
// anything, so only a safe subset of its characters is kept.
func snapshotName(host string, pid int, t time.Time, reason string) string {
	return fmt.Sprintf("npuprobe-%s-%d-%s-%s.pickle", sanitize(host), pid, t.UTC().Format("20060102T150405.000000Z"), sanitize(reason))
}

func sanitize(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
		if b.Len() >= 64 {
			break
		}
	}
	out := strings.Trim(b.String(), ".")
	if out == "" {
		return "unknown"
	}
	return out
}

func (s *session) statusText() string {
	var events uint64
	var segs int
	var reserved, allocated, preAttachFrees uint64
	for _, p := range s.procs {
		st := p.model.Stats()
		events += st.Events
		segs += st.LiveSegments
		reserved += st.ReservedBytes
		allocated += st.AllocatedBytes
		preAttachFrees += p.model.Counters().FreesOfUnknownBlocks
	}
	loss, _ := s.tracer.Loss()
	who := fmt.Sprintf("%d processes", len(s.procs))
	if len(s.procs) == 1 {
		for _, p := range s.procs {
			who = fmt.Sprintf("pid %d (%s)", p.target.PID, p.target.Name)
		}
	}
	text := fmt.Sprintf("npuprobe: %s: %d events, %d live segments, %s reserved", who, events, segs, humanBytes(reserved))
	if allocated > 0 || preAttachFrees > 0 {
		text += fmt.Sprintf(", %s allocated, %d frees of pre-attach tensors", humanBytes(allocated), preAttachFrees)
	}
	return text + fmt.Sprintf(", %d dropped", loss.RingBufferFull)
}

func humanBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
