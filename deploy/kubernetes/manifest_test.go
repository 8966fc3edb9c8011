// Package kubernetes holds npuprobe's Kubernetes manifests; its test
// decodes them strictly into the Kubernetes API types (an unknown or
// misspelt field fails) and checks what the DaemonSet must do.
package kubernetes

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/validation"
)

const manifestFile = "daemonset.yaml"

// The capabilities the DaemonSet adds, each for a reason given in the
// manifest and README.md. tests/container runs the image with this set.
var wantCaps = []corev1.Capability{"SYS_ADMIN", "SYS_PTRACE", "DAC_READ_SEARCH", "SYS_RESOURCE"}

type manifest struct {
	namespace      *corev1.Namespace
	serviceAccount *corev1.ServiceAccount
	daemonSet      *appsv1.DaemonSet
}

// decoder decodes YAML the way the API server does, strictly: a field that
// does not exist in the type, a field whose case differs from the type's
// (encoding/json would accept those), or a duplicate field fails.
func decoder() runtime.Decoder {
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		panic(err)
	}
	if err := appsv1.AddToScheme(scheme); err != nil {
		panic(err)
	}
	return kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme,
		kjson.SerializerOptions{Yaml: true, Strict: true})
}

// decode splits a multi-document YAML file and decodes each document
// strictly into the type its apiVersion and kind name.
func decode(t *testing.T, data []byte) *manifest {
	t.Helper()
	var m manifest
	dec := decoder()
	for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		obj, gvk, err := dec.Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("document %d: %v", i, err)
		}
		switch o := obj.(type) {
		case *corev1.Namespace:
			m.namespace = o
		case *corev1.ServiceAccount:
			m.serviceAccount = o
		case *appsv1.DaemonSet:
			m.daemonSet = o
		default:
			t.Fatalf("document %d: unexpected %v", i, gvk)
		}
	}
	if m.namespace == nil || m.serviceAccount == nil || m.daemonSet == nil {
		t.Fatalf("%s must hold a Namespace, a ServiceAccount and a DaemonSet", manifestFile)
	}
	return &m
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

func readManifest(t *testing.T) ([]byte, *manifest) {
	t.Helper()
	data, err := os.ReadFile(manifestFile)
	if err != nil {
		t.Fatal(err)
	}
	return data, decode(t, data)
}

// TestStrictDecoding: the decoder rejects what the API server would, so
// that the manifest decoding without error means something.
func TestStrictDecoding(t *testing.T) {
	base := "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n"
	for _, bad := range []string{
		base + "      hostPid: true\n",                      // wrong case
		base + "      hostPIDs: true\n",                     // no such field
		base + "      hostPID: true\n      hostPID: true\n", // duplicate
	} {
		if _, _, err := decoder().Decode([]byte(bad), nil, nil); err == nil {
			t.Errorf("decoded without error:\n%s", bad)
		}
	}
	if _, _, err := decoder().Decode([]byte(base+"      hostPID: true\n"), nil, nil); err != nil {
		t.Errorf("a valid document: %v", err)
	}
}

func TestManifestObjects(t *testing.T) {
	_, m := readManifest(t)
	ns := m.namespace.Name
	for _, msg := range validation.IsDNS1123Label(ns) {
		t.Errorf("namespace %q: %s", ns, msg)
	}
	if got := m.namespace.Labels["pod-security.kubernetes.io/enforce"]; got != "privileged" {
		t.Errorf("namespace enforces pod security %q; hostPID and capabilities need privileged", got)
	}
	if m.serviceAccount.Namespace != ns || m.daemonSet.Namespace != ns {
		t.Errorf("objects in namespaces %q and %q, want %q", m.serviceAccount.Namespace, m.daemonSet.Namespace, ns)
	}
	if a := m.serviceAccount.AutomountServiceAccountToken; a == nil || *a {
		t.Error("the service account mounts an API token; npuprobe needs none")
	}
}

