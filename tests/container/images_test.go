package container

// Making images without a registry. No registry is reachable where these
// tests run, so every base image is made here, from files of this machine:
// a root filesystem is written as a tar stream straight into
// `docker import`. Programs come with the shared libraries ldd says they
// load.

import (
	"archive/tar"
	"bufio"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"
)

// rootfs writes a root filesystem as a tar stream.
type rootfs struct {
	tw   *tar.Writer
	seen map[string]bool
	err  error
}

func newRootfs(w io.Writer) *rootfs {
	return &rootfs{tw: tar.NewWriter(w), seen: make(map[string]bool)}
}

func (r *rootfs) header(h *tar.Header) {
	if r.err != nil {
		return
	}
	h.Name = strings.TrimPrefix(path.Clean(h.Name), "/")
	if h.Typeflag == tar.TypeDir {
		h.Name += "/"
	}
	h.ModTime = time.Unix(0, 0)
	r.err = r.tw.WriteHeader(h)
}

// dir adds dir and its missing parents.
func (r *rootfs) dir(dir string, mode int64) {
	dir = path.Clean("/" + dir)
	if dir == "/" || r.seen[dir] {
		return
	}
	r.dir(path.Dir(dir), 0o755)
	r.seen[dir] = true
	r.header(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: mode})
}

// file adds the content of the host file src (symlinks followed) as dst.
func (r *rootfs) file(dst, src string) {
	if r.err != nil || r.seen[dst] {
		return
	}
	f, err := os.Open(src)
	if err != nil {
		r.err = err
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		r.err = err
		return
	}
	r.dir(path.Dir(dst), 0o755)
	r.seen[dst] = true
	r.header(&tar.Header{Typeflag: tar.TypeReg, Name: dst, Mode: int64(st.Mode().Perm()), Size: st.Size()})
	if r.err == nil {
		_, r.err = io.Copy(r.tw, f)
	}
}

// text adds a file with the given content.
func (r *rootfs) text(dst, content string) {
	r.dir(path.Dir(dst), 0o755)
	r.seen[dst] = true
	r.header(&tar.Header{Typeflag: tar.TypeReg, Name: dst, Mode: 0o644, Size: int64(len(content))})
	if r.err == nil {
		_, r.err = io.WriteString(r.tw, content)
	}
}

func (r *rootfs) symlink(dst, target string) {
	if r.seen[dst] {
		return
	}
	r.dir(path.Dir(dst), 0o755)
	r.seen[dst] = true
	r.header(&tar.Header{Typeflag: tar.TypeSymlink, Name: dst, Linkname: target, Mode: 0o777})
}

// tree adds the host directory src as dst, except the relative paths skip
// returns true for.
func (r *rootfs) tree(dst, src string, skip func(rel string) bool) {
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil || r.err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if rel != "." && skip != nil && skip(filepath.ToSlash(rel)) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		target := path.Join(dst, filepath.ToSlash(rel))
		switch {
		case d.IsDir():
			r.dir(target, 0o755)
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			r.symlink(target, link)
		case d.Type().IsRegular():
			r.file(target, p)
		}
		return nil
	})
	if r.err == nil {
		r.err = err
	}
}

// program adds the host program src as dst, with every shared library it
// loads (ldd, run with env) at the path it has on this machine, except
// those under skipDir (the caller places them).
func (r *rootfs) program(dst, src string, env []string, skipDir string) {
	r.file(dst, src)
	libs, err := sharedLibraries(src, env)
	if err != nil {
		r.err = err
		return
	}
	for _, lib := range libs {
		if skipDir == "" || !strings.HasPrefix(lib, skipDir+"/") {
			r.file(lib, lib)
		}
	}
}

func (r *rootfs) close() error {
	if r.err != nil {
		return r.err
	}
	return r.tw.Close()
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// sharedLibraries returns the absolute paths ldd prints for program,
// the dynamic loader included; none for a static program.
func sharedLibraries(program string, env []string) ([]string, error) {
	cmd := exec.Command("ldd", program)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		if bytes.Contains(out, []byte("not a dynamic executable")) {
			return nil, nil
		}
		return nil, fmt.Errorf("ldd %s: %v\n%s", program, err, out)
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.Contains(line, "not found") {
			return nil, fmt.Errorf("ldd %s: %s", program, line)
		}
		// "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
		// "/lib64/ld-linux-x86-64.so.2 (0x...)"; linux-vdso has no file.
		if _, after, ok := strings.Cut(line, "=> "); ok {
			line = after
		}
		if p, _, _ := strings.Cut(line, " "); strings.HasPrefix(p, "/") {
			libs = append(libs, p)
		}
	}
	return libs, nil
}

