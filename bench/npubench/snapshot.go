package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/bench"
	"github.com/npuprobe/npuprobe/clock"
	"github.com/npuprobe/npuprobe/output"
)

const (
	snapEntries  = 1_000_000
	snapSegments = 10_000
)

type pyResult struct {
	Python  string    `json:"python"`
	MedianS float64   `json:"median_s"`
	TimesS  []float64 `json:"times_s"`
	Bytes   int64     `json:"bytes"`
}

// snapshotWrite times output.WriteSnapshot against python3's pickle.dump
// of the same dict (checked equal by loading npuprobe's file in Python).
func (b *bencher) snapshotWrite(reps int) ([]row, error) {
	dir, err := os.MkdirTemp(b.tmp, "snap-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	snap, settings := bench.SyntheticSnapshot(snapEntries, snapSegments, 1)
	blocks := 0
	for _, s := range snap.Segments {
		blocks += len(s.Blocks)
	}
	ours := filepath.Join(dir, "npuprobe.pickle")
	var times []float64
	for range reps {
		f, err := os.Create(ours)
		if err != nil {
			return nil, err
		}
		t0 := time.Now()
		err = output.WriteSnapshot(f, snap, settings)
		el := time.Since(t0)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, err
		}
		times = append(times, el.Seconds())
	}
	st, err := os.Stat(ours)
	if err != nil {
		return nil, err
	}
	jsonPath := filepath.Join(dir, "snapshot.json")
	jf, err := os.Create(jsonPath)
	if err != nil {
		return nil, err
	}
	if err := bench.WriteSnapshotJSON(jf, snap, settings); err != nil {
		return nil, err
	}
	jf.Close()
	snap = nil
	runtime.GC()
	cmd := exec.Command(b.python, b.pyScript, jsonPath, filepath.Join(dir, "python.pickle"), "--reps", strconv.Itoa(reps), "--verify", ours)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", b.pyScript, err)
	}
	var py pyResult
	if err := json.Unmarshal(out, &py); err != nil {
		return nil, fmt.Errorf("%s said %q: %w", b.pyScript, out, err)
	}
	ourMed := median(times)
	ratio := ourMed / py.MedianS
	var pyRatios []float64
	for _, t := range py.TimesS {
		pyRatios = append(pyRatios, ourMed/t)
	}
	b.logf("snapshot: npuprobe %.3fs (%v), python %s %.3fs (%v); %d vs %d bytes; %d blocks",
		ourMed, times, py.Python, py.MedianS, py.TimesS, st.Size(), py.Bytes, blocks)
	cmdline := fmt.Sprintf("go run ./bench/npubench snapshot --reps %d   (or: go test ./bench -run '^$' -bench WriteSnapshot)", reps)
	return []row{
		{
			Metric: fmt.Sprintf("snapshot write, 1 M entries + 10 k segments (%d blocks): npuprobe", blocks),
			Result: fmt.Sprintf("%.3f s (runs %s s)", ourMed, spread(times, 1, "")),
			Cmd:    cmdline,
		},
		{
			Metric: fmt.Sprintf("snapshot write: python3 %s pickle.dump(protocol=4) of the same dict", py.Python),
			Result: fmt.Sprintf("%.3f s (runs %s s)", py.MedianS, spread(py.TimesS, 1, "")),
			Cmd:    cmdline,
		},
		{
			Metric: "snapshot write: time ratio npuprobe ÷ python",
			Result: fmt.Sprintf("%.2f (against each python run %s)", ratio, spread(pyRatios, 1, "")),
			Goal:   "≤ 0.5", Met: metStr(ratio <= 0.5), Cmd: cmdline,
		},
		{
			Metric: "snapshot file size npuprobe ÷ python",
			Result: fmt.Sprintf("%.3f (%.1f MB vs %.1f MB)", float64(st.Size())/float64(py.Bytes), float64(st.Size())/1e6, float64(py.Bytes)/1e6),
			Goal:   "≤ 1", Met: metStr(st.Size() <= py.Bytes), Cmd: cmdline,
		},
	}, nil
}

// memResult is what the memory child reports.
type memResult struct {
	Entries        int     `json:"entries"`
	Events         int     `json:"events"`
	BaseRSS        int64   `json:"base_rss"`
	HWM            int64   `json:"hwm"`
	HeapPeak       uint64  `json:"heap_peak"`
	HeapPeakIngest uint64  `json:"heap_peak_ingest"` // peak while the model took the events
	HeapBase       uint64  `json:"heap_base"`
	HeapAfterModel uint64  `json:"heap_after_model"`
	HeapPeakWrite  uint64  `json:"heap_peak_write"` // peak while the snapshot was written
	WriteS         float64 `json:"write_s"`
	GOGC           string  `json:"gogc"`
}