func TestDaemonSet(t *testing.T) {
	_, m := readManifest(t)
	ds := m.daemonSet
	spec := ds.Spec.Template.Spec

	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil {
		t.Fatal(err)
	}
	if sel.Empty() || !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("selector %v does not select the pod template's labels %v", sel, ds.Spec.Template.Labels)
	}
	if !spec.HostPID {
		t.Error("hostPID is not set: npuprobe attaches to host PIDs")
	}
	if spec.HostNetwork {
		t.Error("hostNetwork is set; npuprobe does not need it")
	}
	if spec.ServiceAccountName != m.serviceAccount.Name {
		t.Errorf("serviceAccountName %q, want %q", spec.ServiceAccountName, m.serviceAccount.Name)
	}
	if spec.NodeSelector["accelerator"] != "huawei-Ascend910" {
		t.Errorf("nodeSelector %v, want accelerator=huawei-Ascend910 (the Ascend device plugin's label)", spec.NodeSelector)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(tol corev1.Toleration) bool {
		return tol.Key == "huawei.com/Ascend910" && tol.Operator == corev1.TolerationOpExists
	}) {
		t.Errorf("no toleration of the huawei.com/Ascend910 taint: %+v", spec.Tolerations)
	}
	if g := spec.TerminationGracePeriodSeconds; g == nil || *g < 30 {
		t.Error("terminationGracePeriodSeconds below 30 s: final snapshots are written on SIGTERM")
	}

	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("%d containers and %d init containers, want one container", len(spec.Containers), len(spec.InitContainers))
	}
	c := spec.Containers[0]
	checkImage(t, c)
	checkResources(t, c.Resources)
	checkSecurity(t, ds, c)
	volumes := checkVolumes(t, spec, c)
	checkArgs(t, ds, c, volumes)
}

func checkImage(t *testing.T, c corev1.Container) {
	t.Helper()
	if c.Name != "npuprobe" {
		t.Errorf("container %q, want npuprobe", c.Name)
	}
	// REPOSITORY[:TAG]: the repository's last component is npuprobe.
	repo, tag, _ := strings.Cut(c.Image[strings.LastIndex(c.Image, "/")+1:], ":")
	if repo != "npuprobe" || tag == "" {
		t.Errorf("image %q, want npuprobe:TAG (the image the Dockerfile builds)", c.Image)
	}
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %q, want IfNotPresent (images loaded on the nodes work too)", c.ImagePullPolicy)
	}
	if len(c.Command) != 0 {
		t.Errorf("command %v overrides the image's entrypoint (npuprobe)", c.Command)
	}
}

func checkResources(t *testing.T, r corev1.ResourceRequirements) {
	t.Helper()
	for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, okReq := r.Requests[name]
		lim, okLim := r.Limits[name]
		if !okReq || !okLim {
			t.Errorf("%s: request and limit must both be set (request %v, limit %v)", name, r.Requests, r.Limits)
			continue
		}
		if req.Cmp(lim) > 0 {
			t.Errorf("%s request %s above limit %s", name, req.String(), lim.String())
		}
	}
	if lim := r.Limits[corev1.ResourceMemory]; lim.Cmp(resource.MustParse("1Gi")) < 0 {
		t.Errorf("memory limit %s: a node of 8 busy devices needs about 1 GiB", lim.String())
	}
}

func checkSecurity(t *testing.T, ds *appsv1.DaemonSet, c corev1.Container) {
	t.Helper()
	sc := c.SecurityContext
	if sc == nil {
		t.Fatal("no securityContext")
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Error("privileged: the capabilities below are enough")
	}
	if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Error("runAsUser must be 0: eBPF and other processes' /proc entries need root")
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("readOnlyRootFilesystem is not set")
	}
	// The API server refuses allowPrivilegeEscalation=false with SYS_ADMIN.
	if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation: false is invalid together with CAP_SYS_ADMIN")
	}
	if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("capabilities must drop ALL, then add what is needed: %+v", sc.Capabilities)
	} else {
		got := slices.Clone(sc.Capabilities.Add)
		want := slices.Clone(wantCaps)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("capabilities added %v, want %v", sc.Capabilities.Add, wantCaps)
		}
		for _, c := range sc.Capabilities.Add {
			if strings.HasPrefix(string(c), "CAP_") {
				t.Errorf("capability %q: Kubernetes names capabilities without CAP_", c)
			}
		}
	}
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccompProfile %+v, want RuntimeDefault", sc.SeccompProfile)
	}
	if sc.AppArmorProfile == nil || sc.AppArmorProfile.Type != corev1.AppArmorProfileTypeUnconfined {
		t.Errorf("appArmorProfile %+v, want Unconfined", sc.AppArmorProfile)
	}
	// Kubernetes before 1.30 reads the annotation; from 1.30 on, the API
	// server refuses an annotation that disagrees with the field.
	key := "container.apparmor.security.beta.kubernetes.io/" + c.Name
	if v := ds.Spec.Template.Annotations[key]; v != "unconfined" {
		t.Errorf("annotation %s = %q, want unconfined (agreeing with appArmorProfile)", key, v)
	}
}