// importImage runs `docker import` of the root filesystem fill writes,
// with the Dockerfile-like changes (ENV, WORKDIR, ...).
func importImage(name string, changes []string, fill func(*rootfs)) error {
	args := []string{"import"}
	for _, c := range changes {
		args = append(args, "--change", c)
	}
	args = append(args, "-", name)
	cmd := exec.Command(dockerBin, args...)
	pr, pw := io.Pipe()
	cmd.Stdin = pr
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return err
	}
	r := newRootfs(pw)
	fill(r)
	err := r.close()
	pw.CloseWithError(err)
	if werr := cmd.Wait(); werr != nil && err == nil {
		err = fmt.Errorf("docker import %s: %v\n%s", name, werr, out.Bytes())
	}
	return err
}

// importGoBuilder makes the builder base for the Dockerfile's GO_IMAGE:
// this machine's Go installation and a POSIX shell (the Dockerfile's RUN
// needs sh and go, nothing else), as golang images lay them out.
func importGoBuilder(name string) error {
	goroot, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		return fmt.Errorf("go env GOROOT: %v", err)
	}
	root := strings.TrimSpace(string(goroot))
	return importImage(name, []string{
		"ENV PATH=/usr/local/go/bin:/bin",
		"ENV HOME=/root",
		"ENV GOTOOLCHAIN=local",
	}, func(r *rootfs) {
		r.dir("/tmp", 0o1777)
		r.dir("/root", 0o700)
		r.program("/bin/sh", "/bin/sh", nil, "")
		// What building needs: the tools, the standard library's
		// sources and its go.env; not the tests and documents.
		r.tree("/usr/local/go", root, func(rel string) bool {
			switch strings.SplitN(rel, "/", 2)[0] {
			case "test", "doc", "api", "misc":
				return true
			}
			return false
		})
	})
}

// workloadRoot is where the workload image keeps the fake CANN runtime and
// the workloads: a path that exists on no host (the test checks), so only
// a tracer that looks inside the container's mount namespace finds them.
const workloadRoot = "/opt/npu"

// importWorkload makes a workload image: the fixtures' segment_workload
// and late_workload in /opt/npu/bin, the fake runtime in /opt/npu/lib, and
// the C library they load; a file naming the image makes each image's
// layer, and so its files, its own.
func importWorkload(name string) error {
	libDir := workloadRoot + "/lib"
	programs := []string{fixtures.SegmentWorkload, fixtures.LateWorkload}
	// The loader finds the runtime as in a CANN install, through
	// LD_LIBRARY_PATH, and the C library where ldd found it (without an
	// ld.so.cache, multiarch directories are not searched).
	dirs := []string{libDir}
	for _, p := range programs {
		libs, err := sharedLibraries(p, fixtures.Env())
		if err != nil {
			return err
		}
		for _, lib := range libs {
			if d := path.Dir(lib); !strings.HasPrefix(lib, fixtures.LibDir+"/") && !contains(dirs, d) {
				dirs = append(dirs, d)
			}
		}
	}
	return importImage(name, []string{"ENV LD_LIBRARY_PATH=" + strings.Join(dirs, ":")}, func(r *rootfs) {
		r.dir("/tmp", 0o1777)
		r.dir("/gt", 0o777)
		r.text("/etc/npuprobe-test-image", name+"\n")
		r.file(libDir+"/libascendcl.so", fixtures.Runtime)
		for _, p := range programs {
			r.program(workloadRoot+"/bin/"+filepath.Base(p), p, fixtures.Env(), fixtures.LibDir)
		}
	})
}

// dockerBuild builds the context dir as tag with BuildKit, without network
// access (--network none: every RUN step runs with no network at all).
func dockerBuild(dir, tag string, buildArgs []string, log io.Writer) error {
	args := []string{"build", "--network", "none", "--progress", "plain", "-t", tag}
	for _, a := range buildArgs {
		args = append(args, "--build-arg", a)
	}
	args = append(args, dir)
	cmd := exec.Command(dockerBin, args...)
	cmd.Env = append(os.Environ(), "DOCKER_BUILDKIT=1")
	var out bytes.Buffer
	cmd.Stdout = io.MultiWriter(&out, log)
	cmd.Stderr = cmd.Stdout
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("docker %s: %v\n%s", strings.Join(args, " "), err, tail(out.String(), 60))
	}
	return nil
}

func tail(s string, lines int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// copyRepo copies the repository's working tree (without .git and any
// vendor/) to dst, the build context.
func copyRepo(dst string) error {
	return filepath.WalkDir(repoRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(repoRoot, p)
		if rel == ".git" || rel == "vendor" {
			return filepath.SkipDir
		}
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.MkdirAll(target, 0o755)
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(link, target)
		case d.Type().IsRegular():
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			return os.WriteFile(target, data, info.Mode().Perm())
		}
		return nil
	})
}
