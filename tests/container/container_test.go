package container

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
)

// TestImage: the image built from the Dockerfile (offline, in TestMain)
// runs npuprobe as its entrypoint, as root, and is small.
func TestImage(t *testing.T) {
	t.Logf("image %s: %s (%d bytes) on scratch; built offline in %v", agentImage, humanBytes(imageSize), imageSize, buildTime.Round(time.Second))
	// The binary and nothing else (scratch adds nothing): a static Go
	// binary of npuprobe's size, not a toolchain left in by mistake.
	if imageSize > 40e6 {
		t.Errorf("image is %s; the runtime stage should hold only the static binary", humanBytes(imageSize))
	}
	var cfg struct {
		Entrypoint []string
		Cmd        []string
		User       string
		WorkingDir string
	}
	if err := json.Unmarshal([]byte(docker(t, "image", "inspect", "-f", "{{json .Config}}", agentImage)), &cfg); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.Entrypoint, []string{"/usr/local/bin/npuprobe"}) || cfg.User != "0:0" {
		t.Errorf("image config: entrypoint %v, user %q; want [/usr/local/bin/npuprobe], 0:0", cfg.Entrypoint, cfg.User)
	}
	out, err := exec.Command(dockerBin, "run", "--rm", "--network", "none", agentImage).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--pid") {
		t.Errorf("docker run %s (its default command, --help): %v\n%s", agentImage, err, out)
	}
	// Static: it runs in an image with no C library at all.
	out, err = exec.Command(dockerBin, "run", "--rm", "--network", "none", agentImage, "stats", "/nonexistent").CombinedOutput()
	if code := exitCode(err); code != 1 || !strings.HasPrefix(string(out), "npuprobe: ") {
		t.Errorf("npuprobe stats of a missing file in the image: exit %d, %q; want 1 and npuprobe's one-line error", code, out)
	}
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	return -1
}

// TestPrivilegedByPID: the README's run line, `docker run --privileged
// --pid=host`, traces a workload in another container by its host PID;
// `docker kill --signal USR1` writes a snapshot that matches the
// workload's ground truth call for call.
func TestPrivilegedByPID(t *testing.T) {
	args := []string{"--privileged", "--pid=host"}
	if missing := unavailableCaps(t); len(missing) > 0 {
		// A machine whose own bounding set lacks a capability (this CI's
		// does: CAP_SYS_RESOURCE) cannot start a --privileged container:
		// runc fails to apply every capability. Run the equivalent that
		// matters to npuprobe: every other capability, no seccomp filter,
		// no AppArmor profile.
		t.Logf("this machine's capability bounding set lacks %v, so docker run --privileged cannot start any container here; "+
			"running its equivalent: --cap-add ALL --cap-drop %s --security-opt seccomp=unconfined --security-opt apparmor=unconfined",
			missing, strings.Join(missing, " --cap-drop "))
		args = []string{"--pid=host", "--cap-add", "ALL", "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined"}
		for _, c := range missing {
			args = append(args, "--cap-drop", c)
		}
	}
	traceByPID(t, args)
}

// leastPrivilege is the smallest set of capabilities npuprobe runs with,
// in the host PID namespace, tracing by PID processes of the same user
// (README.md, "Running in a container", gives the reasons).
var leastPrivilege = []string{"--pid=host", "--cap-drop", "ALL", "--cap-add", "SYS_ADMIN", "--cap-add", "SYS_PTRACE"}