// checkVolumes requires every mount to name a volume and every volume to be
// mounted, and the ones npuprobe needs; it returns the mount path of each
// volume.
func checkVolumes(t *testing.T, spec corev1.PodSpec, c corev1.Container) map[string]corev1.VolumeMount {
	t.Helper()
	byName := make(map[string]corev1.Volume)
	for _, v := range spec.Volumes {
		byName[v.Name] = v
	}
	mounts := make(map[string]corev1.VolumeMount)
	for _, vm := range c.VolumeMounts {
		if _, ok := byName[vm.Name]; !ok {
			t.Errorf("volumeMount %q names no volume", vm.Name)
		}
		mounts[vm.Name] = vm
	}
	for name := range byName {
		if _, ok := mounts[name]; !ok {
			t.Errorf("volume %q is not mounted", name)
		}
	}
	hostPath := func(path string) (corev1.Volume, corev1.VolumeMount) {
		for _, v := range spec.Volumes {
			if v.HostPath != nil && v.HostPath.Path == path {
				return v, mounts[v.Name]
			}
		}
		t.Errorf("no hostPath volume for %s", path)
		return corev1.Volume{}, corev1.VolumeMount{}
	}
	if v, vm := hostPath("/var/lib/npuprobe"); v.HostPath != nil {
		if v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectoryOrCreate {
			t.Errorf("snapshot volume type %v, want DirectoryOrCreate", v.HostPath.Type)
		}
		if vm.ReadOnly {
			t.Error("the snapshot volume is mounted read-only")
		}
	}
	if v, vm := hostPath("/sys/kernel/debug"); v.HostPath != nil {
		if !vm.ReadOnly || vm.MountPath != "/sys/kernel/debug" {
			t.Errorf("debugfs mount %+v: want it read-only at /sys/kernel/debug", vm)
		}
	}
	return mounts
}

// flagValue returns the value of --name in args (--name VALUE or
// --name=VALUE).
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func checkArgs(t *testing.T, ds *appsv1.DaemonSet, c corev1.Container, mounts map[string]corev1.VolumeMount) {
	t.Helper()
	args := c.Args
	if !slices.Contains(args, "--all") {
		t.Errorf("args %v: --all is missing (trace every process that maps the CANN runtime)", args)
	}
	volumeAt := func(path string) (corev1.Volume, bool) {
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if vm, ok := mounts[v.Name]; ok && vm.MountPath == path {
				return v, true
			}
		}
		return corev1.Volume{}, false
	}
	out, ok := flagValue(args, "--out")
	if v, mounted := volumeAt(out); !ok || !mounted || v.HostPath == nil || v.HostPath.Path != "/var/lib/npuprobe" {
		t.Errorf("--out %q is not the mount of the host's /var/lib/npuprobe", out)
	}
	sock, ok := flagValue(args, "--control")
	if !ok || sock != "/run/npuprobe/control.sock" {
		t.Errorf("--control %q, want /run/npuprobe/control.sock (npuprobe dump's default)", sock)
	}
	if v, mounted := volumeAt(filepath.Dir(sock)); !mounted || v.EmptyDir == nil {
		t.Errorf("the control socket's directory %s is not an emptyDir mount (the root filesystem is read-only)", filepath.Dir(sock))
	}
	addr, ok := flagValue(args, "--metrics-addr")
	_, port, err := net.SplitHostPort(addr)
	if !ok || err != nil {
		t.Fatalf("--metrics-addr %q: %v", addr, err)
	}
	var metricsPort *corev1.ContainerPort
	for i, p := range c.Ports {
		for _, msg := range validation.IsValidPortName(p.Name) {
			t.Errorf("port name %q: %s", p.Name, msg)
		}
		if p.Name == "metrics" {
			metricsPort = &c.Ports[i]
		}
	}
	if metricsPort == nil || port != strconv.Itoa(int(metricsPort.ContainerPort)) {
		t.Errorf("--metrics-addr %s is not the container port named metrics (%+v)", addr, c.Ports)
	}
	ann := ds.Spec.Template.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != port || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("Prometheus annotations %v, want scrape=true, port=%s, path=/metrics", ann, port)
	}
	// Stopping processes of other users at their dlopen (then continuing
	// them) needs CAP_KILL, which the DaemonSet does not have.
	if v, ok := flagValue(args, "--stop-on-load"); (ok && v != "false" && v != "auto") || slices.Contains(args, "--stop-on-load") {
		if !slices.Contains(c.SecurityContext.Capabilities.Add, "KILL") {
			t.Errorf("args %v stop processes at load without CAP_KILL to continue those of other users", args)
		}
	}
	checkFlagsExist(t, args)
}

