package snapshot

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
)

// Series is one device's memory over its trace, replayed from the end
// state backwards (so it holds even when the trace starts mid-run or a
// ring dropped its oldest entries): Reserved[k] and Allocated[k] are the
// levels after entry k-1, Reserved[0] the level before the first entry.
//
//   - reserved: segment_alloc and segment_map add their size,
//     segment_free and segment_unmap subtract it; at the end it is the
//     sum of the device's segments' total_size.
//   - allocated: alloc adds its size and free_completed subtracts its
//     size (torch writes requested bytes in both); at the end it is the
//     sum of requested_size over active blocks.
//
// An entry of size 0 (npuprobe's segment_free of a segment allocated
// before it attached) changes nothing.
type Series struct {
	Device    int
	Reserved  []int64 // len(trace)+1
	Allocated []int64 // len(trace)+1
	// TimeUs[k] is entry k's time_us; nil unless every entry has one.
	TimeUs []int64
	// OOMs lists the indices of oom entries.
	OOMs []int
}

// Replay computes the Series of device d.
func Replay(s *Snapshot, d int) *Series {
	var tr []TraceEntry
	if d < len(s.DeviceTraces) {
		tr = s.DeviceTraces[d]
	}
	se := &Series{Device: d, Reserved: make([]int64, len(tr)+1), Allocated: make([]int64, len(tr)+1)}
	var reserved, allocated int64
	for i := range s.Segments {
		seg := &s.Segments[i]
		if seg.Device != d {
			continue
		}
		reserved += seg.TotalSize
		for j := range seg.Blocks {
			if seg.Blocks[j].IsActive() {
				allocated += seg.Blocks[j].RequestedSize.V
			}
		}
	}
	se.Reserved[len(tr)], se.Allocated[len(tr)] = reserved, allocated
	timed := len(tr) > 0
	for k := len(tr) - 1; k >= 0; k-- {
		dr, da := deltas(&tr[k])
		reserved -= dr
		allocated -= da
		se.Reserved[k], se.Allocated[k] = reserved, allocated
		timed = timed && tr[k].TimeUs.Set
		if tr[k].Action == ActionOOM {
			se.OOMs = append(se.OOMs, k)
		}
	}
	sort.Ints(se.OOMs)
	if timed {
		se.TimeUs = make([]int64, len(tr))
		for k := range tr {
			se.TimeUs[k] = tr[k].TimeUs.V
		}
	}
	return se
}

func deltas(e *TraceEntry) (reserved, allocated int64) {
	switch e.Action {
	case ActionSegmentAlloc, ActionSegmentMap:
		return e.Size, 0
	case ActionSegmentFree, ActionSegmentUnmap:
		return -e.Size, 0
	case ActionAlloc:
		return 0, e.Size
	case ActionFreeCompleted:
		return 0, -e.Size
	}
	return 0, 0
}

// Peak is a maximum of a Series: Level, first reached after entry Index
// (-1: before the first entry), at TimeUs if the trace is timed.
type Peak struct {
	Level  int64      `json:"level"`
	Index  int        `json:"index"`
	TimeUs Opt[int64] `json:"-"`
	Time   string     `json:"time,omitempty"` // UTC, when timed
}

func peakOf(levels []int64, times []int64) Peak {
	best := 0
	for k, v := range levels {
		if v > levels[best] {
			best = k
		}
	}
	p := Peak{Level: levels[best], Index: best - 1}
	if times != nil && best > 0 {
		p.TimeUs = Some(times[best-1])
		p.Time = FormatTimeUs(times[best-1])
	}
	return p
}

// FormatTimeUs formats unix microseconds as UTC with microseconds.
func FormatTimeUs(us int64) string {
	return time.UnixMicro(us).UTC().Format("2006-01-02T15:04:05.000000Z")
}

// Stats is the summary `npuprobe stats` prints.
type Stats struct {
	Protocol int           `json:"protocol"`
	Segments int           `json:"segments"`
	Entries  int           `json:"entries"`
	Level    string        `json:"level,omitempty"` // npuprobe_level
	Loss     []Counter     `json:"loss,omitempty"`
	First    string        `json:"first_time,omitempty"`
	Last     string        `json:"last_time,omitempty"`
	FirstUs  int64         `json:"first_time_us,omitempty"`
	LastUs   int64         `json:"last_time_us,omitempty"`
	Devices  []DeviceStats `json:"devices"`
}

