package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

// TestControlSocketDump: `npuprobe dump` asks a running npuprobe for
// snapshots over its control socket (distroless images have no shell to
// send signals from), for every traced process or one, and prints the
// paths; the socket is root's alone.
func TestControlSocketDump(t *testing.T) {
	w0 := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "3000", "--seed", "31")
	w1 := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "3000", "--seed", "32")
	sock := filepath.Join(t.TempDir(), "run", "control.sock")
	a := startAgent(t, "--pid", fmt.Sprint(w0.pid), "--pid", fmt.Sprint(w1.pid), "--out", t.TempDir(), "--control", sock)
	st, err := os.Stat(sock)
	if err != nil || st.Mode().Perm() != 0o600 || st.Mode().Type() != os.ModeSocket {
		t.Fatalf("control socket %s: %v %v, want a socket of mode 0600", sock, st.Mode(), err)
	}
	for _, w := range []*workload{w0, w1} {
		w.send("go")
		w.expectLine("done", 2*time.Minute)
	}

	dump := func(args ...string) (string, string, int) {
		cmd := exec.Command(npuprobe, append([]string{"dump", "--control", sock}, args...)...)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		cmd.Run()
		return out.String(), errb.String(), cmd.ProcessState.ExitCode()
	}
	out, errText, code := dump()
	paths := strings.Fields(out)
	if code != 0 || len(paths) != 2 {
		t.Fatalf("dump: exit %d, stdout %q, stderr %q; want two paths", code, out, errText)
	}
	out, _, code = dump("--pid", fmt.Sprint(w1.pid))
	paths = strings.Fields(out)
	if code != 0 || len(paths) != 1 || !strings.Contains(filepath.Base(paths[0]), fmt.Sprintf("-%d-", w1.pid)) {
		t.Fatalf("dump --pid %d: exit %d, %q", w1.pid, code, out)
	}
	if !strings.HasSuffix(paths[0], "-request.pickle") {
		t.Errorf("requested snapshot named %s", paths[0])
	}
	checkSegmentSnapshot(t, w1.groundTruth(), loadSnapshot(t, paths[0]))

	_, errText, code = dump("--pid", "1")
	if code != 1 || !regexp.MustCompile(`^npuprobe: process 1 is not traced\n$`).MatchString(errText) {
		t.Fatalf("dump of an untraced pid: exit %d, %q", code, errText)
	}
	cmd := exec.Command(npuprobe, "dump", "--control", filepath.Join(t.TempDir(), "none.sock"))
	var eb strings.Builder
	cmd.Stderr = &eb
	cmd.Run()
	if cmd.ProcessState.ExitCode() != 1 || !strings.Contains(eb.String(), "cannot reach npuprobe at") || strings.Count(eb.String(), "\n") != 1 {
		t.Fatalf("dump without a server: exit %d, %q", cmd.ProcessState.ExitCode(), eb.String())
	}
	a.cmd.Process.Signal(os.Interrupt)
	if code := a.wait(time.Minute); code != 0 {
		t.Fatalf("npuprobe exited %d", code)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("control socket left behind: %v", err)
	}
}

// TestControlHTTPLoopbackOnly: the HTTP control API binds loopback only.
func TestControlHTTPLoopbackOnly(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, nil, "--calls", "100")
	code, stderr := runOnce(t, exec.Command(npuprobe, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--control-http", "0.0.0.0:0"))
	if code != 2 || !strings.Contains(stderr, "only a loopback address is allowed") || strings.Count(stderr, "\n") != 1 {
		t.Fatalf("non-loopback control address: exit %d, %q", code, stderr)
	}
	addr := freeLoopbackAddr(t)
	startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--control-http", addr)
	out, err := exec.Command(npuprobe, "dump", "--control-http", addr).Output()
	if err != nil || len(strings.Fields(string(out))) != 1 {
		t.Fatalf("dump over HTTP: %v, %q", err, out)
	}
}

func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// scrape reads the metrics as Prometheus would.
func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse metrics: %v", err)
	}
	return fams
}

