package snapshot

import (
	"errors"
	"fmt"
	"math/bits"
	"sort"
	"strings"
)

// Why an entry of the torch snapshot got no time of its own from the
// recording (the keys of AugmentReport.Unmatched).
const (
	ReasonNotRecorded   = "not in the recording (outside its window, or lost)"
	ReasonSegmentLevel  = "tensor entry, and the recording is segment level"
	ReasonNeverRecorded = "action npuprobe never records"
	ReasonWorkspace     = "workspace entry synthesized by torch_npu at dump time"
	ReasonNoDevice      = "device absent from the recording"
	ReasonConflict      = "matched, but its time would go backwards"
)

// UnmatchedRule is how augment times an entry it could not match; it is
// written into the output's allocator_settings.
const UnmatchedRule = "an unmatched entry between two matched entries of its device gets the time interpolated " +
	"linearly by list position between them (integer microseconds, so never decreasing); " +
	"before a device's first match it takes that match's time, after the last match the last match's time; " +
	"a device without any match takes the earliest matched time of the file"

// AugmentReport says how augment timed the entries.
type AugmentReport struct {
	Recording      string // the recording's name, as given
	RecordingLevel string // "tensor" or "segment": which actions could match
	Entries        int    // trace entries of the torch snapshot
	Matched        int    // matched on action, address, size and order
	MatchedRelaxed int    // matched on action and address (size unknown in the recording) or, for oom, on order
	Interpolated   int    // unmatched, between two matched entries
	Extrapolated   int    // unmatched, before the first or after the last match of a device (or a device without any)
	HadTime        int    // entries that carried a time_us already (replaced)
	// Unmatched counts the unmatched entries by reason.
	Unmatched map[string]int
	// Devices lists the per-device counts.
	Devices []DeviceAugment
}

// DeviceAugment is one device's part of an AugmentReport.
type DeviceAugment struct {
	Device, Entries, Matched, Recorded int
}

// Summary is the report in a few lines for a terminal.
func (r *AugmentReport) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d trace entries: %d matched exactly, %d matched on action and address, %d interpolated, %d before the first or after the last match\n",
		r.Entries, r.Matched, r.MatchedRelaxed, r.Interpolated, r.Extrapolated)
	reasons := make([]string, 0, len(r.Unmatched))
	for k := range r.Unmatched {
		reasons = append(reasons, k)
	}
	sort.Strings(reasons)
	for _, k := range reasons {
		fmt.Fprintf(&b, "  unmatched: %d %s\n", r.Unmatched[k], k)
	}
	for _, d := range r.Devices {
		fmt.Fprintf(&b, "  device %d: %d entries, %d matched, %d entries in the recording\n", d.Device, d.Entries, d.Matched, d.Recorded)
	}
	if r.HadTime > 0 {
		fmt.Fprintf(&b, "  %d entries had a time_us already; replaced\n", r.HadTime)
	}
	return strings.TrimRight(b.String(), "\n")
}

// ErrNothingMatched means the recording shares no entry with the torch
// snapshot: not the same process, or windows that do not overlap.
var ErrNothingMatched = errors.New("no trace entry matches the recording: is it a recording of the same process, covering the same time?")

var segmentActions = map[string]bool{
	ActionSegmentAlloc: true, ActionSegmentFree: true, ActionSegmentMap: true, ActionSegmentUnmap: true, ActionOOM: true,
}

var tensorActions = map[string]bool{ActionAlloc: true, ActionFreeRequested: true, ActionFreeCompleted: true}

// RecordingLevel is "tensor" if the recording has tensor entries (or says
// so in npuprobe_level), else "segment".
func RecordingLevel(rec *Snapshot) string {
	if v, ok := rec.Setting("npuprobe_level"); ok {
		if s, ok := v.(string); ok && (s == "tensor" || s == "segment") {
			return s
		}
	}
	for _, tr := range rec.DeviceTraces {
		for i := range tr {
			if tensorActions[tr[i].Action] {
				return "tensor"
			}
		}
	}
	return "segment"
}

type entryKey struct {
	action     string
	addr, size int64
}

