package snapshot

import (
	"fmt"
	"html/template"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
)

// Plot colours, also checked by the screenshot test.
const (
	ColorReserved  = "#1f77b4" // blue
	ColorAllocated = "#ff7f0e" // orange
	ColorOOM       = "#d62728" // red
	ColorBlock     = "#2ca02c" // green bars of the largest live blocks
)

// Chart geometry, in CSS pixels.
const (
	chartWidth   = 1100
	chartHeight  = 300
	marginLeft   = 90
	marginRight  = 20
	marginTop    = 14
	marginBottom = 40
	plotWidth    = chartWidth - marginLeft - marginRight
	plotHeight   = chartHeight - marginTop - marginBottom
	// LiveBlocks is how many of the largest live blocks the page lists.
	LiveBlocks = 10
)

// Plot writes a self-contained HTML page: per device, reserved and
// allocated memory over time (x = time_us when every entry has one, else
// the entry index), OOM markers, and the largest live blocks at the
// allocated peak (at the reserved peak, as segments, when the trace has no
// tensor entries). Everything is inline (SVG, CSS, a few lines of script);
// a Content-Security-Policy forbids any fetch.
func Plot(w io.Writer, s *Snapshot, name string) error {
	page := plotPage{Title: name, Summary: plotSummary(s)}
	for _, d := range s.UsedDevices() {
		page.Devices = append(page.Devices, plotDevice(s, d))
	}
	if len(page.Devices) == 0 {
		page.Empty = true
	}
	return pageTemplate.Execute(w, page)
}

type plotPage struct {
	Title   string
	Summary string
	Empty   bool
	Devices []*devicePlot
}

type devicePlot struct {
	Device    int
	Label     string
	XLabel    string
	Reserved  string // polyline points
	Allocated string
	OOMs      []oomMark
	XTicks    []tick
	YTicks    []tick
	PeakX     float64
	PeakY     float64
	PeakText  string
	LiveTitle string
	Live      []liveRow
	Columns   [][4]float64 // px, x value, reserved, allocated: for the hover readout
	Timed     bool
	Start     int64
}

type oomMark struct {
	X     float64
	Title string
}

type tick struct {
	Pos   float64
	Label string
}

type liveRow struct {
	Rank    int
	Size    string
	Bytes   int64
	Address string
	Note    string
	Percent float64
}

func plotSummary(s *Snapshot) string {
	entries := 0
	for _, tr := range s.DeviceTraces {
		entries += len(tr)
	}
	return fmt.Sprintf("%s, %s, %s", plural(len(s.UsedDevices()), "device"), plural(len(s.Segments), "segment"), plural(entries, "trace entry"))
}

// deviceLabel names a device, with its rank and source after a merge.
func deviceLabel(s *Snapshot, d int) string {
	label := fmt.Sprintf("Device %d", d)
	v, ok := s.Setting("npuprobe_merge")
	if !ok {
		return label
	}
	m, ok := v.(*Dict)
	if !ok {
		return label
	}
	devs, _ := m.Get("devices")
	list, _ := devs.(List)
	for _, it := range list {
		dd, ok := it.(*Dict)
		if !ok {
			continue
		}
		if dev, _ := dd.Get("device"); dev != int64(d) {
			continue
		}
		if r, _ := dd.Get("rank"); r != nil {
			label += fmt.Sprintf(" — rank %v", r)
		}
		if src, _ := dd.Get("source"); src != nil {
			label += fmt.Sprintf(" (%v", src)
			if sd, _ := dd.Get("source_device"); sd != nil {
				label += fmt.Sprintf(", device %v", sd)
			}
			label += ")"
		}
	}
	return label
}