// value is the metric's value for the label set (nil labels: the only one).
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
	t.Helper()
	fam, ok := fams[name]
	if !ok {
		t.Fatalf("no metric %s", name)
	}
	for _, m := range fam.Metric {
		match := true
		for k, v := range labels {
			found := false
			for _, lp := range m.Label {
				if lp.GetName() == k && lp.GetValue() == v {
					found = true
				}
			}
			match = match && found
		}
		if !match {
			continue
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Counter != nil:
			return m.Counter.GetValue()
		}
	}
	t.Fatalf("metric %s has no series %v", name, labels)
	return 0
}

// TestMetrics scrapes the endpoint while a workload runs and after, and
// checks the values against the workload's own record.
func TestMetrics(t *testing.T) {
	w := startWorkload(t, fixtures.SegmentWorkload, []string{"RANK=5"}, "--threads", "2", "--calls", "200000", "--pre-attach", "0")
	addr := freeLoopbackAddr(t)
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--metrics-addr", addr)
	labels := map[string]string{"pid": fmt.Sprint(w.pid), "rank": "5", "device": "0"}
	w.send("go")
	// While it runs: numbers move, counters never go back.
	var last float64
	deadline := time.Now().Add(time.Minute)
	moving := 0
	for time.Now().Before(deadline) && moving < 2 {
		fams := scrape(t, addr)
		if _, ok := fams["npuprobe_segment_allocations_total"]; ok {
			v := value(t, fams, "npuprobe_segment_allocations_total", labels)
			if v < last {
				t.Fatalf("counter went back from %v to %v", last, v)
			}
			if v > last {
				moving++
			}
			last = v
		}
		time.Sleep(150 * time.Millisecond)
	}
	w.expectLine("done", 2*time.Minute)
	a.snapshot() // the loop has applied everything up to here
	time.Sleep(300 * time.Millisecond)
	fams := scrape(t, addr)
	gt := w.groundTruth()

	var allocs, ooms, calls int
	var liveBytes uint64
	for _, c := range gt.Calls {
		calls++
		if c.IsMalloc() && c.RC == fixture.ACLSuccess {
			allocs++
		}
		if c.RC == fixture.ACLErrorRTMemoryAllocation {
			ooms++
		}
	}
	for _, l := range gt.Live {
		liveBytes += l.Size
	}
	checks := []struct {
		name string
		want float64
	}{
		{"npuprobe_device_reserved_bytes", float64(liveBytes)},
		{"npuprobe_segment_allocations_total", float64(allocs)},
		{"npuprobe_oom_events_total", float64(ooms)},
	}
	for _, c := range checks {
		if got := value(t, fams, c.name, labels); got != c.want {
			t.Errorf("%s = %v, the workload says %v", c.name, got, c.want)
		}
	}
	if got := value(t, fams, "npuprobe_events_total", map[string]string{"pid": fmt.Sprint(w.pid)}); got < float64(calls-4) || got > float64(calls) {
		t.Errorf("npuprobe_events_total = %v, the workload made %d calls", got, calls)
	}
	if got := value(t, fams, "npuprobe_snapshots_written_total", map[string]string{"reason": "signal"}); got != 1 {
		t.Errorf("snapshots written for signals = %v, want 1", got)
	}
	if got := value(t, fams, "npuprobe_snapshots_written_total", map[string]string{"reason": "oom"}); got != 1 {
		t.Errorf("snapshots written for OOMs = %v, want 1", got)
	}
	if got := value(t, fams, "npuprobe_traced_processes", nil); got != 1 {
		t.Errorf("traced processes = %v", got)
	}
	t.Logf("reserved %v bytes, %d segment allocations, %d OOM, scraped while running %d times with the counter moving", liveBytes, allocs, ooms, moving)
}
