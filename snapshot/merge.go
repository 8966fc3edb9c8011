package snapshot

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// MergeInput is one per-rank snapshot.
type MergeInput struct {
	Name string // shown in settings and messages (the file name)
	Snap *Snapshot
}

// MergedDevice says where a device of the merged snapshot comes from.
type MergedDevice struct {
	Device       int // in the merged snapshot
	Rank         int // -1 if the file names none
	Source       string
	SourceDevice int
}

// MergeReport describes a merge.
type MergeReport struct {
	// Order is how the inputs were ordered: "rank" (every input names a
	// distinct rank in allocator_settings) or "arguments".
	Order string
	// Why is, for "arguments", why not by rank.
	Why     string
	Devices []MergedDevice
}

// Rank returns the rank a snapshot names in allocator_settings:
// npuprobe_rank, else RANK (an int or a decimal string).
func Rank(s *Snapshot) (int, bool) {
	for _, key := range []string{"npuprobe_rank", "RANK"} {
		v, ok := s.Setting(key)
		if !ok {
			continue
		}
		switch v := v.(type) {
		case int64:
			if v >= 0 && v < 1<<31 {
				return int(v), true
			}
		case string:
			if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && n >= 0 {
				return n, true
			}
		}
	}
	return 0, false
}

// Merge puts several per-process snapshots (one per rank) into one in
// which every device of every input is a device of its own, so that
// memory_viz's device selector switches between ranks. Inputs are ordered
// by rank when each names a distinct one (Rank), else kept in argument
// order. Devices are numbered from 0 in that order; an input's used
// devices (with a segment or a trace entry) get consecutive numbers, and
// an input with none still gets one (empty) device. Segments are
// renumbered and sorted by (device, address); each trace moves to its new
// index; external_annotations are renumbered. allocator_settings of the
// result hold npuprobe_merge (the mapping) and npuprobe_merge_settings
// (each input's own settings, by source).
func Merge(inputs []MergeInput) (*Snapshot, *MergeReport, error) {
	if len(inputs) == 0 {
		return nil, nil, fmt.Errorf("nothing to merge")
	}
	order := make([]int, len(inputs))
	for i := range order {
		order[i] = i
	}
	ranks := make([]int, len(inputs))
	r := &MergeReport{Order: "rank"}
	seen := map[int]string{}
	for i, in := range inputs {
		rank, ok := Rank(in.Snap)
		if !ok {
			ranks[i] = -1
			if r.Order == "rank" {
				r.Order, r.Why = "arguments", fmt.Sprintf("%s names no rank in allocator_settings (npuprobe_rank or RANK)", in.Name)
			}
			continue
		}
		ranks[i] = rank
		if other, dup := seen[rank]; dup && r.Order == "rank" {
			r.Order, r.Why = "arguments", fmt.Sprintf("%s and %s both name rank %d", other, in.Name, rank)
		}
		seen[rank] = in.Name
	}
	if r.Order == "rank" {
		sort.SliceStable(order, func(a, b int) bool { return ranks[order[a]] < ranks[order[b]] })
	}

	out := &Snapshot{AllocatorSettings: &Dict{}}
	var annotations List
	mapping := List{}
	sources := List{}
	for _, i := range order {
		in := inputs[i]
		used := in.Snap.UsedDevices()
		if len(used) == 0 {
			used = []int{0}
		}
		newDev := make(map[int]int, len(used))
		for _, d := range used {
			nd := len(out.DeviceTraces)
			newDev[d] = nd
			var tr []TraceEntry
			if d < len(in.Snap.DeviceTraces) {
				tr = append([]TraceEntry(nil), in.Snap.DeviceTraces[d]...)
			}
			if tr == nil {
				tr = []TraceEntry{}
			}
			out.DeviceTraces = append(out.DeviceTraces, tr)
			r.Devices = append(r.Devices, MergedDevice{Device: nd, Rank: ranks[i], Source: in.Name, SourceDevice: d})
			m := &Dict{}
			m.Set("device", int64(nd))
			if ranks[i] >= 0 {
				m.Set("rank", int64(ranks[i]))
			} else {
				m.Set("rank", nil)
			}
			m.Set("source", in.Name)
			m.Set("source_device", int64(d))
			for _, key := range []string{"npuprobe_host", "npuprobe_pid", "npuprobe_process", "npuprobe_level"} {
				if v, ok := in.Snap.Setting(key); ok {
					m.Set(strings.TrimPrefix(key, "npuprobe_"), v)
				}
			}
			mapping = append(mapping, m)
		}
		for _, seg := range in.Snap.Segments {
			seg.Device = newDev[seg.Device]
			out.Segments = append(out.Segments, seg)
		}
		if in.Snap.ExternalAnnotations.Set {
			for _, a := range in.Snap.ExternalAnnotations.V {
				if d, ok := a.(*Dict); ok {
					c := &Dict{Items: append([]Item(nil), d.Items...)}
					if dev, ok := c.Get("device"); ok {
						if n, ok := dev.(int64); ok {
							if nd, ok := newDev[int(n)]; ok {
								c.Set("device", int64(nd))
							}
						}
					}
					a = c
				}
				annotations = append(annotations, a)
			}
		}
		src := &Dict{}
		src.Set("source", in.Name)
		if in.Snap.AllocatorSettings != nil {
			src.Set("allocator_settings", in.Snap.AllocatorSettings)
		} else {
			src.Set("allocator_settings", nil)
		}
		sources = append(sources, src)
	}
	sort.SliceStable(out.Segments, func(a, b int) bool {
		sa, sb := &out.Segments[a], &out.Segments[b]
		if sa.Device != sb.Device {
			return sa.Device < sb.Device
		}
		return sa.Address < sb.Address
	})
	if annotations != nil {
		out.ExternalAnnotations = Some(annotations)
	}
	m := &Dict{}
	m.Set("order", r.Order)
	if r.Why != "" {
		m.Set("order_reason", r.Why)
	}
	m.Set("devices", mapping)
	out.AllocatorSettings.Set("npuprobe_merge", m)
	out.AllocatorSettings.Set("npuprobe_merge_settings", sources)
	return out, r, nil
}