func plotDevice(s *Snapshot, d int) *devicePlot {
	se := Replay(s, d)
	n := len(se.Reserved) - 1 // entries
	p := &devicePlot{Device: d, Label: deviceLabel(s, d), Timed: se.TimeUs != nil}
	// x of level k (after entry k-1; level 0 before the first entry).
	xOf := func(k int) float64 {
		if p.Timed {
			return float64(se.TimeUs[max(k-1, 0)])
		}
		return float64(k)
	}
	xmin, xmax := xOf(0), xOf(n)
	if xmax <= xmin {
		xmax = xmin + 1
	}
	var ymax int64 = 1
	for k := range se.Reserved {
		ymax = max(ymax, se.Reserved[k], se.Allocated[k])
	}
	yTop := niceCeil(float64(ymax) * 1.05)
	px := func(x float64) float64 { return marginLeft + (x-xmin)/(xmax-xmin)*plotWidth }
	py := func(v int64) float64 { return marginTop + plotHeight - float64(v)/yTop*plotHeight }
	p.Reserved = stepLine(se.Reserved, xOf, px, py)
	p.Allocated = stepLine(se.Allocated, xOf, px, py)
	p.Columns = columns(se, xOf, px)
	if p.Timed {
		p.Start = se.TimeUs[0]
		p.XLabel = "time since " + FormatTimeUs(se.TimeUs[0]) + " (UTC)"
	} else {
		p.XLabel = "trace entry (no time_us in this snapshot)"
	}
	p.XTicks = xTicks(xmin, xmax, p.Timed, px)
	for _, v := range niceTicks(yTop) {
		p.YTicks = append(p.YTicks, tick{Pos: round1(py(int64(v))), Label: tickBytes(v, yTop)})
	}
	var tr []TraceEntry
	if d < len(s.DeviceTraces) {
		tr = s.DeviceTraces[d]
	}
	for _, k := range se.OOMs {
		e := &tr[k]
		p.OOMs = append(p.OOMs, oomMark{X: round1(px(xOf(k + 1))),
			Title: fmt.Sprintf("oom at entry %d: %s requested, %s free on the device", k, ShortBytes(e.Size), ShortBytes(e.DeviceFree.V))})
	}
	peak := peakOf(se.Allocated, se.TimeUs)
	tensor := false
	for i := range tr {
		if tensorActions[tr[i].Action] {
			tensor = true
			break
		}
	}
	if !tensor && peak.Level == 0 {
		// No tensor entries: the segments live at the reserved peak.
		rp := peakOf(se.Reserved, se.TimeUs)
		p.PeakX, p.PeakY = round1(px(xOf(rp.Index+1))), round1(py(rp.Level))
		p.PeakText = "reserved peak " + ShortBytes(rp.Level) + where(rp)
		p.LiveTitle = "Largest live segments at the reserved peak"
		p.Live = liveRows(liveSegments(s, d, rp.Index+1), "segment")
	} else {
		p.PeakX, p.PeakY = round1(px(xOf(peak.Index+1))), round1(py(peak.Level))
		p.PeakText = "allocated peak " + ShortBytes(peak.Level) + where(peak)
		p.LiveTitle = "Largest live blocks at the allocated peak (requested bytes)"
		p.Live = liveRows(liveBlocks(s, d, peak.Index+1), "")
	}
	return p
}

