package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// TestWaitForLateRuntime: npuprobe attached to a process that has not
// loaded the runtime yet waits, and when the process dlopen()s it, attaches
// before the process makes its first call: every call is recorded.
func TestWaitForLateRuntime(t *testing.T) {
	w := startWorkload(t, fixtures.LateWorkload, nil, "--threads", "2", "--calls", "6000")
	if maps, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", w.pid)); strings.Contains(string(maps), "libascendcl") {
		t.Fatal("premise: the runtime is already loaded")
	}
	a := runAgent(t, "--pid", fmt.Sprint(w.pid), "--wait", "--out", t.TempDir())
	a.expect(regexp.MustCompile(`^npuprobe: process \d+ has not loaded the CANN runtime yet; waiting`), 30*time.Second)
	a.expect(regexp.MustCompile(`^npuprobe: tracing`), 30*time.Second)
	w.send("go")
	a.expect(regexp.MustCompile(`^npuprobe: attached to pid \d+ .*libascendcl.so$`), time.Minute)
	w.expectLine("done", 2*time.Minute)
	snap := loadSnapshot(t, a.snapshot())
	gt := w.groundTruth()
	want := allCallsExpected(t, gt)
	stats := matchTrace(t, snap.DeviceTraces[0], want, 50)
	t.Logf("all %d calls recorded from the first one after the dlopen", len(stats.DistancesUs))
	var loss struct {
		ReturnsWithoutEntry uint64 `json:"returns_without_entry"`
	}
	snap.Setting(t, "npuprobe_loss", &loss)
	if loss.ReturnsWithoutEntry != 0 {
		t.Errorf("%d returns without entry: a call was in flight while attaching", loss.ReturnsWithoutEntry)
	}
	checkLiveSegments(t, gt, snap)
}

// TestSeveralProcesses: --pid repeated traces each process into its own
// files, named with host, pid, RANK and LOCAL_RANK; a process killed with
// SIGKILL still gets its final snapshot; npuprobe exits 0 when all are gone.
func TestSeveralProcesses(t *testing.T) {
	w0 := startWorkload(t, fixtures.SegmentWorkload, []string{"RANK=0", "LOCAL_RANK=0"}, "--calls", "4000", "--seed", "1")
	w1 := startWorkload(t, fixtures.SegmentWorkload, []string{"RANK=1", "LOCAL_RANK=../1 x"}, "--calls", "4000", "--seed", "2")
	out := t.TempDir()
	a := startAgent(t, "--pid", fmt.Sprint(w0.pid), "--pid", fmt.Sprint(w1.pid), "--out", out)
	w0.send("go")
	w1.send("go")
	w0.expectLine("done", 2*time.Minute)
	w1.expectLine("done", 2*time.Minute)
	if err := a.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	paths := map[string]string{}
	for i := 0; i < 2; i++ {
		p := a.expect(wroteRE, time.Minute)[1]
		paths[filepath.Base(p)] = p
	}
	host, _ := os.Hostname()
	for _, c := range []struct {
		w      *workload
		prefix string
	}{
		{w0, fmt.Sprintf("npuprobe-%s-%d-rank0-local0-", host, w0.pid)},
		{w1, fmt.Sprintf("npuprobe-%s-%d-rank1-local_1_x-", host, w1.pid)},
	} {
		var path string
		for base, p := range paths {
			if strings.HasPrefix(base, c.prefix) && strings.HasSuffix(base, "-signal.pickle") {
				path = p
			}
		}
		if path == "" {
			t.Fatalf("no snapshot named %s*-signal.pickle among %v", c.prefix, paths)
		}
		snap := loadSnapshot(t, path)
		gt := c.w.groundTruth()
		checkSegmentSnapshot(t, gt, snap)
	}

	// SIGKILL gives no chance to the process; npuprobe still writes its
	// final snapshot, and the other's on its normal exit.
	w0.cmd.Process.Kill()
	killed := a.expect(exitRE, time.Minute)[1]
	if !strings.Contains(filepath.Base(killed), fmt.Sprintf("-%d-", w0.pid)) {
		t.Fatalf("exit snapshot %s is not process %d's", killed, w0.pid)
	}
	checkSegmentSnapshot(t, w0.groundTruth(), loadSnapshot(t, killed))
	w1.send("exit")
	a.expect(exitRE, time.Minute)
	if code := a.wait(30 * time.Second); code != 0 {
		t.Fatalf("npuprobe exited %d", code)
	}
}