// Augment returns a copy of torch (a snapshot without time_us, from
// torch_npu) with time_us on every trace entry, taken from rec (an npuprobe
// recording of the same process over a window overlapping torch's):
//
// Matching, per device (the same device index on both sides): the
// entries npuprobe records — segment_alloc/free/map/unmap and oom, plus
// alloc/free_requested/free_completed when the recording is tensor level —
// are keyed by (action, address or device_free, size), and the two key
// sequences are aligned order-preservingly (see align: a longest common
// subsequence in practice). A matched entry gets its partner's time_us.
// Matches whose recorded times would decrease along the torch list are
// dropped (the longest non-decreasing chain is kept). Then, between
// consecutive matches, entries left over on both sides are paired in order
// on a relaxed key: segment_free on its address when the recording's size
// is 0 (segment allocated before npuprobe attached) and oom on its action
// (npuprobe's free bytes and size can be estimates at segment level).
//
// Every other entry is timed by UnmatchedRule, and the report says why it
// had no match. The output's allocator_settings gain npuprobe_augment with
// the counts and the rule.
func Augment(torch, rec *Snapshot, recName string) (*Snapshot, *AugmentReport, error) {
	out := cloneForAugment(torch)
	r := &AugmentReport{Recording: recName, RecordingLevel: RecordingLevel(rec), Unmatched: map[string]int{}}
	matchable := func(action string) bool {
		return segmentActions[action] || (r.RecordingLevel == "tensor" && tensorActions[action])
	}

	type devTimes struct {
		times   []int64
		matched []bool
	}
	devs := make([]devTimes, len(out.DeviceTraces))
	var firstMatched int64
	anyMatched := false
	for d := range out.DeviceTraces {
		tr := out.DeviceTraces[d]
		r.Entries += len(tr)
		for i := range tr {
			if tr[i].TimeUs.Set {
				r.HadTime++
			}
		}
		if len(tr) == 0 {
			continue
		}
		var recTr []TraceEntry
		if d < len(rec.DeviceTraces) {
			recTr = rec.DeviceTraces[d]
		}
		times := make([]int64, len(tr))
		matched := make([]bool, len(tr))
		reason := make([]string, len(tr))
		devs[d] = devTimes{times, matched}

		// Entries that cannot match, and the sequences to align.
		synth := workspacePrefix(tr)
		ids := map[entryKey]int32{}
		id := func(e *TraceEntry) int32 {
			k := entryKey{e.Action, e.AddrOrFree(), e.Size}
			v, ok := ids[k]
			if !ok {
				v = int32(len(ids))
				ids[k] = v
			}
			return v
		}
		var aIdx, bIdx []int
		var a, b []int32
		for i := range tr {
			switch {
			case i < synth:
				reason[i] = ReasonWorkspace
			case len(recTr) == 0:
				reason[i] = ReasonNoDevice
			case matchable(tr[i].Action):
				reason[i] = ReasonNotRecorded
				aIdx = append(aIdx, i)
				a = append(a, id(&tr[i]))
			case tensorActions[tr[i].Action]:
				reason[i] = ReasonSegmentLevel
			default:
				reason[i] = ReasonNeverRecorded + " (" + tr[i].Action + ")"
			}
		}
		for j := range recTr {
			if matchable(recTr[j].Action) {
				bIdx = append(bIdx, j)
				b = append(b, id(&recTr[j]))
			}
		}
		pairs := align(a, b)
		for i := range pairs {
			pairs[i] = pair{aIdx[pairs[i].A], bIdx[pairs[i].B]}
		}
		exact := make(map[int]bool, len(pairs))
		for _, p := range pairs {
			exact[p.A] = true
		}
		pairs = append(pairs, relaxedPairs(tr, recTr, pairs, reason)...)
		sort.Slice(pairs, func(i, j int) bool { return pairs[i].A < pairs[j].A })
		pairs = nonDecreasingTimes(pairs, recTr, reason)

		for _, p := range pairs {
			times[p.A] = recTr[p.B].TimeUs.V
			matched[p.A] = true
			reason[p.A] = ""
			if exact[p.A] {
				r.Matched++
			} else {
				r.MatchedRelaxed++
			}
			if !anyMatched || times[p.A] < firstMatched {
				firstMatched = times[p.A]
			}
			anyMatched = true
		}
		for i := range tr {
			if reason[i] != "" {
				r.Unmatched[reason[i]]++
			}
		}
		r.Devices = append(r.Devices, DeviceAugment{Device: d, Entries: len(tr), Matched: len(pairs), Recorded: len(recTr)})
	}
	if r.Entries > 0 && !anyMatched {
		return nil, r, ErrNothingMatched
	}

	// Time every unmatched entry.
	for d := range out.DeviceTraces {
		tr := out.DeviceTraces[d]
		if len(tr) == 0 {
			continue
		}
		fillUnmatched(devs[d].times, devs[d].matched, firstMatched, r)
		for i := range tr {
			tr[i].TimeUs = Some(devs[d].times[i])
		}
	}
	addAugmentSettings(out, r)
	return out, r, nil
}