func where(p Peak) string {
	switch {
	case p.Index < 0:
		return " before the first entry"
	case p.Time != "":
		return fmt.Sprintf(" after entry %d, at %s", p.Index, p.Time)
	}
	return fmt.Sprintf(" after entry %d", p.Index)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	if strings.HasSuffix(what, "y") {
		return fmt.Sprintf("%d %sies", n, what[:len(what)-1])
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func round1(v float64) float64 { return math.Round(v*10) / 10 }

// stepLine draws levels as a step function, at most a few points per
// pixel column: per column the level entering it, then its minimum,
// maximum and last level.
func stepLine(levels []int64, xOf func(int) float64, px func(float64) float64, py func(int64) float64) string {
	var b strings.Builder
	pt := func(x float64, v int64) {
		b.WriteString(strconv.FormatFloat(round1(x), 'f', -1, 64))
		b.WriteByte(',')
		b.WriteString(strconv.FormatFloat(round1(py(v)), 'f', -1, 64))
		b.WriteByte(' ')
	}
	col := math.Inf(-1)
	var lo, hi, last, prev int64
	flush := func() {
		if math.IsInf(col, -1) {
			return
		}
		pt(col, prev)
		pt(col, lo)
		pt(col, hi)
		pt(col, last)
	}
	for k, v := range levels {
		c := math.Floor(px(xOf(k)))
		if c != col {
			flush()
			if !math.IsInf(col, -1) {
				prev = last
			} else {
				prev = v
			}
			col, lo, hi = c, v, v
		}
		lo, hi, last = min(lo, v), max(hi, v), v
	}
	flush()
	// Hold the last level to the right edge.
	pt(marginLeft+plotWidth, last)
	return strings.TrimSpace(b.String())
}

// columns gives the hover readout its data: per pixel column, the last
// level in it.
func columns(se *Series, xOf func(int) float64, px func(float64) float64) [][4]float64 {
	var out [][4]float64
	for k := range se.Reserved {
		c := math.Floor(px(xOf(k)))
		row := [4]float64{c, xOf(k), float64(se.Reserved[k]), float64(se.Allocated[k])}
		if len(out) > 0 && out[len(out)-1][0] == c {
			out[len(out)-1] = row
		} else {
			out = append(out, row)
		}
	}
	return out
}

// niceCeil rounds v up to 1, 2 or 5 times a power of 1024 or 10.
func niceCeil(v float64) float64 {
	if v <= 1 {
		return 1
	}
	unit := 1.0
	for unit*1024 <= v {
		unit *= 1024
	}
	x := v / unit
	mag := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*mag >= x {
			return m * mag * unit
		}
	}
	return 10 * mag * unit
}

// niceTicks divides [0, top] (a niceCeil value) into 4 or 5 steps that are
// round in the unit of top.
func niceTicks(top float64) []float64 {
	unit := 1.0
	for unit*1024 <= top {
		unit *= 1024
	}
	x := top / unit
	steps := 5
	if q := x / 4; isNice(q) {
		steps = 4
	}
	out := make([]float64, 0, steps+1)
	for i := 0; i <= steps; i++ {
		out = append(out, top*float64(i)/float64(steps))
	}
	return out
}

// isNice reports whether v is 1, 2, 2.5 or 5 times a power of ten.
func isNice(v float64) bool {
	if v <= 0 {
		return false
	}
	m := v / math.Pow(10, math.Floor(math.Log10(v)+1e-9))
	for _, n := range []float64{1, 2, 2.5, 5} {
		if math.Abs(m-n) < 1e-9 {
			return true
		}
	}
	return false
}

// tickBytes labels a byte tick in the unit of the axis top, without
// trailing zeros: "512 MiB", "1.5 GiB".
func tickBytes(v, top float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	unit, i := 1.0, 0
	for unit*1024 <= top && i < len(units)-1 {
		unit *= 1024
		i++
	}
	if v != 0 && v < unit {
		unit /= 1024
		i--
	}
	if v == 0 {
		return "0"
	}
	return strconv.FormatFloat(math.Round(v/unit*100)/100, 'f', -1, 64) + " " + units[i]
}

func xTicks(xmin, xmax float64, timed bool, px func(float64) float64) []tick {
	span := xmax - xmin
	step := niceStep(span / 6)
	var out []tick
	for v := math.Ceil(0/step) * step; v <= span+step/1e6; v += step {
		label := strconv.FormatFloat(v, 'f', -1, 64)
		if timed {
			switch {
			case step < 1e3:
				label = strconv.FormatFloat(v, 'f', -1, 64) + " µs"
			case step < 1e6:
				label = strconv.FormatFloat(math.Round(v)/1e3, 'f', -1, 64) + " ms"
			default:
				label = strconv.FormatFloat(math.Round(v/1e3)/1e3, 'f', -1, 64) + " s"
			}
		}
		out = append(out, tick{Pos: round1(px(xmin + v)), Label: label})
	}
	return out
}

func niceStep(v float64) float64 {
	if v <= 0 {
		return 1
	}
	mag := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*mag >= v {
			return max(m*mag, 1)
		}
	}
	return 10 * mag
}

type live struct {
	addr, size int64
	note       string
}

// liveBlocks returns the blocks live after level index L (after entry
// L-1): the end state's active blocks with entries L.. undone (an alloc
// removes its block, a free_completed brings it back with its size).
func liveBlocks(s *Snapshot, d, L int) []live {
	m := map[int64]live{}
	for i := range s.Segments {
		seg := &s.Segments[i]
		if seg.Device != d {
			continue
		}
		addr := seg.Address
		for j := range seg.Blocks {
			b := &seg.Blocks[j]
			if b.Address.Set {
				addr = b.Address.V
			}
			if b.IsActive() {
				m[addr] = live{addr, b.RequestedSize.V, "live at the end"}
			}
			addr += b.Size
		}
	}
	if d < len(s.DeviceTraces) {
		tr := s.DeviceTraces[d]
		for k := len(tr) - 1; k >= L; k-- {
			e := &tr[k]
			switch e.Action {
			case ActionAlloc:
				delete(m, e.Addr.V)
			case ActionFreeCompleted:
				m[e.Addr.V] = live{e.Addr.V, e.Size, "freed later"}
			}
		}
	}
	return sortLive(m)
}