// TestAllProcesses: --all traces processes mapping the runtime that ran
// before it started, that start later (linking the runtime, or loading it
// with dlopen), and none other.
func TestAllProcesses(t *testing.T) {
	before := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "3000", "--seed", "3")
	sleeper := exec.Command("sleep", "300")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	out := t.TempDir()
	a := runAgent(t, "--all", "--out", out)
	a.expect(regexp.MustCompile(`^npuprobe: tracing every process`), time.Minute)
	// Nothing before "go": whether its start-up calls are seen depends on
	// how fast npuprobe looks at a new process.
	later := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "3000", "--seed", "4", "--pre-attach", "0")
	late := startWorkload(t, fixtures.LateWorkload, nil, "--calls", "3000", "--seed", "5")
	// The linked process is looked at within a few hundred milliseconds
	// of its exec; it waits for "go" longer than that.
	time.Sleep(time.Second)
	for _, w := range []*workload{before, later, late} {
		w.send("go")
	}
	for _, w := range []*workload{before, later, late} {
		w.expectLine("done", 2*time.Minute)
	}
	for _, w := range []*workload{before, later, late} {
		w.send("exit")
		re := regexp.MustCompile(fmt.Sprintf(`^npuprobe: process %d exited; wrote (\S+)$`, w.pid))
		snap := loadSnapshot(t, a.expect(re, time.Minute)[1])
		gt := w.groundTruth()
		if w == late {
			matchTrace(t, snap.DeviceTraces[0], allCallsExpected(t, gt), 50)
			checkLiveSegments(t, gt, snap)
		} else {
			checkSegmentSnapshot(t, gt, snap)
		}
	}
	files, _ := filepath.Glob(filepath.Join(out, fmt.Sprintf("*-%d-*", sleeper.Process.Pid)))
	if len(files) != 0 {
		t.Fatalf("a process without the runtime was traced: %v", files)
	}
	a.cmd.Process.Signal(syscall.SIGTERM)
	if code := a.wait(time.Minute); code != 0 {
		t.Fatalf("npuprobe exited %d on SIGTERM", code)
	}
}

// TestOOMDump: an allocation failing for lack of device memory writes a
// snapshot at once, with the oom entry and the free bytes torch_npu asked
// the runtime for right after.
func TestOOMDump(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "4000")
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir())
	w.send("go")
	path := a.expect(regexp.MustCompile(`^npuprobe: process \d+ ran out of device memory; wrote (\S+-oom\.pickle)$`), time.Minute)[1]
	w.expectLine("done", 2*time.Minute)
	snap := loadSnapshot(t, path)
	gt := w.groundTruth()
	var oomFree uint64
	calls := gt.CallsByThread()
	for _, list := range calls {
		for i, c := range list {
			if c.RC == fixture.ACLErrorRTMemoryAllocation {
				oomFree = list[i+1].R0
			}
		}
	}
	trace := snap.DeviceTraces[0]
	last := trace[len(trace)-1]
	var found bool
	for _, e := range trace {
		if e.Action == "oom" {
			found = true
			if e.DeviceFree == nil {
				t.Fatalf("oom entry without device_free, the workload was told %d", oomFree)
			}
			if *e.DeviceFree != oomFree {
				t.Fatalf("oom entry device_free %d, the workload was told %d", *e.DeviceFree, oomFree)
			}
		}
	}
	if !found {
		t.Fatalf("the OOM snapshot has no oom entry (last entry %+v)", last)
	}
}