// workspacePrefix returns how many leading entries are torch_npu's
// synthetic workspace triples (workspace_snapshot, segment_alloc, alloc),
// prepended at dump time for the live workspace blocks (format §10).
func workspacePrefix(tr []TraceEntry) int {
	n := 0
	for n+2 < len(tr) && tr[n].Action == ActionWorkspaceSnapshot &&
		tr[n+1].Action == ActionSegmentAlloc && tr[n+2].Action == ActionAlloc {
		n += 3
	}
	return n
}

// relaxedPairs pairs, in each stretch between consecutive matches, the
// unmatched torch entries with unmatched recorded entries on a relaxed key,
// in order (backwards from the first match in the stretch before it, so
// that a recording starting much earlier cannot pull a pairing far away):
// segment_free / segment_unmap on the address when the recording's size is
// 0, oom on the action alone.
func relaxedPairs(tr, recTr []TraceEntry, pairs []pair, reason []string) []pair {
	type rkey struct {
		action string
		addr   int64
	}
	keyOf := func(e *TraceEntry) (rkey, bool) {
		switch e.Action {
		case ActionSegmentFree, ActionSegmentUnmap:
			return rkey{e.Action, e.AddrOrFree()}, true
		case ActionOOM:
			return rkey{e.Action, 0}, true
		}
		return rkey{}, false
	}
	usedB := make(map[int]bool, len(pairs))
	for _, p := range pairs {
		usedB[p.B] = true
	}
	// Recorded entries available for a relaxed match, by key, in order.
	avail := map[rkey][]int{}
	for j := range recTr {
		e := &recTr[j]
		if k, ok := keyOf(e); ok && !usedB[j] && (e.Action == ActionOOM || e.Size == 0) {
			avail[k] = append(avail[k], j)
		}
	}
	if len(avail) == 0 {
		return nil
	}
	taken := map[int]bool{}
	var out []pair
	bounds := append([]pair{{-1, -1}}, pairs...)
	bounds = append(bounds, pair{len(tr), len(recTr)})
	for k := 0; k+1 < len(bounds); k++ {
		lo, hi := bounds[k], bounds[k+1]
		if hi.A-lo.A <= 1 || hi.B-lo.B <= 1 {
			continue
		}
		if k == 0 {
			limit := hi.B // recorded entries must stay below limit
			for i := hi.A - 1; i > lo.A; i-- {
				key, ok := keyOf(&tr[i])
				if !ok || reason[i] != ReasonNotRecorded {
					continue
				}
				js := avail[key]
				n := sort.SearchInts(js, limit) - 1 // last below limit
				for n >= 0 && taken[js[n]] {
					n--
				}
				if n >= 0 && js[n] > lo.B {
					out = append(out, pair{i, js[n]})
					taken[js[n]] = true
					limit = js[n]
				}
			}
			continue
		}
		from := lo.B + 1 // recorded entries must be at from or later
		for i := lo.A + 1; i < hi.A; i++ {
			key, ok := keyOf(&tr[i])
			if !ok || reason[i] != ReasonNotRecorded {
				continue
			}
			js := avail[key]
			n := sort.SearchInts(js, from)
			for n < len(js) && taken[js[n]] {
				n++
			}
			if n < len(js) && js[n] < hi.B {
				// torch records one oom after its last retry; npuprobe one
				// per failed runtime call: take the last of adjacent ones.
				for key.action == ActionOOM && n+1 < len(js) && js[n+1] == js[n]+1 && js[n+1] < hi.B {
					n++
				}
				out = append(out, pair{i, js[n]})
				taken[js[n]] = true
				from = js[n] + 1
			}
		}
	}
	return out
}