// Counter is one named loss counter.
type Counter struct {
	Source string `json:"source,omitempty"` // the input file, in a merged snapshot
	Name   string `json:"name"`
	Value  int64  `json:"value"`
}

// DeviceStats is one device's part of Stats.
type DeviceStats struct {
	Device        int            `json:"device"`
	Segments      int            `json:"segments"`
	Reserved      int64          `json:"reserved"`       // Σ total_size
	Allocated     int64          `json:"allocated"`      // Σ size of active_allocated blocks
	Active        int64          `json:"active"`         // Σ size of active blocks
	Requested     int64          `json:"requested"`      // Σ requested_size of active blocks
	PeakReserved  Peak           `json:"peak_reserved"`  // replayed
	PeakAllocated Peak           `json:"peak_allocated"` // replayed (requested bytes)
	Pools         []PoolStats    `json:"pools"`
	LargestBlocks []BlockStat    `json:"largest_blocks"`
	LargestSegs   []BlockStat    `json:"largest_segments"`
	FreeBytes     int64          `json:"free_bytes"`    // Σ inactive blocks
	LargestFree   int64          `json:"largest_free"`  // largest inactive block
	Fragmentation float64        `json:"fragmentation"` // 1 − LargestFree/FreeBytes
	InactiveRatio float64        `json:"inactive_ratio"`
	Events        map[string]int `json:"events"`
	Entries       int            `json:"entries"`
	First         string         `json:"first_time,omitempty"`
	Last          string         `json:"last_time,omitempty"`
}

// PoolStats counts a pool's segments.
type PoolStats struct {
	Pool     string `json:"pool"` // small, large or expandable
	Segments int    `json:"segments"`
	Bytes    int64  `json:"bytes"`
}

// BlockStat is a block or segment in a "largest" list.
type BlockStat struct {
	Address   int64  `json:"address"`
	Size      int64  `json:"size"`
	Requested int64  `json:"requested,omitempty"`
	State     string `json:"state,omitempty"`
	Segment   int64  `json:"segment,omitempty"`
	Pool      string `json:"pool,omitempty"`
}

// Largest is how many blocks and segments the lists hold.
const Largest = 5

// ComputeStats summarizes s.
func ComputeStats(s *Snapshot) *Stats {
	st := &Stats{Protocol: s.Protocol, Segments: len(s.Segments)}
	if v, ok := s.Setting("npuprobe_level"); ok {
		st.Level, _ = v.(string)
	}
	st.Loss = lossCounters(s)
	first, last := int64(0), int64(0)
	timed := false
	for _, d := range s.UsedDevices() {
		ds := deviceStats(s, d)
		st.Entries += ds.Entries
		if d < len(s.DeviceTraces) {
			for _, e := range s.DeviceTraces[d] {
				if !e.TimeUs.Set {
					continue
				}
				if !timed || e.TimeUs.V < first {
					first = e.TimeUs.V
				}
				if !timed || e.TimeUs.V > last {
					last = e.TimeUs.V
				}
				timed = true
			}
		}
		st.Devices = append(st.Devices, ds)
	}
	if timed {
		st.FirstUs, st.LastUs = first, last
		st.First, st.Last = FormatTimeUs(first), FormatTimeUs(last)
	}
	return st
}

func poolOf(seg *Segment) string {
	switch {
	case seg.IsExpandable.V:
		return "expandable"
	case seg.SegmentType.V == "small":
		return "small"
	default:
		return "large"
	}
}