// checkFlagsExist builds npuprobe and requires every flag in args to be
// one `npuprobe trace --help` lists.
func checkFlagsExist(t *testing.T, args []string) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "npuprobe")
	build := exec.Command("go", "build", "-o", bin, "github.com/npuprobe/npuprobe/cmd/npuprobe")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	help, err := exec.Command(bin, "trace", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("npuprobe trace --help: %v\n%s", err, help)
	}
	known := make(map[string]bool)
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?(--[a-z0-9-]+)`).FindAllStringSubmatch(string(help), -1) {
		known[m[1]] = true
	}
	for _, a := range args {
		if !strings.HasPrefix(a, "--") {
			continue
		}
		name, _, _ := strings.Cut(a, "=")
		if !known[name] {
			t.Errorf("args: npuprobe trace has no flag %s", name)
		}
	}
}

// TestEveryCapabilityAndMountExplained: each capability and each volume
// mount in the manifest has a comment right above it saying why.
func TestEveryCapabilityAndMountExplained(t *testing.T) {
	data, m := readManifest(t)
	lines := strings.Split(string(data), "\n")
	// commented requires each line matching re, between the lines
	// matching from and to, to follow a comment line.
	commented := func(re, from, to *regexp.Regexp, what string) {
		found, in := false, false
		for i, line := range lines {
			switch {
			case from.MatchString(line):
				in = true
			case to.MatchString(line):
				in = false
			}
			if !in || !re.MatchString(line) {
				continue
			}
			found = true
			if i == 0 || !strings.HasPrefix(strings.TrimSpace(lines[i-1]), "#") {
				t.Errorf("line %d (%s) has no comment above it saying why", i+1, strings.TrimSpace(line))
			}
		}
		if !found {
			t.Errorf("no %s found", what)
		}
	}
	addRE, dropRE := regexp.MustCompile(`^\s*add:\s*$`), regexp.MustCompile(`^\s*seccompProfile:`)
	mountsRE, volumesRE := regexp.MustCompile(`^\s*volumeMounts:\s*$`), regexp.MustCompile(`^\s*volumes:\s*$`)
	sc := m.daemonSet.Spec.Template.Spec.Containers[0].SecurityContext
	for _, c := range sc.Capabilities.Add {
		commented(regexp.MustCompile(`^\s*- `+regexp.QuoteMeta(string(c))+`\s*$`), addRE, dropRE, "capability "+string(c))
	}
	for _, vm := range m.daemonSet.Spec.Template.Spec.Containers[0].VolumeMounts {
		commented(regexp.MustCompile(`^\s*- name: `+regexp.QuoteMeta(vm.Name)+`\s*$`), mountsRE, volumesRE, "mount "+vm.Name)
	}
	if !bytes.Contains(data, []byte("github.com/Ascend/mind-cluster")) {
		t.Error("the node selector's source (the Ascend device plugin's manifest) is not cited")
	}
}