// TestLeastPrivilegeByPID: the same as TestPrivilegedByPID with only
// CAP_SYS_ADMIN and CAP_SYS_PTRACE, Docker's default seccomp profile and a
// read-only root filesystem; without either capability npuprobe refuses
// to start, saying which is missing.
func TestLeastPrivilegeByPID(t *testing.T) {
	t.Run("trace", func(t *testing.T) {
		traceByPID(t, append(slices.Clone(leastPrivilege), "--read-only"))
	})
	for _, c := range []struct{ drop, missing string }{
		{"SYS_ADMIN", "CAP_BPF CAP_PERFMON"},
		{"SYS_PTRACE", "CAP_SYS_PTRACE"},
	} {
		t.Run("without "+c.drop, func(t *testing.T) {
			var args []string
			for i := 0; i < len(leastPrivilege); i++ {
				if leastPrivilege[i] == "--cap-add" && leastPrivilege[i+1] == c.drop {
					i++
					continue
				}
				args = append(args, leastPrivilege[i])
			}
			a := runAgent(t, append(args, "--network", "none"), "--pid", strconv.Itoa(os.Getpid()), "--out", outMount)
			if code := a.wait(time.Minute); code != 1 {
				t.Fatalf("npuprobe without CAP_%s exited %d, want 1", c.drop, code)
			}
			want := "npuprobe: not enough privilege to load and attach eBPF programs: missing [" + c.missing + "]"
			if !strings.Contains(a.output(), want) {
				t.Fatalf("npuprobe without CAP_%s said:\n%s\nwant a line starting %q", c.drop, a.output(), want)
			}
		})
	}
}

// traceByPID runs npuprobe in a container with dockerArgs against a
// segment workload in another container, attached by the workload's host
// PID, and checks a SIGUSR1 snapshot (sent with docker kill) and the final
// one written when the workload's container exits, after which npuprobe's
// container exits 0.
func traceByPID(t *testing.T, dockerArgs []string) {
	const threads, calls = 3, 12000
	w := startWorkload(t, "segment_workload", nil,
		"--threads", strconv.Itoa(threads), "--calls", strconv.Itoa(calls), "--pre-attach", "24")
	a := startAgent(t, append(slices.Clone(dockerArgs), "--network", "none"),
		"--pid", strconv.Itoa(w.hostPID), "--out", outMount, "--status-interval", "0")
	// The runtime was found where the workload sees it, inside its own
	// mount namespace (that path does not exist on this machine).
	attached := regexp.MustCompile(fmt.Sprintf(`(?m)^npuprobe: attached to pid %d .* in %s/lib/libascendcl\.so$`, w.hostPID, workloadRoot))
	if !attached.MatchString(a.output()) {
		t.Fatalf("npuprobe did not report attaching to %s/lib/libascendcl.so in process %d", workloadRoot, w.hostPID)
	}

	w.send("go")
	w.expectLine("done", 2*time.Minute)
	path := a.signalSnapshot(w.hostPID)
	gt := w.groundTruth()
	snap := loadSnapshot(t, path)
	checkSegmentSnapshot(t, gt, snap)
	var version string
	snap.Setting(t, "npuprobe_version", &version)
	if version != imageVersion {
		t.Errorf("snapshot names npuprobe version %q; the image was built with VERSION=%s", version, imageVersion)
	}

	w.finish()
	checkSegmentSnapshot(t, gt, loadSnapshot(t, a.exitSnapshot(w.hostPID)))
	if code := a.wait(time.Minute); code != 0 {
		t.Fatalf("npuprobe's container exited %d after the workload's ended", code)
	}
}