func deviceStats(s *Snapshot, d int) DeviceStats {
	ds := DeviceStats{Device: d, Events: map[string]int{}}
	pools := map[string]*PoolStats{"small": {Pool: "small"}, "large": {Pool: "large"}, "expandable": {Pool: "expandable"}}
	var blocks, segs []BlockStat
	for i := range s.Segments {
		seg := &s.Segments[i]
		if seg.Device != d {
			continue
		}
		ds.Segments++
		ds.Reserved += seg.TotalSize
		p := pools[poolOf(seg)]
		p.Segments++
		p.Bytes += seg.TotalSize
		segs = append(segs, BlockStat{Address: seg.Address, Size: seg.TotalSize, Pool: p.Pool})
		for j := range seg.Blocks {
			b := &seg.Blocks[j]
			switch {
			case b.State == StateActiveAllocated:
				ds.Allocated += b.Size
			case b.State == StateInactive:
				ds.FreeBytes += b.Size
				ds.LargestFree = max(ds.LargestFree, b.Size)
			}
			if b.IsActive() {
				ds.Active += b.Size
				ds.Requested += b.RequestedSize.V
				addr := b.Address.V
				if !b.Address.Set {
					addr = seg.Address
					for k := 0; k < j; k++ {
						addr += seg.Blocks[k].Size
					}
				}
				blocks = append(blocks, BlockStat{Address: addr, Size: b.Size, Requested: b.RequestedSize.V, State: b.State, Segment: seg.Address})
			}
		}
	}
	ds.Pools = []PoolStats{*pools["small"], *pools["large"], *pools["expandable"]}
	if ds.FreeBytes > 0 {
		ds.Fragmentation = 1 - float64(ds.LargestFree)/float64(ds.FreeBytes)
	}
	if ds.Reserved > 0 {
		ds.InactiveRatio = float64(ds.FreeBytes) / float64(ds.Reserved)
	}
	ds.LargestBlocks = largest(blocks)
	ds.LargestSegs = largest(segs)
	se := Replay(s, d)
	ds.PeakReserved = peakOf(se.Reserved, se.TimeUs)
	ds.PeakAllocated = peakOf(se.Allocated, se.TimeUs)
	if d < len(s.DeviceTraces) {
		tr := s.DeviceTraces[d]
		ds.Entries = len(tr)
		for i := range tr {
			ds.Events[tr[i].Action]++
		}
		if se.TimeUs != nil && len(tr) > 0 {
			ds.First, ds.Last = FormatTimeUs(se.TimeUs[0]), FormatTimeUs(se.TimeUs[len(tr)-1])
		}
	}
	return ds
}

func largest(bs []BlockStat) []BlockStat {
	sort.SliceStable(bs, func(i, j int) bool { return bs[i].Size > bs[j].Size })
	if len(bs) > Largest {
		bs = bs[:Largest]
	}
	return bs
}

// lossCounters collects npuprobe's loss counters from allocator_settings,
// and, in a merged file, from each source's settings (Source set).
func lossCounters(s *Snapshot) []Counter {
	out := settingsCounters(s.AllocatorSettings, "")
	if v, ok := s.Setting("npuprobe_merge_settings"); ok {
		list, _ := v.(List)
		for _, it := range list {
			d, ok := it.(*Dict)
			if !ok {
				continue
			}
			src, _ := d.Get("source")
			name, _ := src.(string)
			st, _ := d.Get("allocator_settings")
			if sd, ok := st.(*Dict); ok {
				out = append(out, settingsCounters(sd, name)...)
			}
		}
	}
	return out
}

func settingsCounters(settings *Dict, source string) []Counter {
	var out []Counter
	add := func(name string, v Value) {
		switch v := v.(type) {
		case int64:
			out = append(out, Counter{Source: source, Name: name, Value: v})
		case bool:
			n := int64(0)
			if v {
				n = 1
			}
			out = append(out, Counter{Source: source, Name: name, Value: n})
		}
	}
	for _, key := range []string{"npuprobe_dropped_events", "npuprobe_entries_overwritten", "trace_alloc_overflowed"} {
		if v, ok := settings.Get(key); ok {
			add(key, v)
		}
	}
	if v, ok := settings.Get("npuprobe_loss"); ok {
		if d, ok := v.(*Dict); ok {
			for _, it := range d.Items {
				if k, ok := it.Key.(string); ok {
					add("npuprobe_loss."+k, it.Value)
				}
			}
		}
	}
	return out
}

// Bytes formats a byte count for people: "1.50 GiB (1610612736 B)".
func Bytes(n int64) string {
	if n < 1024 && n > -1024 {
		return ShortBytes(n)
	}
	return fmt.Sprintf("%s (%d B)", ShortBytes(n), n)
}

// ShortBytes formats a byte count with a binary unit.
func ShortBytes(n int64) string {
	v := float64(n)
	neg := ""
	if v < 0 {
		neg, v = "-", -v
	}
	for _, u := range []string{"B", "KiB", "MiB", "GiB", "TiB"} {
		if v < 1024 || u == "TiB" {
			if u == "B" {
				return fmt.Sprintf("%s%d B", neg, int64(v))
			}
			return fmt.Sprintf("%s%.2f %s", neg, v, u)
		}
		v /= 1024
	}
	return ""
}