// TestDropsAndResync: with a ring buffer too small for the event rate,
// records are lost and counted (status line and metadata), and the
// segments are still exactly the workload's, rebuilt from the kernel's
// live map.
func TestDropsAndResync(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--threads", "2", "--calls", "60000", "--no-oom")
	// One page of ring buffer: about 50 records.
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--ring-size", fmt.Sprint(os.Getpagesize()), "--status-interval", "200ms")
	w.send("go")
	w.expectLine("done", 3*time.Minute)
	a.expect(regexp.MustCompile(`, [1-9]\d* dropped$`), 30*time.Second)
	snap := loadSnapshot(t, a.snapshot())
	var dropped uint64
	snap.Setting(t, "npuprobe_dropped_events", &dropped)
	var model struct {
		Resyncs uint64 `json:"resyncs"`
	}
	snap.Setting(t, "npuprobe_model", &model)
	t.Logf("%d records dropped, %d resyncs", dropped, model.Resyncs)
	if dropped == 0 || model.Resyncs == 0 {
		t.Fatalf("expected drops and a resync: dropped %d, resyncs %d", dropped, model.Resyncs)
	}
	checkLiveSegments(t, w.groundTruth(), snap)
}

// TestSignalBurst: 100 SIGUSR1 at once give only complete, valid files,
// leave no temporary file, and tracing goes on.
func TestSignalBurst(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "8000", "--no-oom")
	out := t.TempDir()
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", out)
	w.send("go")
	// Signals of one kind sent back to back are merged by the kernel
	// while pending; spread over about 100 ms, they arrive while earlier
	// snapshots are being written.
	for i := 0; i < 100; i++ {
		a.cmd.Process.Signal(syscall.SIGUSR1)
		time.Sleep(time.Millisecond)
	}
	w.expectLine("done", 2*time.Minute)
	a.quiet(time.Second) // every queued snapshot written
	final := a.snapshot()
	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("temporary file left: %s", e.Name())
			continue
		}
		loadSnapshot(t, filepath.Join(out, e.Name()))
		n++
	}
	t.Logf("100 signals gave %d snapshots, all valid", n)
	if n < 2 {
		t.Fatalf("only %d snapshots", n)
	}
	gt := w.groundTruth()
	snap := loadSnapshot(t, final)
	want, _ := segmentExpectations(t, gt)
	matchTrace(t, snap.DeviceTraces[0], want, 50)
	checkLiveSegments(t, gt, snap)
}

// TestSIGTERMUnderLoad: SIGTERM while the workload is at full speed gives
// a valid final snapshot and exit 0.
func TestSIGTERMUnderLoad(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--threads", "2", "--calls", "200000", "--no-oom")
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir())
	w.send("go")
	time.Sleep(300 * time.Millisecond)
	a.cmd.Process.Signal(syscall.SIGTERM)
	path := a.expect(wroteRE, time.Minute)[1]
	if code := a.wait(time.Minute); code != 0 {
		t.Fatalf("npuprobe exited %d", code)
	}
	snap := loadSnapshot(t, path)
	if len(snap.DeviceTraces) == 0 || len(snap.DeviceTraces[0]) == 0 {
		t.Fatal("final snapshot has no trace")
	}
}

// TestDiskFull: a snapshot that does not fit leaves no partial file and a
// clear error, and npuprobe goes on tracing.
func TestDiskFull(t *testing.T) {
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "12000", "--no-oom")
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", dir)
	w.send("go")
	w.expectLine("done", 2*time.Minute)
	a.cmd.Process.Signal(syscall.SIGUSR1)
	a.expect(regexp.MustCompile(`^npuprobe: snapshot of process \d+ not written: write .*: no space left on device$`), time.Minute)
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Fatalf("files left on the full disk: %v", entries)
	}
	// Still tracing: the exit snapshot is attempted (and fails) too.
	w.send("exit")
	a.expect(regexp.MustCompile(`not written: .*no space left on device$`), time.Minute)
	if code := a.wait(30 * time.Second); code != 0 {
		t.Fatalf("npuprobe exited %d", code)
	}
}