// memory runs the memory child (a fresh process, so VmHWM is its own) and
// reports npuprobe's peak memory per ring entry.
func (b *bencher) memory() ([]row, error) {
	var rows []row
	for _, gogc := range []string{"", "50"} {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cmd := exec.Command(self, "memchild", "--tmp", b.tmp)
		cmd.Env = os.Environ()
		if gogc != "" {
			cmd.Env = append(cmd.Env, "GOGC="+gogc)
		}
		cmd.Stderr = os.Stderr
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("memchild: %w", err)
		}
		var m memResult
		if err := json.Unmarshal(out, &m); err != nil {
			return nil, fmt.Errorf("memchild said %q: %w", out, err)
		}
		per := float64(m.HWM-m.BaseRSS) / float64(m.Entries)
		heapPer := float64(m.HeapPeak-m.HeapBase) / float64(m.Entries)
		label := "default GOGC"
		if gogc != "" {
			label = "GOGC=" + gogc
		}
		b.logf("memory (%s): %d entries; RSS peak %d MB over base %d MB; heap peak %d MB, after model %d MB, writing %d MB",
			label, m.Entries, (m.HWM-m.BaseRSS)>>20, m.BaseRSS>>20, (m.HeapPeak-m.HeapBase)>>20, (m.HeapAfterModel-m.HeapBase)>>20, (m.HeapPeakWrite-m.HeapBase)>>20)
		cmdline := "go run ./bench/npubench memory"
		rows = append(rows, row{
			Metric: fmt.Sprintf("peak memory per ring entry (model ring filled, then a snapshot written from it, %s): RSS", label),
			Result: fmt.Sprintf("%.0f bytes (VmHWM %d MB over a %d MB base, %d entries)", per, (m.HWM-m.BaseRSS)>>20, m.BaseRSS>>20, m.Entries),
			Goal:   "≤ 100", Met: metStr(per <= 100), Cmd: cmdline,
		}, row{
			Metric: fmt.Sprintf("peak memory per ring entry (%s): Go heap objects", label),
			Result: fmt.Sprintf("%.0f bytes (peak while ingesting %.0f; live after ingest %.0f; peak while writing %.0f)", heapPer,
				float64(m.HeapPeakIngest-m.HeapBase)/float64(m.Entries),
				float64(m.HeapAfterModel-m.HeapBase)/float64(m.Entries), float64(m.HeapPeakWrite-m.HeapBase)/float64(m.Entries)),
			Goal: "≤ 100", Met: metStr(heapPer <= 100), Cmd: cmdline,
		})
	}
	return rows, nil
}

func readStatusKB(key string) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n << 10
		}
	}
	return 0
}

func heapObjects() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// memChild fills a tensor-level model's default ring (1,000,000 entries,
// wrapped) and writes its snapshot straight from the rings, stamping as it
// goes, as cmd/npuprobe's writeSnapshot does, while sampling the Go heap.
// It prints a memResult.
func memChild(tmp string) error {
	runtime.GC()
	res := memResult{BaseRSS: readStatusKB("VmRSS"), HeapBase: heapObjects(), GOGC: os.Getenv("GOGC")}
	var peak atomic.Uint64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if h := heapObjects(); h > peak.Load() {
				peak.Store(h)
			}
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()

	m := bench.NewModel(allocmodel.LevelTensor)
	var buf []byte
	var ev allocmodel.Event
	var derr error
	// Enough events to fill and wrap the ring (tensor level makes about
	// 1.6 entries per event).
	bench.TensorEvents(800_000, 1, func(e *allocmodel.Event) {
		buf = bench.AppendRecord(buf[:0], e)
		if err := agent.DecodeRecord(buf, &ev); err != nil && derr == nil {
			derr = err
		}
		m.Apply(&ev)
		res.Events++
	})
	if derr != nil {
		return derr
	}
	res.HeapPeakIngest = peak.Load()
	runtime.GC()
	res.HeapAfterModel = heapObjects()

	tracker := clock.NewTracker(clock.System{}, clock.DefaultPairs)
	view := m.View()
	for d := range view.Devices() {
		res.Entries += view.TraceLen(d)
	}
	f, err := os.CreateTemp(tmp, "mem-*.pickle")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	peak.Store(0) // from here on: the write's peak
	t0 := time.Now()
	settings := []output.Setting{{Key: "npuprobe_version", Value: "bench"}}
	if err := output.WriteSnapshotFrom(f, output.ViewSource(view, tracker.Converter()), settings); err != nil {
		return err
	}
	res.WriteS = time.Since(t0).Seconds()
	f.Close()
	runtime.KeepAlive(m)
	close(stop)
	<-done
	res.HeapPeakWrite = peak.Load()
	res.HeapPeak = max(res.HeapPeakIngest, res.HeapPeakWrite)
	res.HWM = readStatusKB("VmHWM")
	return json.NewEncoder(os.Stdout).Encode(res)
}
