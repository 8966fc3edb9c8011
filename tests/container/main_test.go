// Package container tests npuprobe's container image, as root with a
// Docker engine: the image is built from the repository's Dockerfile
// without any registry, and npuprobe, in its own container, traces
// workloads running in other containers (their own PID and mount
// namespaces, the fake CANN runtime only inside them). Every snapshot is
// checked against the workload's ground truth as in tests/e2e.
//
// docker-setup.sh (run by tests/run, and by TestMain when no daemon
// answers) installs Debian's docker.io and starts dockerd.
package container

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/tests/fixture"
)

var (
	repoRoot  string
	dockerBin string
	fixtures  *fixture.Paths
	// runID keeps this run's images and containers apart from another
	// run's on the same daemon.
	runID      string
	agentImage string // built from the Dockerfile
	// workloadImages hold the fixtures, imported twice: the same files in
	// two images are two files (two inodes) on the machine, as two
	// different training images would be.
	workloadImages [2]string
	// imageVersion is passed as the Dockerfile's VERSION; snapshots name it.
	imageVersion string
	imageSize    int64
	buildTime    time.Duration
)

// builderImage is the locally made stand-in for golang:1.26-bookworm,
// kept between runs (it only depends on this machine's Go).
const builderImagePrefix = "npuprobe-test/go-builder:"

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		fmt.Println("container: skipped in -short mode")
		os.Exit(0)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "container: these tests run Docker and load eBPF programs: run them as root (or go test -short to skip them)")
		os.Exit(1)
	}
	start := time.Now()
	cleanup, err := setup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "container setup:", err)
		cleanup()
		os.Exit(1)
	}
	fmt.Printf("container: image %s: %s (%d bytes, on scratch), built offline in %v; setup took %v\n",
		agentImage, humanBytes(imageSize), imageSize, buildTime.Round(time.Second), time.Since(start).Round(time.Second))
	code := m.Run()
	cleanup()
	fmt.Printf("container: %v in all\n", time.Since(start).Round(time.Second))
	os.Exit(code)
}

func setup() (cleanup func(), err error) {
	var dirs []string
	var images []string
	cleanup = func() {
		for _, img := range images {
			exec.Command(dockerBin, "rmi", "-f", img).Run()
		}
		for _, d := range dirs {
			os.RemoveAll(d)
		}
	}
	_, file, _, _ := runtime.Caller(0)
	repoRoot = filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
	if err := ensureDocker(filepath.Join(filepath.Dir(file), "docker-setup.sh")); err != nil {
		return cleanup, err
	}
	b := make([]byte, 4)
	rand.Read(b)
	runID = hex.EncodeToString(b)
	imageVersion = "container-test-" + runID

	work, err := os.MkdirTemp("", "npuprobe-container-")
	if err != nil {
		return cleanup, err
	}
	dirs = append(dirs, work)
	if err := os.Chmod(work, 0o755); err != nil {
		return cleanup, err
	}
	if fixtures, err = fixture.Build(filepath.Join(work, "fixtures")); err != nil {
		return cleanup, err
	}
	// The premise of tracing into another mount namespace: the runtime's
	// path in the workload image does not exist here.
	if _, err := os.Stat(workloadRoot); err == nil {
		return cleanup, fmt.Errorf("%s exists on this machine: the workload image's runtime must be reachable only inside its container", workloadRoot)
	}

	goVersion := strings.TrimPrefix(runtime.Version(), "go")
	builder := builderImagePrefix + goVersion
	if exec.Command(dockerBin, "image", "inspect", builder).Run() != nil {
		if err := importGoBuilder(builder); err != nil {
			return cleanup, err
		}
	}
	for i := range workloadImages {
		workloadImages[i] = fmt.Sprintf("npuprobe-test/workload%d:%s", i, runID)
		images = append(images, workloadImages[i])
		if err := importWorkload(workloadImages[i]); err != nil {
			return cleanup, err
		}
	}

	// The build context: the working tree with its modules vendored, so
	// that the build needs no network (docker build --network none).
	ctx := filepath.Join(work, "context")
	if err := copyRepo(ctx); err != nil {
		return cleanup, fmt.Errorf("copy the repository: %w", err)
	}
	vendor := exec.Command("go", "mod", "vendor")
	vendor.Dir = ctx
	if out, err := vendor.CombinedOutput(); err != nil {
		return cleanup, fmt.Errorf("go mod vendor: %v\n%s", err, out)
	}
	agentImage = "npuprobe-test/npuprobe:" + runID
	images = append(images, agentImage)
	var log bytes.Buffer
	t0 := time.Now()
	err = dockerBuild(ctx, agentImage, []string{
		"GO_IMAGE=" + builder,
		"RUNTIME_IMAGE=scratch",
		"VERSION=" + imageVersion,
	}, &log)
	buildTime = time.Since(t0)
	if err != nil {
		return cleanup, err
	}
	if !strings.Contains(log.String(), "building with the vendored modules") {
		return cleanup, fmt.Errorf("the build did not use vendor/:\n%s", tail(log.String(), 40))
	}
	out, err := exec.Command(dockerBin, "image", "inspect", "-f", "{{.Size}}", agentImage).Output()
	if err != nil {
		return cleanup, fmt.Errorf("docker image inspect %s: %v", agentImage, err)
	}
	if imageSize, err = strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64); err != nil {
		return cleanup, err
	}
	return cleanup, nil
}

// ensureDocker finds the docker command and a daemon, running
// docker-setup.sh when no daemon answers. Debian's /usr/bin/docker is
// preferred: it builds with the daemon's BuildKit without the buildx plugin.
func ensureDocker(setupScript string) error {
	if exec.Command("docker", "info").Run() != nil {
		fmt.Println("container: no Docker daemon answers; running", setupScript)
		cmd := exec.Command(setupScript)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %w", setupScript, err)
		}
	}
	dockerBin = "/usr/bin/docker"
	if _, err := os.Stat(dockerBin); err != nil {
		if dockerBin, err = exec.LookPath("docker"); err != nil {
			return err
		}
	}
	if out, err := exec.Command(dockerBin, "info").CombinedOutput(); err != nil {
		return fmt.Errorf("docker info: %v\n%s", err, out)
	}
	return nil
}

func humanBytes(n int64) string {
	return fmt.Sprintf("%.1f MB", float64(n)/1e6)
}