// TestUntracedProcessesFilteredInBPF: a second process using the same
// library file, not traced, produces no record at all: the kernel drops
// its calls, user space never sees them.
func TestUntracedProcessesFilteredInBPF(t *testing.T) {
	traced := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "4000", "--seed", "8")
	other := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "4000", "--seed", "9")
	a := startAgent(t, "--pid", fmt.Sprint(traced.pid), "--out", t.TempDir())
	traced.send("go")
	other.send("go")
	traced.expectLine("done", 2*time.Minute)
	other.expectLine("done", 2*time.Minute)
	snap := loadSnapshot(t, a.snapshot())
	var loss struct {
		Foreign             uint64 `json:"records_from_untraced_processes"`
		ReturnsWithoutEntry uint64 `json:"returns_without_entry"`
	}
	snap.Setting(t, "npuprobe_loss", &loss)
	if loss.Foreign != 0 {
		t.Fatalf("%d records of an untraced process reached user space", loss.Foreign)
	}
	// Nor is any of its returns counted as a return without entry.
	if loss.ReturnsWithoutEntry != 0 {
		t.Fatalf("%d returns without entry: the untraced process's returns were counted", loss.ReturnsWithoutEntry)
	}
	checkSegmentSnapshot(t, traced.groundTruth(), snap)
}

// TestNoListeningSocket: npuprobe opens no socket unless asked to.
func TestNoListeningSocket(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "100")
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir())
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", a.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", a.cmd.Process.Pid, fd.Name()))
		if strings.HasPrefix(target, "socket:") {
			t.Errorf("npuprobe holds a socket: fd %s -> %s", fd.Name(), target)
		}
	}
}

// TestDropsAndResyncTensor: at tensor level too, after lost records the
// segments and every allocated block (address and requested size) are the
// allocator's own, and the trace still replays.
func TestDropsAndResyncTensor(t *testing.T) {
	env := fixtures.TorchEnv(fixtures.TorchSymtabDir)
	w := startProgram(t, fixtures.TensorWorkload, env, "", "--pattern", "churn", "--steps", "6000", "--seed", "21", "--pre-attach-steps", "0")
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--ring-size", fmt.Sprint(os.Getpagesize()))
	w.send("go")
	w.expectLine("done", 5*time.Minute)
	snap := loadSnapshot(t, a.snapshot())
	gt := dumpTorchGroundTruth(t, w)
	var dropped uint64
	snap.Setting(t, "npuprobe_dropped_events", &dropped)
	if dropped == 0 {
		t.Fatal("no record was dropped: the test needs a smaller ring buffer or a faster workload")
	}
	type blk struct{ addr, req uint64 }
	active := func(blocks []Block) (out []blk) {
		for _, b := range blocks {
			if b.State == "active_allocated" {
				out = append(out, blk{b.Address, b.RequestedSize})
			}
		}
		return out
	}
	if len(snap.Segments) != len(gt.Segments) {
		t.Fatalf("%d segments, ground truth %d (after %d drops)", len(snap.Segments), len(gt.Segments), dropped)
	}
	for i, s := range snap.Segments {
		g := gt.Segments[i]
		if s.Address != g.Address || s.TotalSize != g.TotalSize {
			t.Fatalf("segment %d: %#x+%d, ground truth %#x+%d", i, s.Address, s.TotalSize, g.Address, g.TotalSize)
		}
		var gb []blk
		for _, b := range g.Blocks {
			if b.State == "active_allocated" {
				gb = append(gb, blk{b.Address, b.RequestedSize})
			}
		}
		if got := active(s.Blocks); fmt.Sprint(got) != fmt.Sprint(gb) {
			t.Fatalf("segment %#x allocated blocks %v, ground truth %v", s.Address, got, gb)
		}
	}
	t.Logf("%d records dropped; segments and allocated blocks still equal the allocator's", dropped)
}
