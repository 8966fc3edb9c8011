package main

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/output"
)

// writeSnapshot writes one snapshot of p and returns its path (none if
// writing failed, which is reported).
func (s *session) writeSnapshot(p *traced, reason string) []string {
	// Records may have been lost since the last resync: bring the model in
	// line with the kernel first, so segments are right.
	s.resyncIfLost()
	// Written straight from the model's rings (this is the goroutine that
	// changes the model): a copy of millions of entries would double the
	// memory at the worst moment.
	view := p.model.View()
	s.tracker.Recalibrate()
	loss, err := s.tracer.Loss()
	if err != nil {
		fmt.Fprintf(s.log, "npuprobe: reading loss counters: %v\n", err)
	}
	settings := s.settings(p, &view.Snapshot, loss, reason)
	write := func(w io.Writer) error {
		return output.WriteSnapshotFrom(w, output.ViewSource(view, s.conv), settings)
	}
	s.status.clear()
	var path string
	if s.opts.finalName != "" && (reason == "exit" || reason == "final") {
		path, err = s.dir.ReplaceFile(s.opts.finalName, write)
	} else {
		base := snapshotName(s.host, p.target.PID, p.env, time.Now(), reason)
		path, err = s.dir.WriteFile(base+".pickle", write)
		// Names carry microseconds; two snapshots of one process in the
		// same microsecond get a counter.
		for i := 1; errors.Is(err, output.ErrExists) && i < 100; i++ {
			path, err = s.dir.WriteFile(fmt.Sprintf("%s-%d.pickle", base, i), write)
		}
	}
	if err != nil {
		s.metrics.failures.Inc()
		fmt.Fprintf(s.log, "npuprobe: snapshot of process %d not written: %v\n", p.target.PID, err)
		return nil
	}
	s.metrics.snapshots.WithLabelValues(reason).Inc()
	return []string{path}
}

func (s *session) settings(p *traced, snap *allocmodel.Snapshot, loss agent.Loss, reason string) []output.Setting {
	var overwritten uint64
	for _, n := range snap.Overwritten {
		overwritten += n
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
		)
	}
	st = append(st,
		output.Setting{Key: "npuprobe_alloc_conf", Value: []output.Setting{
			{Key: "source", Value: p.conf.Source},
			{Key: "value", Value: p.conf.Raw},
		}},
		output.Setting{Key: "npuprobe_host", Value: s.host},
		output.Setting{Key: "npuprobe_pid", Value: p.target.PID},
		output.Setting{Key: "npuprobe_process", Value: p.target.Name},
	)
	for _, k := range []string{"RANK", "LOCAL_RANK", "WORLD_SIZE"} {
		if v, ok := p.env[k]; ok {
			st = append(st, output.Setting{Key: "npuprobe_" + strings.ToLower(k), Value: v})
		}
	}
	st = append(st,
		output.Setting{Key: "npuprobe_reason", Value: reason},
		output.Setting{Key: "npuprobe_stream_note", Value: "stream: the aclrtStream of the caching allocator's call where observed (NpuCachingAllocator::malloc, raw_alloc_with_stream); 0 where no observed call carries one (runtime calls at segment level)"},
		output.Setting{Key: "npuprobe_device_note", Value: "device: from aclrtMallocPhysical's prop, the caching allocator's malloc and DataPtr, or aclrtSetDevice/aclrtGetDevice seen after attach; " +
			"threads whose device was set before attach and never shown count as the default device (--device, else LOCAL_RANK, else 0)"},
	)
	if snap.MaxEntries > 0 {
		st = append(st, output.Setting{Key: "trace_alloc_max_entries", Value: snap.MaxEntries})
	}
	c := snap.Counters
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
			{Key: "live_allocations_not_stored", Value: loss.LiveFull},
			{Key: "records_from_untraced_processes", Value: s.foreign},
		}},
		output.Setting{Key: "npuprobe_model", Value: []output.Setting{
			{Key: "events", Value: c.Events},
			{Key: "segment_frees_size_unknown", Value: c.SegmentFreesUnknown},
			{Key: "frees_of_null", Value: c.FreesOfNull},
			{Key: "allocations_over_live_segment", Value: c.AllocsOverLive},
			{Key: "failed_calls", Value: c.FailedCalls},
			{Key: "ooms", Value: c.OOMs},
			{Key: "oom_device_free_inferred", Value: c.OOMFreeInferred},
			{Key: "tensor_frees_before_attach", Value: c.FreesOfUnknownBlocks},
			{Key: "tensor_allocs_in_unknown_segments", Value: c.AllocsUnplaceable},
			{Key: "allocations_over_live_block", Value: c.AllocsOverLiveBlock},
			{Key: "out_of_order_splits", Value: c.OutOfOrderSplits},
			{Key: "block_splits_repaired", Value: c.BlockSplitsRepaired},
			{Key: "blocks_merged_repaired", Value: c.BlocksMergedRepaired},
			{Key: "segments_freed_with_live_blocks", Value: c.SegmentsFreedWithLiveBlocks},
			{Key: "runtime_allocations_outside_allocator", Value: c.RuntimeAllocsOutside},
			{Key: "invalid_devices", Value: c.InvalidDevices},
			{Key: "resyncs", Value: c.Resyncs},
			{Key: "resync_segments_added", Value: c.ResyncSegmentsAdded},
			{Key: "resync_segments_removed", Value: c.ResyncSegmentsRemoved},
			{Key: "resync_blocks_changed", Value: c.ResyncBlocksChanged},
			{Key: "resync_entries", Value: c.ResyncEntries},
			{Key: "segment_frees_allocation_lost", Value: c.SegmentFreesAllocLost},
			{Key: "alignment_splits", Value: c.AlignmentSplits},
			{Key: "maps_outside_reservation", Value: c.MapsOutsideReservation},
		}},
	)
	var clockSettings []output.Setting
	for _, f := range s.tracker.Metadata().Fields() {
		clockSettings = append(clockSettings, output.Setting{Key: f.Key, Value: f.Value})
	}
	return append(st, output.Setting{Key: "npuprobe_clock", Value: clockSettings})
}

// snapshotName builds a file name (without extension) from the host name,
// the PID, the target's RANK and LOCAL_RANK, the time and the reason. The
// host name and the environment are the target's to set (a container picks
// its host name), so only a safe subset of their characters is kept.
func snapshotName(host string, pid int, env map[string]string, t time.Time, reason string) string {
	name := fmt.Sprintf("npuprobe-%s-%d", sanitize(host), pid)
	if v, ok := env["RANK"]; ok {
		name += "-rank" + sanitize(v)
	}
	if v, ok := env["LOCAL_RANK"]; ok {
		name += "-local" + sanitize(v)
	}
	return name + fmt.Sprintf("-%s-%s", t.UTC().Format("20060102T150405.000000Z"), sanitize(reason))
}

func sanitize(s string) string {
	var b strings.Builder
	for _, r := range s {
		if b.Len() >= 64 {
			break
		}
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
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
	if len(s.watching) > 0 {
		who += fmt.Sprintf(", %d waiting for the runtime", len(s.watching))
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
