// Package snaptest runs the fixture's fake torch_npu workload for the tests
// of the snapshot tools: it builds the fixtures once per test binary, runs
// tensor_workload to the end of its steps and takes torch_npu-style dumps
// (the pickle of fake_torch_npu_dump_pickle and the JSON ground truth of
// fake_torch_npu_dump_snapshot, at the same point). Nothing here needs root.
package snaptest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/tests/fixture"
)

var (
	buildOnce sync.Once
	buildDir  string
	paths     *fixture.Paths
	buildErr  error
)

// Main runs the tests and removes the fixtures built for them. Call it from
// TestMain.
func Main(m interface{ Run() int }) int {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	return code
}

// Fixtures builds the fixtures (once per test binary, removed by Main) and
// returns them. Without Main, build into a test's own directory with
// fixture.Build instead.
func Fixtures(t testing.TB) *fixture.Paths {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "npuprobe-snaptest-")
		if buildErr == nil {
			paths, buildErr = fixture.Build(buildDir)
		}
	})
	if buildErr != nil {
		t.Fatalf("build fixtures: %v", buildErr)
	}
	return paths
}

// Dump is one run of tensor_workload and what it dumped at its end.
type Dump struct {
	Pickle string                    // fake_torch_npu_dump_pickle output (torch_npu's format, no time_us)
	JSON   string                    // fake_torch_npu_dump_snapshot output (ground truth, time_ns per entry)
	GT     *fixture.TorchGroundTruth // JSON, parsed
}

// TensorDump runs tensor_workload of the fixtures p with args against the
// unstripped fake torch_npu, sends "go", and when it is done dumps the
// pickle and the JSON ground truth into dir.
func TensorDump(t testing.TB, p *fixture.Paths, dir string, env []string, args ...string) *Dump {
	t.Helper()
	cmd := exec.Command(p.TensorWorkload, args...)
	cmd.Env = append(append(os.Environ(), p.TorchEnv(p.TorchSymtabDir)...), env...)
	cmd.Stderr = os.Stderr
	w, err := fixture.Start(cmd, 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Kill()
	step := func(command, reply string) {
		t.Helper()
		if err := w.Send(command); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Expect(reply, 5*time.Minute); err != nil {
			t.Fatalf("tensor_workload: %v", err)
		}
	}
	d := &Dump{Pickle: filepath.Join(dir, "torch_npu.pickle"), JSON: filepath.Join(dir, "groundtruth.json")}
	step("go", "done")
	step("dumppickle "+d.Pickle, "dumped")
	step("dump "+d.JSON, "dumped")
	f, err := os.Open(d.JSON)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if d.GT, err = fixture.ParseTorchGroundTruth(f); err != nil {
		t.Fatal(err)
	}
	return d
}

// FromGroundTruth turns the fixture's JSON ground truth into a snapshot
// with time_us (its time_ns / 1000) on every entry, as a recording of the
// same process would have it.
func FromGroundTruth(gt *fixture.TorchGroundTruth) *snapshot.Snapshot {
	s := &snapshot.Snapshot{}
	for _, g := range gt.Segments {
		seg := snapshot.Segment{
			Device: g.Device, Address: int64(g.Address), TotalSize: int64(g.TotalSize),
			AllocatedSize: snapshot.Some(int64(g.AllocatedSize)), ActiveSize: snapshot.Some(int64(g.ActiveSize)),
			RequestedSize: snapshot.Some(int64(g.RequestedSize)), Stream: snapshot.Some(int64(g.Stream)),
			SegmentType:   snapshot.Some(g.SegmentType),
			SegmentPoolID: snapshot.Some([2]int64{int64(g.SegmentPoolID[0]), int64(g.SegmentPoolID[1])}),
			IsExpandable:  snapshot.Some(g.IsExpandable), Frames: snapshot.Some([]snapshot.Frame{}),
		}
		for _, b := range g.Blocks {
			seg.Blocks = append(seg.Blocks, snapshot.Block{Address: snapshot.Some(int64(b.Address)), Size: int64(b.Size),
				RequestedSize: snapshot.Some(int64(b.RequestedSize)), State: b.State, Frames: snapshot.Some([]snapshot.Frame{})})
		}
		s.Segments = append(s.Segments, seg)
	}
	for _, tr := range gt.DeviceTraces {
		out := []snapshot.TraceEntry{}
		for _, g := range tr {
			e := snapshot.TraceEntry{Action: g.Action, Size: int64(g.Size), Stream: snapshot.Some(int64(g.Stream)),
				TimeUs: snapshot.Some(g.TimeNs / 1000), PoolID: snapshot.Some([2]int64{int64(g.PoolID[0]), int64(g.PoolID[1])})}
			if g.Action == fixture.ActionOOM {
				e.DeviceFree = snapshot.Some(int64(g.DeviceFree))
			} else {
				e.Addr = snapshot.Some(int64(g.Addr))
			}
			out = append(out, e)
		}
		s.DeviceTraces = append(s.DeviceTraces, out)
	}
	s.AllocatorSettings = &snapshot.Dict{}
	s.AllocatorSettings.Set("source", fmt.Sprintf("fixture ground truth, %d devices", len(gt.DeviceTraces)))
	return s
}