// TestDaemonSetConfiguration runs the image the way
// deploy/kubernetes/daemonset.yaml does, read from the manifest: its
// arguments (--all, --out on the node's snapshot directory, the control
// socket, metrics), capabilities, mounts, read-only root filesystem,
// seccomp and AppArmor settings and limits. The workloads start after
// npuprobe, in containers of two images, as an unprivileged user. A dump
// is asked for with `docker exec ... npuprobe dump`, as an operator would
// with kubectl exec, and the metrics port is scraped.
func TestDaemonSetConfiguration(t *testing.T) {
	ds := readDaemonSet(t)
	c := ds.Spec.Template.Spec.Containers[0]
	dockerArgs, out := dockerArgsFor(t, ds)
	a := runAgentOut(t, out, dockerArgs, c.Args...)
	a.expect(regexp.MustCompile(`^npuprobe: tracing; `), time.Minute)

	// Two images (see TestAllTwoContainersOfOneImage), ranks 3 and 4 of a
	// job run by user 1000.
	const user = "1000:1000"
	var ws []*workload
	for i, image := range workloadImages {
		ws = append(ws, startWorkloadIn(t, image, "segment_workload",
			[]string{"--user", user, "-e", fmt.Sprintf("RANK=%d", 3+i), "-e", "LOCAL_RANK=0"},
			"--threads", "2", "--calls", "4000", "--seed", strconv.Itoa(4+i), "--pre-attach", "0"))
	}
	// npuprobe looks at a process's libraries 20 ms, 300 ms and 3 s after
	// its exec (and adopts it at its first call); the workloads have long
	// mapped the runtime when they say "ready".
	time.Sleep(time.Second)
	for _, w := range ws {
		w.send("go")
	}
	for _, w := range ws {
		w.expectLine("done", 2*time.Minute)
	}

	// kubectl exec POD -- npuprobe dump: every traced process's snapshot
	// (other processes on this machine that map a CANN runtime included).
	dump, err := exec.Command(dockerBin, "exec", a.name, "npuprobe", "dump").CombinedOutput()
	if err != nil {
		t.Fatalf("docker exec %s npuprobe dump: %v\n%s", a.name, err, dump)
	}
	paths := map[int]string{}
	for _, line := range strings.Fields(string(dump)) {
		for _, w := range ws {
			if strings.Contains(filepath.Base(line), fmt.Sprintf("-%d-", w.hostPID)) {
				paths[w.hostPID] = a.hostPath(line)
			}
		}
	}
	if len(paths) != len(ws) {
		t.Fatalf("npuprobe dump printed %q; want a snapshot of processes %d and %d", dump, ws[0].hostPID, ws[1].hostPID)
	}
	snaps := make([]*Snapshot, len(ws))
	for i, w := range ws {
		// The rank comes from the process's environment, which only
		// CAP_DAC_READ_SEARCH lets npuprobe read (another user's, 0400).
		base := filepath.Base(paths[w.hostPID])
		if want := fmt.Sprintf("-rank%d-local0-", 3+i); !strings.Contains(base, want) || !strings.HasSuffix(base, "-request.pickle") {
			t.Errorf("snapshot %s is not named with %s and reason request", base, want)
		}
		snaps[i] = loadSnapshot(t, paths[w.hostPID])
		checkSegmentSnapshot(t, w.groundTruth(), snaps[i])
	}
	if strings.Contains(a.output(), "cannot read the environment") {
		t.Errorf("npuprobe could not read a workload's environment:\n%s", a.output())
	}

	checkMetrics(t, a, ds, ws[0].hostPID, snaps[0])

	for _, w := range ws {
		w.finish()
		a.exitSnapshot(w.hostPID)
	}
	// A pod's end: SIGTERM, then SIGKILL after the grace period.
	grace := ds.Spec.Template.Spec.TerminationGracePeriodSeconds
	docker(t, "stop", "-t", strconv.FormatInt(*grace, 10), a.name)
	if code := a.wait(time.Minute); code != 0 {
		t.Fatalf("npuprobe exited %d on SIGTERM", code)
	}
}

// checkMetrics scrapes the port the manifest's Prometheus annotations name
// and requires the reserved bytes of process pid to be its snapshot's.
func checkMetrics(t *testing.T, a *agent, ds *appsv1.DaemonSet, pid int, snap *Snapshot) {
	t.Helper()
	ann := ds.Spec.Template.Annotations
	ip := docker(t, "inspect", "-f", "{{.NetworkSettings.IPAddress}}", a.name)
	url := fmt.Sprintf("http://%s:%s%s", ip, ann["prometheus.io/port"], ann["prometheus.io/path"])
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", url, resp.Status)
	}
	var reserved uint64
	for _, s := range snap.Segments {
		reserved += s.TotalSize
	}
	re := regexp.MustCompile(fmt.Sprintf(`(?m)^npuprobe_device_reserved_bytes\{device="0",pid="%d",rank="3"\} (\S+)$`, pid))
	m := re.FindSubmatch(body)
	if m == nil {
		t.Fatalf("%s has no npuprobe_device_reserved_bytes for process %d, rank 3:\n%s", url, pid, body)
	}
	got, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil || uint64(got) != reserved {
		t.Errorf("metrics: process %d reserves %s bytes; its snapshot's segments total %d", pid, m[1], reserved)
	}
	t.Logf("scraped %s: process %d reserves %d bytes, as its snapshot says", url, pid, reserved)
}