// WriteText prints st for a terminal.
func (st *Stats) WriteText(w io.Writer, name string) {
	fmt.Fprintf(w, "%s: pickle protocol %d, %d devices, %d segments, %d trace entries\n", name, st.Protocol, len(st.Devices), st.Segments, st.Entries)
	if st.Level != "" {
		fmt.Fprintf(w, "npuprobe level: %s\n", st.Level)
	}
	for i := 0; i < len(st.Loss); {
		src := st.Loss[i].Source
		var parts []string
		for ; i < len(st.Loss) && st.Loss[i].Source == src; i++ {
			parts = append(parts, fmt.Sprintf("%s %d", st.Loss[i].Name, st.Loss[i].Value))
		}
		if src != "" {
			src = " (" + src + ")"
		}
		fmt.Fprintf(w, "npuprobe loss counters%s: %s\n", src, strings.Join(parts, ", "))
	}
	if st.First != "" {
		fmt.Fprintf(w, "time span: %s .. %s (%.6f s)\n", st.First, st.Last, float64(st.LastUs-st.FirstUs)/1e6)
	} else {
		fmt.Fprintln(w, "time span: unknown (no time_us on the trace entries)")
	}
	for _, d := range st.Devices {
		fmt.Fprintf(w, "\ndevice %d\n", d.Device)
		fmt.Fprintf(w, "  reserved        %s in %d segments\n", Bytes(d.Reserved), d.Segments)
		fmt.Fprintf(w, "  allocated       %s (active_allocated blocks)\n", Bytes(d.Allocated))
		fmt.Fprintf(w, "  active          %s (allocated or pending free)\n", Bytes(d.Active))
		fmt.Fprintf(w, "  requested       %s (requested by the active blocks' tensors)\n", Bytes(d.Requested))
		fmt.Fprintf(w, "  peak reserved   %s %s\n", Bytes(d.PeakReserved.Level), peakWhere(d.PeakReserved))
		fmt.Fprintf(w, "  peak allocated  %s %s (requested bytes, replayed from the trace)\n", Bytes(d.PeakAllocated.Level), peakWhere(d.PeakAllocated))
		parts := make([]string, len(d.Pools))
		for i, p := range d.Pools {
			parts[i] = fmt.Sprintf("%s %d (%s)", p.Pool, p.Segments, ShortBytes(p.Bytes))
		}
		fmt.Fprintf(w, "  segments        %s\n", strings.Join(parts, ", "))
		if d.FreeBytes > 0 {
			fmt.Fprintf(w, "  fragmentation   %.1f%% (largest free block %s of %s free in segments); inactive/reserved %.1f%%\n",
				100*d.Fragmentation, ShortBytes(d.LargestFree), ShortBytes(d.FreeBytes), 100*d.InactiveRatio)
		} else {
			fmt.Fprintln(w, "  fragmentation   0% (no free block in segments)")
		}
		if len(d.LargestBlocks) > 0 {
			fmt.Fprintln(w, "  largest blocks")
			for _, b := range d.LargestBlocks {
				fmt.Fprintf(w, "    %12s  %-19s %#x  requested %s\n", ShortBytes(b.Size), b.State, b.Address, ShortBytes(b.Requested))
			}
		}
		if len(d.LargestSegs) > 0 {
			fmt.Fprintln(w, "  largest segments")
			for _, b := range d.LargestSegs {
				fmt.Fprintf(w, "    %12s  %-10s %#x\n", ShortBytes(b.Size), b.Pool, b.Address)
			}
		}
		actions := make([]string, 0, len(d.Events))
		for a := range d.Events {
			actions = append(actions, a)
		}
		sort.Strings(actions)
		parts = parts[:0]
		for _, a := range actions {
			parts = append(parts, fmt.Sprintf("%s %d", a, d.Events[a]))
		}
		if len(parts) == 0 {
			parts = []string{"none"}
		}
		fmt.Fprintf(w, "  events          %d: %s\n", d.Entries, strings.Join(parts, ", "))
		if d.First != "" {
			fmt.Fprintf(w, "  time span       %s .. %s\n", d.First, d.Last)
		}
	}
}

func peakWhere(p Peak) string {
	switch {
	case p.Index < 0:
		return "before the first trace entry"
	case p.Time != "":
		return fmt.Sprintf("after entry %d, at %s", p.Index, p.Time)
	default:
		return fmt.Sprintf("after entry %d", p.Index)
	}
}
