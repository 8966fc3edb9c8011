package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"image"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/snapshot/snaptest"
	"github.com/npuprobe/npuprobe/tests/fixture"
	"github.com/npuprobe/npuprobe/tests/snapshotcheck"
)

// toolFiles are snapshots of fixture runs for the tools' tests.
type toolFiles struct {
	churn      *snaptest.Dump // churn with an oom, device 0: torch_npu-style pickle and ground truth
	trans      *snaptest.Dump // transformer, two streams, device 1
	churnTimed string         // churn's ground truth as a snapshot with time_us, rank 1, loss counters
	transTimed string         // transformer's, with time_us, RANK "0"
}

func runTool(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	code, out, errs := runTool(t, args...)
	if code != 0 {
		t.Fatalf("npuprobe %s: exit %d\n%s%s", strings.Join(args, " "), code, out, errs)
	}
	return out
}

// TestPlotStatsMergeAugment runs augment, merge, stats and plot on snapshots of the fake
// torch_npu allocator (one fixture build for all).
func TestPlotStatsMergeAugment(t *testing.T) {
	paths, err := fixture.Build(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sub := func(name string) string {
		d := filepath.Join(dir, name)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	f := &toolFiles{
		churn: snaptest.TensorDump(t, paths, sub("churn"), nil, "--pattern", "churn", "--steps", "3000", "--seed", "7", "--pre-attach-steps", "0"),
		trans: snaptest.TensorDump(t, paths, sub("transformer"), nil, "--pattern", "transformer", "--steps", "6", "--streams", "2",
			"--device", "1", "--pre-attach-steps", "0"),
	}
	churnSnap := snaptest.FromGroundTruth(f.churn.GT)
	churnSnap.AllocatorSettings.Set("npuprobe_rank", int64(1))
	churnSnap.AllocatorSettings.Set("npuprobe_dropped_events", int64(0))
	loss := &snapshot.Dict{}
	loss.Set("ring_buffer_full", int64(0))
	loss.Set("sequence_gaps", int64(2))
	churnSnap.AllocatorSettings.Set("npuprobe_loss", loss)
	f.churnTimed = filepath.Join(dir, "churn-timed.pickle")
	if err := snapshot.WriteFile(f.churnTimed, churnSnap); err != nil {
		t.Fatal(err)
	}
	transSnap := snaptest.FromGroundTruth(f.trans.GT)
	transSnap.AllocatorSettings.Set("RANK", "0")
	f.transTimed = filepath.Join(dir, "transformer-timed.pickle")
	if err := snapshot.WriteFile(f.transTimed, transSnap); err != nil {
		t.Fatal(err)
	}

	t.Run("Stats", func(t *testing.T) { testStats(t, f) })
	t.Run("Merge", func(t *testing.T) { testMerge(t, f) })
	t.Run("Augment", func(t *testing.T) { testAugmentCLI(t, f) })
	t.Run("Plot", func(t *testing.T) { testPlot(t, f) })
	t.Run("BadFiles", func(t *testing.T) { testBadFiles(t, f) })
}

// replayed is an independent forward replay of a ground-truth trace from
// an empty allocator (the fixture's trace starts at process start).
type replayed struct {
	reserved, peakReserved, peakAllocated int64
	peakReservedAt, peakAllocatedAt       int // entry index, -1 = before the first
	events                                map[string]int
}

func replayGroundTruth(gt *fixture.TorchGroundTruth, d int) replayed {
	r := replayed{peakReservedAt: -1, peakAllocatedAt: -1, events: map[string]int{}}
	var res, alloc int64
	for i, e := range gt.DeviceTraces[d] {
		r.events[e.Action]++
		switch e.Action {
		case "segment_alloc":
			res += int64(e.Size)
		case "segment_free":
			res -= int64(e.Size)
		case "alloc":
			alloc += int64(e.Size)
		case "free_completed":
			alloc -= int64(e.Size)
		}
		if res > r.peakReserved {
			r.peakReserved, r.peakReservedAt = res, i
		}
		if alloc > r.peakAllocated {
			r.peakAllocated, r.peakAllocatedAt = alloc, i
		}
	}
	for _, s := range gt.Segments {
		if s.Device == d {
			r.reserved += int64(s.TotalSize)
		}
	}
	return r
}

func statsJSON(t *testing.T, path string) *snapshot.Stats {
	t.Helper()
	out := mustRun(t, "stats", "--json", path)
	var st snapshot.Stats
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	return &st
}

func deviceOf(t *testing.T, st *snapshot.Stats, d int) snapshot.DeviceStats {
	t.Helper()
	for _, ds := range st.Devices {
		if ds.Device == d {
			return ds
		}
	}
	t.Fatalf("stats have no device %d: %+v", d, st.Devices)
	return snapshot.DeviceStats{}
}

// checkStatsAgainst compares one device's stats with the replay of the
// ground truth and with the ground truth's end state.
func checkStatsAgainst(t *testing.T, ds snapshot.DeviceStats, gt *fixture.TorchGroundTruth, d int, timed bool) {
	t.Helper()
	want := replayGroundTruth(gt, d)
	if ds.Reserved != want.reserved || ds.PeakReserved.Level != want.peakReserved || ds.PeakReserved.Index != want.peakReservedAt ||
		ds.PeakAllocated.Level != want.peakAllocated || ds.PeakAllocated.Index != want.peakAllocatedAt {
		t.Errorf("device %d: reserved %d, peaks %+v / %+v; replay gives reserved %d, peak reserved %d at %d, peak allocated %d at %d",
			ds.Device, ds.Reserved, ds.PeakReserved, ds.PeakAllocated, want.reserved, want.peakReserved, want.peakReservedAt,
			want.peakAllocated, want.peakAllocatedAt)
	}
	if fmt.Sprint(ds.Events) != fmt.Sprint(want.events) || ds.Entries != len(gt.DeviceTraces[d]) {
		t.Errorf("events %v, want %v", ds.Events, want.events)
	}
	var allocated, free, largestFree, largestBlock int64
	pools := map[string]int{}
	segs := 0
	for _, s := range gt.Segments {
		if s.Device != d {
			continue
		}
		segs++
		pools[s.SegmentType]++
		for _, b := range s.Blocks {
			switch b.State {
			case "active_allocated":
				allocated += int64(b.Size)
				largestBlock = max(largestBlock, int64(b.Size))
			case "inactive":
				free += int64(b.Size)
				largestFree = max(largestFree, int64(b.Size))
			}
		}
	}
	if ds.Allocated != allocated || ds.FreeBytes != free || ds.LargestFree != largestFree || ds.Segments != segs ||
		ds.Pools[0].Segments != pools["small"] || ds.Pools[1].Segments != pools["large"] {
		t.Errorf("end state: %+v; ground truth allocated %d free %d largest free %d, %d segments %v", ds, allocated, free, largestFree, segs, pools)
	}
	if free > 0 {
		if frag := 1 - float64(largestFree)/float64(free); ds.Fragmentation != frag {
			t.Errorf("fragmentation %v, want %v", ds.Fragmentation, frag)
		}
	}
	if largestBlock > 0 && (len(ds.LargestBlocks) == 0 || ds.LargestBlocks[0].Size != largestBlock) {
		t.Errorf("largest blocks %+v, want the first of %d bytes", ds.LargestBlocks, largestBlock)
	}
	if timed {
		wantTime := snapshot.FormatTimeUs(gt.DeviceTraces[d][want.peakReservedAt].TimeNs / 1000)
		if ds.PeakReserved.Time != wantTime {
			t.Errorf("peak reserved at %q, want %q", ds.PeakReserved.Time, wantTime)
		}
	} else if ds.PeakReserved.Time != "" {
		t.Errorf("untimed snapshot has a peak time %q", ds.PeakReserved.Time)
	}
}

func testStats(t *testing.T, f *toolFiles) {
	// The torch_npu pickle (no time) and the timed snapshot give the same
	// numbers; both equal an independent replay of the ground truth.
	for _, c := range []struct {
		path  string
		gt    *fixture.TorchGroundTruth
		dev   int
		timed bool
	}{
		{f.churn.Pickle, f.churn.GT, 0, false},
		{f.churnTimed, f.churn.GT, 0, true},
		{f.trans.Pickle, f.trans.GT, 1, false},
		{f.transTimed, f.trans.GT, 1, true},
	} {
		st := statsJSON(t, c.path)
		if len(st.Devices) != 1 {
			t.Errorf("%s: %d devices", c.path, len(st.Devices))
		}
		checkStatsAgainst(t, deviceOf(t, st, c.dev), c.gt, c.dev, c.timed)
	}
	if st := statsJSON(t, f.churn.Pickle); deviceOf(t, st, 0).Events["oom"] != 1 {
		t.Errorf("churn has %d ooms, want 1", deviceOf(t, st, 0).Events["oom"])
	}

	// The text form carries the same numbers, the time span and the loss counters.
	text := mustRun(t, "stats", f.churnTimed)
	want := replayGroundTruth(f.churn.GT, 0)
	gt := f.churn.GT.DeviceTraces[0]
	for _, line := range []string{
		fmt.Sprintf("  reserved        %s in ", snapshot.Bytes(want.reserved)),
		fmt.Sprintf("  peak reserved   %s after entry %d, at %s", snapshot.Bytes(want.peakReserved), want.peakReservedAt,
			snapshot.FormatTimeUs(gt[want.peakReservedAt].TimeNs/1000)),
		fmt.Sprintf("  peak allocated  %s after entry %d", snapshot.Bytes(want.peakAllocated), want.peakAllocatedAt),
		fmt.Sprintf("time span: %s .. %s", snapshot.FormatTimeUs(gt[0].TimeNs/1000), snapshot.FormatTimeUs(gt[len(gt)-1].TimeNs/1000)),
		"npuprobe loss counters: npuprobe_dropped_events 0, npuprobe_loss.ring_buffer_full 0, npuprobe_loss.sequence_gaps 2",
		"  segments        small ",
		"  fragmentation   ",
		"  largest blocks\n",
		fmt.Sprintf("oom %d", want.events["oom"]),
	} {
		if !strings.Contains(text, line) {
			t.Errorf("stats output lacks %q:\n%s", line, text)
		}
	}
	if text := mustRun(t, "stats", f.churn.Pickle); !strings.Contains(text, "time span: unknown (no time_us") {
		t.Errorf("untimed stats:\n%s", text)
	}
}

func testMerge(t *testing.T, f *toolFiles) {
	out := filepath.Join(t.TempDir(), "merged.pickle")
	// Arguments in the "wrong" order: the ranks put the transformer
	// (RANK "0", its device 1) first.
	msg := mustRun(t, "merge", "-o", out, f.churnTimed, f.transTimed)
	if !strings.Contains(msg, "devices in rank order") || !strings.Contains(msg, "device 0: rank 0, transformer-timed.pickle device 1") ||
		!strings.Contains(msg, "device 1: rank 1, churn-timed.pickle device 0") {
		t.Errorf("merge said:\n%s", msg)
	}
	check(t, out, snapshotcheck.Options{ExpectTime: true})
	m, err := snapshot.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	churn, _ := snapshot.ReadFile(f.churnTimed)
	trans, _ := snapshot.ReadFile(f.transTimed)
	if len(m.DeviceTraces) != 2 {
		t.Fatalf("%d devices", len(m.DeviceTraces))
	}
	sameTrace := func(got, want []snapshot.TraceEntry) bool {
		if len(got) != len(want) {
			return false
		}
		for i := range got {
			if got[i].Action != want[i].Action || got[i].AddrOrFree() != want[i].AddrOrFree() || got[i].TimeUs != want[i].TimeUs {
				return false
			}
		}
		return true
	}
	if !sameTrace(m.DeviceTraces[0], trans.DeviceTraces[1]) || !sameTrace(m.DeviceTraces[1], churn.DeviceTraces[0]) {
		t.Error("traces are not at their rank's device")
	}
	perDev := map[int]int{}
	for _, s := range m.Segments {
		perDev[s.Device]++
	}
	if perDev[0] != len(trans.Segments) || perDev[1] != len(churn.Segments) || len(m.Segments) != len(trans.Segments)+len(churn.Segments) {
		t.Errorf("segments per device %v, want %d and %d", perDev, len(trans.Segments), len(churn.Segments))
	}
	mergeSetting, _ := m.Setting("npuprobe_merge")
	md, _ := mergeSetting.(*snapshot.Dict)
	devs, _ := md.Get("devices")
	list, _ := devs.(snapshot.List)
	if order, _ := md.Get("order"); order != "rank" || len(list) != 2 {
		t.Fatalf("npuprobe_merge = %#v", mergeSetting)
	}
	first := list[0].(*snapshot.Dict)
	if r, _ := first.Get("rank"); r != int64(0) {
		t.Errorf("device 0 has rank %v", r)
	}
	if sd, _ := first.Get("source_device"); sd != int64(1) {
		t.Errorf("device 0 comes from device %v", sd)
	}
	// Stats of the merged file per device equal each rank's own.
	st := statsJSON(t, out)
	checkStatsAgainst(t, deviceOf(t, st, 0), f.trans.GT, 1, true)
	checkStatsAgainst(t, deviceOf(t, st, 1), f.churn.GT, 0, true)

	// A file naming no rank: argument order, said so.
	out2 := filepath.Join(t.TempDir(), "merged2.pickle")
	msg = mustRun(t, "merge", "-o", out2, f.churn.Pickle, f.transTimed)
	if !strings.Contains(msg, "devices in argument order (torch_npu.pickle names no rank") ||
		!strings.Contains(msg, "device 0: no rank, torch_npu.pickle device 0") {
		t.Errorf("merge said:\n%s", msg)
	}
	check(t, out2, snapshotcheck.Options{})
}

func check(t *testing.T, path string, opts snapshotcheck.Options) {
	t.Helper()
	res, err := snapshotcheck.Check(t.Context(), path, opts)
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK {
		t.Fatalf("check_snapshot.py rejects %s:\n%s", path, strings.Join(res.Problems, "\n"))
	}
}

func testAugmentCLI(t *testing.T, f *toolFiles) {
	out := filepath.Join(t.TempDir(), "augmented.pickle")
	msg := mustRun(t, "augment", "--torch-snapshot", f.churn.Pickle, "--recording", f.churnTimed, "-o", out)
	n := len(f.churn.GT.DeviceTraces[0])
	if !strings.Contains(msg, fmt.Sprintf("%d trace entries: %d matched exactly", n, n)) || !strings.Contains(msg, "wrote "+out) {
		t.Errorf("augment said:\n%s", msg)
	}
	check(t, out, snapshotcheck.Options{ExpectTime: true})
	a, err := snapshot.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range a.DeviceTraces[0] {
		if want := f.churn.GT.DeviceTraces[0][i].TimeNs / 1000; e.TimeUs.V != want {
			t.Fatalf("entry %d: time_us %d, recording %d", i, e.TimeUs.V, want)
		}
	}
	if code, _, errs := runTool(t, "augment", "--torch-snapshot", f.churn.Pickle, "-o", out); code != exitUsage || !strings.Contains(errs, "--recording FILE is required") {
		t.Errorf("without --recording: exit %d, %q", code, errs)
	}
}

func testPlot(t *testing.T, f *toolFiles) {
	browser := chromium(t)
	dir := t.TempDir()
	page := filepath.Join(dir, "churn.html")
	if out := mustRun(t, "plot", f.churnTimed, "-o", page); !strings.Contains(out, "wrote "+page) {
		t.Errorf("plot said %q", out)
	}
	html, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	checkOffline(t, string(html))

	img := screenshot(t, browser, page)
	// The plot area: the first chart's #fafafa background.
	area := plotArea(img, rgb("#fafafa"), 100)
	if area.Dx() < 900 || area.Dy() < 200 {
		t.Fatalf("plot area %v not found in the screenshot (page not rendered?)", area)
	}
	area = area.Inset(-3)
	count := func(c string) (n int, meanY float64, xs map[int]int) {
		xs = map[int]int{}
		for y := area.Min.Y; y < area.Max.Y; y++ {
			for x := area.Min.X; x < area.Max.X; x++ {
				if near(img, x, y, rgb(c), 40) {
					n++
					meanY += float64(y)
					xs[x]++
				}
			}
		}
		if n > 0 {
			meanY /= float64(n)
		}
		return
	}
	nRes, yRes, _ := count(snapshot.ColorReserved)
	nAlloc, yAlloc, _ := count(snapshot.ColorAllocated)
	nOOM, _, oomXs := count(snapshot.ColorOOM)
	t.Logf("plot area %v: %d reserved pixels (mean y %.0f), %d allocated (mean y %.0f), %d oom", area, nRes, yRes, nAlloc, yAlloc, nOOM)
	if nRes < 800 || nAlloc < 800 {
		t.Errorf("lines missing: %d reserved and %d allocated pixels in the plot area", nRes, nAlloc)
	}
	if yRes >= yAlloc {
		t.Errorf("the reserved line (mean y %.0f) is not above the allocated one (mean y %.0f)", yRes, yAlloc)
	}
	// The oom marker: a red column where the oom happened.
	gt := f.churn.GT.DeviceTraces[0]
	var oomAt int64
	for _, e := range gt {
		if e.Action == "oom" {
			oomAt = e.TimeNs / 1000
		}
	}
	t0, t1 := gt[0].TimeNs/1000, gt[len(gt)-1].TimeNs/1000
	wantX := area.Min.X + 3 + int(float64(oomAt-t0)/float64(t1-t0)*float64(area.Dx()-6))
	inColumn := 0
	for x, n := range oomXs {
		if abs(x-wantX) <= 3 {
			inColumn += n
		}
	}
	if nOOM < 60 || inColumn < nOOM*9/10 {
		t.Errorf("oom marker: %d red pixels, %d of them within 3 px of x=%d", nOOM, inColumn, wantX)
	}
	// Outside the plot area the legend shows every colour too.
	for _, c := range []string{snapshot.ColorReserved, snapshot.ColorAllocated, snapshot.ColorOOM} {
		found := false
		for y := 0; y < area.Min.Y && !found; y++ {
			for x := 0; x < img.Bounds().Dx() && !found; x++ {
				found = near(img, x, y, rgb(c), 10)
			}
		}
		if !found {
			t.Errorf("legend colour %s not above the plot", c)
		}
	}
	// The table of the largest live blocks at the peak.
	if !strings.Contains(string(html), "Largest live blocks at the allocated peak") || strings.Count(string(html), `class="bar"`) == 0 {
		t.Error("no table of the largest live blocks")
	}
	if bars := greenBars(img, area); bars == 0 {
		t.Log("no block bar inside the first screen (below the fold); the HTML has them")
	}

	// Untimed torch_npu pickle, merged file: pages render their devices
	// (x axis by entry index).
	merged := filepath.Join(dir, "merged.pickle")
	mustRun(t, "merge", "-o", merged, f.churn.Pickle, f.transTimed)
	for _, in := range []string{f.churn.Pickle, merged} {
		p := filepath.Join(dir, filepath.Base(in)+".html")
		mustRun(t, "plot", in, "-o", p)
		h, _ := os.ReadFile(p)
		checkOffline(t, string(h))
		if in == f.churn.Pickle && !strings.Contains(string(h), "trace entry (no time_us in this snapshot)") {
			t.Error("untimed page does not say its x axis is the entry index")
		}
		if in == merged && (!strings.Contains(string(h), "Device 1 — rank 0 (transformer-timed.pickle, device 1)") || strings.Count(string(h), "<svg") != 2) {
			t.Error("merged page lacks its two labelled devices")
		}
	}
}

func greenBars(img image.Image, area image.Rectangle) int {
	n := 0
	for y := area.Max.Y; y < img.Bounds().Max.Y; y++ {
		for x := 0; x < img.Bounds().Max.X; x++ {
			if near(img, x, y, rgb(snapshot.ColorBlock), 10) {
				n++
			}
		}
	}
	return n
}

var (
	cspRE   = regexp.MustCompile(`<meta http-equiv="Content-Security-Policy" content="default-src 'none'; [^"]*">`)
	fetchRE = regexp.MustCompile(`(?i)https?://|\bsrc\s*=|\bhref\s*=|@import|url\(|<link|<iframe|<object|<embed|fetch\(|XMLHttpRequest|WebSocket|import\(`)
)

// checkOffline requires the page to forbid every fetch and to reference
// nothing outside itself.
func checkOffline(t *testing.T, html string) {
	t.Helper()
	if !cspRE.MatchString(html) {
		t.Error("no Content-Security-Policy with default-src 'none'")
	}
	if m := fetchRE.FindAllString(html, -1); len(m) > 0 {
		t.Errorf("the page references outside resources: %q", m)
	}
}

func testBadFiles(t *testing.T, f *toolFiles) {
	dir := t.TempDir()
	good, err := os.ReadFile(f.churn.Pickle)
	if err != nil {
		t.Fatal(err)
	}
	proto5 := append([]byte(nil), good...)
	proto5[1] = 5
	bad := map[string][]byte{
		"truncated.pickle": good[:len(good)/2],
		"proto5.pickle":    proto5,
		"list.pickle":      []byte("\x80\x04]\x94."),
		"garbage.pickle":   []byte("garbage\x00\x01"),
	}
	jsonFile := f.churn.JSON
	var files []string
	for name, data := range bad {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, p)
	}
	files = append(files, jsonFile)
	wantMsg := map[string]string{
		"truncated.pickle": "truncated pickle", "proto5.pickle": "pickle protocol 5", "list.pickle": "not a memory snapshot",
		"garbage.pickle": "not a pickle", filepath.Base(jsonFile): "looks like JSON",
	}
	outFile := filepath.Join(dir, "out")
	for _, file := range files {
		for _, args := range [][]string{
			{"stats", file},
			{"stats", "--json", file},
			{"plot", file, "-o", outFile + ".html"},
			{"merge", "-o", outFile + ".pickle", f.churnTimed, file},
			{"augment", "--torch-snapshot", file, "--recording", f.churnTimed, "-o", outFile + ".pickle"},
			{"augment", "--torch-snapshot", f.churn.Pickle, "--recording", file, "-o", outFile + ".pickle"},
		} {
			code, stdout, stderr := runTool(t, args...)
			lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
			if code != 1 || stdout != "" || len(lines) != 1 || !strings.HasPrefix(lines[0], "npuprobe: "+file+": ") ||
				!strings.Contains(lines[0], wantMsg[filepath.Base(file)]) {
				t.Errorf("npuprobe %s: exit %d, stdout %q, stderr %q", strings.Join(args, " "), code, stdout, stderr)
			}
		}
	}
	for _, p := range []string{outFile + ".html", outFile + ".pickle"} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s written despite the error", p)
		}
	}
	// The binary itself exits 1 with the same line.
	bin := filepath.Join(dir, "npuprobe")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "stats", files[0])
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || strings.Count(stderr.String(), "\n") != 1 {
		t.Errorf("npuprobe stats %s: %v, stderr %q", files[0], err, stderr.String())
	}
}