// liveSegments is liveBlocks for segments.
func liveSegments(s *Snapshot, d, L int) []live {
	m := map[int64]live{}
	for i := range s.Segments {
		seg := &s.Segments[i]
		if seg.Device == d {
			m[seg.Address] = live{seg.Address, seg.TotalSize, poolOf(seg)}
		}
	}
	if d < len(s.DeviceTraces) {
		tr := s.DeviceTraces[d]
		for k := len(tr) - 1; k >= L; k-- {
			e := &tr[k]
			switch e.Action {
			case ActionSegmentAlloc, ActionSegmentMap:
				delete(m, e.Addr.V)
			case ActionSegmentFree, ActionSegmentUnmap:
				if e.Size > 0 {
					m[e.Addr.V] = live{e.Addr.V, e.Size, "freed later"}
				}
			}
		}
	}
	return sortLive(m)
}

func sortLive(m map[int64]live) []live {
	out := make([]live, 0, len(m))
	for _, l := range m {
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].size != out[j].size {
			return out[i].size > out[j].size
		}
		return out[i].addr < out[j].addr
	})
	return out
}

func liveRows(ls []live, note string) []liveRow {
	if len(ls) > LiveBlocks {
		ls = ls[:LiveBlocks]
	}
	var rows []liveRow
	for i, l := range ls {
		pct := 0.0
		if ls[0].size > 0 {
			pct = math.Max(0.5, 100*float64(l.size)/float64(ls[0].size))
		}
		n := l.note
		if note != "" && n == "" {
			n = note
		}
		rows = append(rows, liveRow{Rank: i + 1, Size: ShortBytes(l.size), Bytes: l.size, Address: fmt.Sprintf("%#x", l.addr), Note: n, Percent: round1(pct)})
	}
	return rows
}