// nonDecreasingTimes keeps the longest chain of pairs (sorted by A) whose
// recorded times do not decrease, marking the others as conflicts. With
// npuprobe's recordings (time never decreasing within a device) it keeps
// every pair.
func nonDecreasingTimes(pairs []pair, recTr []TraceEntry, reason []string) []pair {
	ok := true
	for k := 1; k < len(pairs); k++ {
		if recTr[pairs[k].B].TimeUs.V < recTr[pairs[k-1].B].TimeUs.V || !recTr[pairs[k].B].TimeUs.Set {
			ok = false
			break
		}
	}
	if ok && (len(pairs) == 0 || recTr[pairs[0].B].TimeUs.Set) {
		return pairs
	}
	// Longest non-decreasing subsequence of times, among timed entries.
	var idx []int
	for k, p := range pairs {
		if recTr[p.B].TimeUs.Set {
			idx = append(idx, k)
		} else {
			reason[p.A] = ReasonConflict
		}
	}
	tails := []int{}
	prev := make([]int, len(idx))
	for n, k := range idx {
		t := recTr[pairs[k].B].TimeUs.V
		pos := sort.Search(len(tails), func(m int) bool { return recTr[pairs[idx[tails[m]]].B].TimeUs.V > t })
		if pos > 0 {
			prev[n] = tails[pos-1]
		} else {
			prev[n] = -1
		}
		if pos == len(tails) {
			tails = append(tails, n)
		} else {
			tails[pos] = n
		}
	}
	keep := make(map[int]bool, len(tails))
	if len(tails) > 0 {
		for n := tails[len(tails)-1]; n >= 0; n = prev[n] {
			keep[idx[n]] = true
		}
	}
	var out []pair
	for k, p := range pairs {
		if keep[k] {
			out = append(out, p)
		} else {
			reason[p.A] = ReasonConflict
		}
	}
	return out
}

// fillUnmatched times the unmatched entries of one device by UnmatchedRule.
func fillUnmatched(times []int64, matched []bool, fallback int64, r *AugmentReport) {
	prev := -1
	for i := 0; i <= len(times); i++ {
		if i < len(times) && !matched[i] {
			continue
		}
		// Entries prev+1 .. i-1 are unmatched, between matches prev and i.
		for k := prev + 1; k < i; k++ {
			switch {
			case prev >= 0 && i < len(times):
				times[k] = interpolate(times[prev], times[i], int64(k-prev), int64(i-prev))
				r.Interpolated++
			case prev >= 0:
				times[k] = times[prev]
				r.Extrapolated++
			case i < len(times):
				times[k] = times[i]
				r.Extrapolated++
			default:
				times[k] = fallback
				r.Extrapolated++
			}
		}
		prev = i
	}
}

// interpolate returns t0 + (t1-t0)*num/den rounded down, for t0 <= t1 and
// 0 < num < den, without overflow.
func interpolate(t0, t1, num, den int64) int64 {
	if t1 <= t0 {
		return t0
	}
	hi, lo := bits.Mul64(uint64(t1-t0), uint64(num))
	q, _ := bits.Div64(hi, lo, uint64(den))
	return t0 + int64(q)
}

// cloneForAugment copies what augment changes (the traces) and shares the
// rest.
func cloneForAugment(s *Snapshot) *Snapshot {
	out := *s
	out.DeviceTraces = make([][]TraceEntry, len(s.DeviceTraces))
	for d, tr := range s.DeviceTraces {
		out.DeviceTraces[d] = append([]TraceEntry(nil), tr...)
	}
	if s.AllocatorSettings != nil {
		out.AllocatorSettings = &Dict{Items: append([]Item(nil), s.AllocatorSettings.Items...)}
	}
	return &out
}

func addAugmentSettings(s *Snapshot, r *AugmentReport) {
	if s.AllocatorSettings == nil {
		s.AllocatorSettings = &Dict{}
	}
	reasons := &Dict{}
	keys := make([]string, 0, len(r.Unmatched))
	for k := range r.Unmatched {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		reasons.Set(k, int64(r.Unmatched[k]))
	}
	devices := List{}
	for _, d := range r.Devices {
		dd := &Dict{}
		dd.Set("device", int64(d.Device))
		dd.Set("entries", int64(d.Entries))
		dd.Set("matched", int64(d.Matched))
		dd.Set("recorded_entries", int64(d.Recorded))
		devices = append(devices, dd)
	}
	a := &Dict{}
	a.Set("recording", r.Recording)
	a.Set("recording_level", r.RecordingLevel)
	a.Set("entries", int64(r.Entries))
	a.Set("matched", int64(r.Matched))
	a.Set("matched_relaxed", int64(r.MatchedRelaxed))
	a.Set("interpolated", int64(r.Interpolated))
	a.Set("extrapolated", int64(r.Extrapolated))
	a.Set("had_time_us", int64(r.HadTime))
	a.Set("unmatched_reasons", reasons)
	a.Set("devices", devices)
	a.Set("matching", "per device, on (action, address or device_free, size) in list order: an order-preserving alignment "+
		"(longest common subsequence) of the entries npuprobe records; segment_free on its address when the recording's size is 0, oom in order")
	a.Set("unmatched_rule", UnmatchedRule)
	s.AllocatorSettings.Set("npuprobe_augment", a)
}
