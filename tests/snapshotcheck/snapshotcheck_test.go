package snapshotcheck

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// requirePython fails (never skips) the test: without python3 the snapshot
// rules would silently go unchecked.
func requirePython(t *testing.T) string {
	t.Helper()
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 not found in PATH; the snapshot checker and its tests need "+
			"Python 3 (standard library only): %v", err)
	}
	return python
}

// TestPythonUnittests runs check_snapshot_test.py through `python3 -m
// unittest`, so `go test ./...` exercises the checker.
func TestPythonUnittests(t *testing.T) {
	python := requirePython(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-m", "unittest", "-v")
	cmd.Dir = filepath.Dir(ScriptPath())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python3 -m unittest failed: %v\n%s", err, out)
	}
	// Discovery that finds nothing also exits 0; insist that tests ran.
	m := regexp.MustCompile(`Ran (\d+) tests?`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no unittest summary in output:\n%s", out)
	}
	if n, _ := strconv.Atoi(string(m[1])); n == 0 {
		t.Fatalf("python3 -m unittest ran no tests:\n%s", out)
	}
}

// The JSON shapes a Go test needs to compare a snapshot's content.
type segmentJSON struct {
	Device        int64       `json:"device"`
	Address       int64       `json:"address"`
	TotalSize     int64       `json:"total_size"`
	SegmentPoolID []int64     `json:"segment_pool_id"`
	Blocks        []blockJSON `json:"blocks"`
}

type blockJSON struct {
	Address       int64  `json:"address"`
	Size          int64  `json:"size"`
	RequestedSize int64  `json:"requested_size"`
	State         string `json:"state"`
}

type traceEntryJSON struct {
	Action string  `json:"action"`
	Addr   *int64  `json:"addr"`
	Size   int64   `json:"size"`
	TimeUS *int64  `json:"time_us"`
	PoolID []int64 `json:"pool_id"`
}

type snapshotJSON struct {
	Segments     []segmentJSON      `json:"segments"`
	DeviceTraces [][]traceEntryJSON `json:"device_traces"`
}

// TestCheckWorkedExample validates the spec's §13 example through the Go
// helper and reads it back as JSON.
func TestCheckWorkedExample(t *testing.T) {
	requirePython(t)
	path := filepath.Join(filepath.Dir(ScriptPath()), "testdata", "valid_worked_example.pickle")
	res, err := Check(context.Background(), path, Options{ExpectTime: true, WantJSON: true})
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK {
		t.Fatalf("valid snapshot rejected:\n%s", strings.Join(res.Problems, "\n"))
	}
	if want := "ok: 1 segments, 5 trace entries on 1 devices"; res.Summary != want {
		t.Errorf("summary = %q, want %q", res.Summary, want)
	}

	var snap snapshotJSON
	if err := json.Unmarshal(res.JSON, &snap); err != nil {
		t.Fatalf("decoding --json-out: %v", err)
	}
	const seg = 0x12C040000000
	if len(snap.Segments) != 1 || snap.Segments[0].Address != seg || snap.Segments[0].TotalSize != 2097152 {
		t.Fatalf("segments = %+v", snap.Segments)
	}
	if got := snap.Segments[0].SegmentPoolID; len(got) != 2 || got[0] != 0 || got[1] != 0 {
		t.Errorf("segment_pool_id = %v, want [0 0] (tuple as list)", got)
	}
	var sum int64
	for _, b := range snap.Segments[0].Blocks {
		sum += b.Size
	}
	if sum != 2097152 {
		t.Errorf("block sizes sum to %d", sum)
	}
	wantActions := []string{"segment_alloc", "alloc", "alloc", "free_requested", "free_completed"}
	if len(snap.DeviceTraces) != 1 || len(snap.DeviceTraces[0]) != len(wantActions) {
		t.Fatalf("device_traces = %+v", snap.DeviceTraces)
	}
	for i, e := range snap.DeviceTraces[0] {
		if e.Action != wantActions[i] || e.Addr == nil || e.TimeUS == nil {
			t.Errorf("entry %d = %+v, want action %s with addr and time_us", i, e, wantActions[i])
		}
	}
}

// TestCheckReportsProblems checks that a rule violation is a verdict, not an
// error, and carries the problem code.
func TestCheckReportsProblems(t *testing.T) {
	requirePython(t)
	path := filepath.Join(filepath.Dir(ScriptPath()), "testdata", "invalid_standalone_free_requested.pickle")
	res, err := Check(context.Background(), path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.OK || len(res.Problems) != 1 || !strings.Contains(res.Problems[0], "replay.rule3") {
		t.Fatalf("want one replay.rule3 problem, got OK=%v problems=%q", res.OK, res.Problems)
	}
}