var pageTemplate = template.Must(template.New("page").Parse(`<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<meta name="referrer" content="no-referrer">
<title>{{.Title}} — npuprobe memory plot</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 12px 20px; color: #222; background: #fff; }
h1 { font-size: 17px; margin: 0 0 2px; }
h2 { font-size: 15px; margin: 14px 0 2px; }
.sub { color: #555; margin: 0 0 6px; }
.legend span { display: inline-block; margin-right: 16px; }
.sw { display: inline-block; width: 18px; height: 3px; vertical-align: middle; margin-right: 5px; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
.readout { color: #333; min-height: 1.4em; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; margin: 4px 0 10px; }
td, th { padding: 1px 8px; text-align: left; font-variant-numeric: tabular-nums; }
th { color: #555; font-weight: 600; border-bottom: 1px solid #ccc; }
td.num { text-align: right; }
.bar { height: 10px; background: ` + ColorBlock + `; }
</style>
</head>
<body>
<h1>{{.Title}}</h1>
<p class="sub">{{.Summary}} · drop the pickle on pytorch.org/memory_viz for the full views</p>
<p class="legend"><span><i class="sw" style="background:` + ColorReserved + `"></i>reserved (segments)</span><span><i class="sw" style="background:` + ColorAllocated + `"></i>allocated (requested bytes of live tensors)</span><span><i class="sw" style="background:` + ColorOOM + `"></i>OOM</span></p>
{{if .Empty}}<p>This snapshot has no segments and no trace entries.</p>{{end}}
{{range .Devices}}
<section id="device-{{.Device}}">
<h2>{{.Label}}</h2>
<p class="sub">{{.PeakText}}</p>
<svg class="chart" data-device="{{.Device}}" width="` + strconv.Itoa(chartWidth) + `" height="` + strconv.Itoa(chartHeight) + `" viewBox="0 0 ` + strconv.Itoa(chartWidth) + ` ` + strconv.Itoa(chartHeight) + `" role="img">
<rect x="` + strconv.Itoa(marginLeft) + `" y="` + strconv.Itoa(marginTop) + `" width="` + strconv.Itoa(plotWidth) + `" height="` + strconv.Itoa(plotHeight) + `" fill="#fafafa" stroke="#bbb"/>
{{range .YTicks}}<line x1="` + strconv.Itoa(marginLeft) + `" x2="` + strconv.Itoa(marginLeft+plotWidth) + `" y1="{{.Pos}}" y2="{{.Pos}}" stroke="#e3e3e3"/><text x="` + strconv.Itoa(marginLeft-6) + `" y="{{.Pos}}" text-anchor="end" dominant-baseline="middle">{{.Label}}</text>
{{end}}{{range .XTicks}}<line x1="{{.Pos}}" x2="{{.Pos}}" y1="` + strconv.Itoa(marginTop+plotHeight) + `" y2="` + strconv.Itoa(marginTop+plotHeight+5) + `" stroke="#888"/><text x="{{.Pos}}" y="` + strconv.Itoa(marginTop+plotHeight+17) + `" text-anchor="middle">{{.Label}}</text>
{{end}}<text x="` + strconv.Itoa(marginLeft+plotWidth/2) + `" y="` + strconv.Itoa(chartHeight-4) + `" text-anchor="middle">{{.XLabel}}</text>
{{range .OOMs}}<g class="oom"><title>{{.Title}}</title><line x1="{{.X}}" x2="{{.X}}" y1="` + strconv.Itoa(marginTop) + `" y2="` + strconv.Itoa(marginTop+plotHeight) + `" stroke="` + ColorOOM + `" stroke-width="2" stroke-dasharray="5,3"/><path d="M{{.X}},` + strconv.Itoa(marginTop) + ` l-7,-0 l7,12 l7,-12 z" fill="` + ColorOOM + `"/></g>
{{end}}<polyline class="reserved" fill="none" stroke="` + ColorReserved + `" stroke-width="2" stroke-linejoin="round" points="{{.Reserved}}"/>
<polyline class="allocated" fill="none" stroke="` + ColorAllocated + `" stroke-width="2" stroke-linejoin="round" points="{{.Allocated}}"/>
<circle cx="{{.PeakX}}" cy="{{.PeakY}}" r="4" fill="none" stroke="#222" stroke-width="1.5"><title>{{.PeakText}}</title></circle>
<line class="cursor" x1="0" x2="0" y1="` + strconv.Itoa(marginTop) + `" y2="` + strconv.Itoa(marginTop+plotHeight) + `" stroke="#666" stroke-width="1" visibility="hidden"/>
</svg>
<div class="readout" id="readout-{{.Device}}">&nbsp;</div>
<h2>{{.LiveTitle}}</h2>
{{if .Live}}<table>
<tr><th>#</th><th>size</th><th>address</th><th></th><th style="width:420px"></th></tr>
{{range .Live}}<tr><td class="num">{{.Rank}}</td><td class="num" title="{{.Bytes}} B">{{.Size}}</td><td>{{.Address}}</td><td>{{.Note}}</td><td><div class="bar" style="width:{{.Percent}}%"></div></td></tr>
{{end}}</table>{{else}}<p class="sub">none</p>{{end}}
</section>
{{end}}
<script>
"use strict";
const devices = [{{range .Devices}}{device: {{.Device}}, timed: {{.Timed}}, start: {{.Start}}, cols: {{.Columns}}},{{end}}];
function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(2) : n.toFixed(0)) + " " + u[i];
}
for (const dev of devices) {
  const svg = document.querySelector('svg[data-device="' + dev.device + '"]');
  const cursor = svg.querySelector(".cursor");
  const out = document.getElementById("readout-" + dev.device);
  svg.addEventListener("mousemove", (ev) => {
    const r = svg.getBoundingClientRect();
    const x = (ev.clientX - r.left) * ` + strconv.Itoa(chartWidth) + ` / r.width;
    let best = null;
    for (const c of dev.cols) { if (c[0] <= x) best = c; else break; }
    if (!best) { cursor.setAttribute("visibility", "hidden"); return; }
    cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
    const when = dev.timed ? new Date(best[1] / 1000).toISOString() : "entry " + best[1];
    out.textContent = when + "  reserved " + fmtBytes(best[2]) + "  allocated " + fmtBytes(best[3]);
  });
  svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); });
}
</script>
</body>
</html>
`))