// readDaemonSet decodes the DaemonSet of deploy/kubernetes/daemonset.yaml
// (deploy/kubernetes's own test checks the manifest in detail).
func readDaemonSet(t *testing.T) *appsv1.DaemonSet {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "kubernetes", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := appsv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	dec := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Yaml: true, Strict: true})
	for _, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
		obj, _, err := dec.Decode([]byte(doc), nil, nil)
		if err != nil {
			continue // comments only, or another kind: the manifest test's business
		}
		if ds, ok := obj.(*appsv1.DaemonSet); ok {
			return ds
		}
	}
	t.Fatal("no DaemonSet in deploy/kubernetes/daemonset.yaml")
	return nil
}

// dockerArgsFor translates the DaemonSet's pod into docker run options. The
// host path that receives snapshots is replaced by a temporary directory
// (runAgentOut mounts it at the returned path, the --out argument).
func dockerArgsFor(t *testing.T, ds *appsv1.DaemonSet) (args []string, out string) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]
	if spec.HostPID {
		args = append(args, "--pid=host")
	}
	if spec.HostNetwork {
		args = append(args, "--network=host")
	}
	sc := c.SecurityContext
	if sc.RunAsUser != nil {
		args = append(args, "--user", fmt.Sprintf("%d:%d", *sc.RunAsUser, *sc.RunAsGroup))
	}
	if sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem {
		args = append(args, "--read-only")
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Fatal("the DaemonSet is privileged: this test is about its capabilities")
	}
	unavailable := unavailableCaps(t)
	for _, d := range sc.Capabilities.Drop {
		args = append(args, "--cap-drop", string(d))
	}
	for _, a := range sc.Capabilities.Add {
		if slices.Contains(unavailable, string(a)) {
			// CI's machine cannot give it to any container; it matters
			// only on kernels before 5.11 (t.Logf says which runs here).
			out, _ := exec.Command("uname", "-r").Output()
			t.Logf("CAP_%s is not in this machine's bounding set: running without it (kernel %s)", a, strings.TrimSpace(string(out)))
			continue
		}
		args = append(args, "--cap-add", string(a))
	}
	// RuntimeDefault is Docker's default seccomp profile.
	if p := sc.SeccompProfile; p != nil && p.Type == corev1.SeccompProfileTypeUnconfined {
		args = append(args, "--security-opt", "seccomp=unconfined")
	}
	if p := sc.AppArmorProfile; p != nil && p.Type == corev1.AppArmorProfileTypeUnconfined {
		args = append(args, "--security-opt", "apparmor=unconfined")
	}
	if m, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
		args = append(args, "--memory", strconv.FormatInt(m.Value(), 10))
	}
	if cpu, ok := c.Resources.Limits[corev1.ResourceCPU]; ok {
		// Docker refuses more CPUs than the machine has.
		n := min(cpu.AsApproximateFloat64(), float64(goruntime.NumCPU()))
		args = append(args, "--cpus", strconv.FormatFloat(n, 'f', -1, 64))
	}
	outArg := ""
	for i, a := range c.Args {
		if a == "--out" && i+1 < len(c.Args) {
			outArg = c.Args[i+1]
		}
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	for _, m := range c.VolumeMounts {
		v := volumes[m.Name]
		switch {
		case m.MountPath == outArg && v.HostPath != nil:
			out = m.MountPath
		case v.HostPath != nil:
			opt := v.HostPath.Path + ":" + m.MountPath
			if m.ReadOnly {
				opt += ":ro"
			}
			args = append(args, "-v", opt)
		case v.EmptyDir != nil:
			args = append(args, "--tmpfs", m.MountPath)
		default:
			t.Fatalf("volume %s: only hostPath and emptyDir volumes are translated", m.Name)
		}
	}
	if out == "" {
		t.Fatalf("--out %q is not a hostPath volume's mount", outArg)
	}
	return args, out
}

// TestAllTwoContainersOfOneImage: with --all, two containers of the same
// image map the same runtime file, which each container's overlay mount
// reports with its own device number. npuprobe must still count every call
// once: attachments are keyed by the inode /proc/PID/maps names (the real
// file under the overlay), not by what fstat reports through each mount
// (which differs, and once made every call count twice).
func TestAllTwoContainersOfOneImage(t *testing.T) {
	a := startAgent(t, append(slices.Clone(leastPrivilege), "--cap-add", "DAC_READ_SEARCH",
		"--network", "none", "-v", "/sys/kernel/debug:/sys/kernel/debug:ro",
		// The image layers, at the paths the overlay mounts name: how
		// npuprobe tells that both containers map one file (the DaemonSet
		// mounts containerd's the same way).
		"-v", "/var/lib/docker:/var/lib/docker:ro"),
		"--all", "--out", outMount, "--status-interval", "0")
	var ws []*workload
	for seed := range 2 {
		ws = append(ws, startWorkload(t, "segment_workload", nil, "--calls", "4000", "--seed", strconv.Itoa(10+seed), "--pre-attach", "0"))
	}
	time.Sleep(time.Second)
	for _, w := range ws {
		w.send("go")
	}
	for _, w := range ws {
		w.expectLine("done", 2*time.Minute)
	}
	for _, w := range ws {
		w.finish()
		checkSegmentSnapshot(t, w.groundTruth(), loadSnapshot(t, a.exitSnapshot(w.hostPID)))
	}
}

// TestOtherUsersProcess: the capabilities a process of another user than
// npuprobe's (root) needs, traced with --wait: it has not loaded the
// runtime yet, and npuprobe stops it when it does (BPF sends SIGSTOP at
// the dlopen's return), attaches and continues it, so that no call is
// missed. Continuing another user's process needs CAP_KILL, and reading
// its environment (RANK for the file name) CAP_DAC_READ_SEARCH.
func TestOtherUsersProcess(t *testing.T) {
	run := func(t *testing.T, extraCaps ...string) (*workload, *agent) {
		w := startWorkload(t, "late_workload", []string{"--user", "1000:1000", "-e", "RANK=5"},
			"--threads", "2", "--calls", "4000", "--seed", "6")
		args := append(slices.Clone(leastPrivilege), "--network", "none")
		for _, c := range extraCaps {
			args = append(args, "--cap-add", c)
		}
		a := startAgent(t, args, "--pid", strconv.Itoa(w.hostPID), "--wait", "--out", outMount, "--status-interval", "0")
		w.send("go")
		return w, a
	}
	t.Run("KILL and DAC_READ_SEARCH", func(t *testing.T) {
		w, a := run(t, "KILL", "DAC_READ_SEARCH")
		w.expectLine("done", 2*time.Minute)
		path := a.signalSnapshot(w.hostPID)
		if !strings.Contains(filepath.Base(path), fmt.Sprintf("-%d-rank5-", w.hostPID)) {
			t.Errorf("snapshot %s is not named with the process's RANK", filepath.Base(path))
		}
		snap := loadSnapshot(t, path)
		gt := w.groundTruth()
		stats := matchTrace(t, snap.DeviceTraces[0], allCallsExpected(t, gt), 50)
		t.Logf("all %d calls recorded from the first one after the dlopen", len(stats.DistancesUs))
		checkLiveSegments(t, gt, snap)
	})
	t.Run("without KILL", func(t *testing.T) {
		w, a := run(t, "DAC_READ_SEARCH")
		a.expect(regexp.MustCompile(fmt.Sprintf(`^npuprobe: continue process %d: operation not permitted$`, w.hostPID)), time.Minute)
		// The process stays stopped: continue it from here (root).
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", w.hostPID))
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:])); len(f) == 0 || f[0] != "T" {
			t.Errorf("process %d is in state %v, want T (stopped)", w.hostPID, f)
		}
		if err := syscall.Kill(w.hostPID, syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		w.expectLine("done", 2*time.Minute)
	})
	t.Run("without DAC_READ_SEARCH", func(t *testing.T) {
		w, a := run(t, "KILL")
		a.expect(regexp.MustCompile(fmt.Sprintf(`^npuprobe: cannot read the environment of process %d \(.*permission denied\)`, w.hostPID)), time.Minute)
		w.expectLine("done", 2*time.Minute)
		if path := a.signalSnapshot(w.hostPID); strings.Contains(filepath.Base(path), "-rank") {
			t.Errorf("snapshot %s has a rank npuprobe could not have read", filepath.Base(path))
		}
	})
}
