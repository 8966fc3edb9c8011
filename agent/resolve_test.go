package agent

import (
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// expectedOffsets is the file offset of every aclrt* function of lib,
// derived without the agent's code: cilium/ebpf's symbol table of the file,
// checked by name, from the .dynsym addresses nm reports.
func expectedOffsets(t *testing.T, lib string) map[string]uint64 {
	t.Helper()
	ef, err := elf.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	defer ef.Close()
	ex, err := link.OpenExecutable(lib)
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]uint64)
	for name, v := range nmDefined(t, lib) {
		if !slices.Contains(apiFunctions, name) {
			continue
		}
		for _, p := range ef.Progs {
			if p.Type == elf.PT_LOAD && p.Flags&elf.PF_X != 0 && v >= p.Vaddr && v < p.Vaddr+p.Memsz {
				out[name] = v - p.Vaddr + p.Off
			}
		}
		if so, err := ex.Symbol(out[name]); err != nil || so.Symbol != name || so.Offset != 0 {
			t.Fatalf("%s: cilium/ebpf sees %+v (%v) at offset %#x", name, so, err, out[name])
		}
	}
	if len(out) != len(apiFunctions) {
		t.Fatalf("%s: offsets for %v, want all of %v", lib, sortedNames(out), apiFunctions)
	}
	return out
}

// mappingOf returns pid's first executable mapping of path.
func mappingOf(t *testing.T, pid int, path string) Mapping {
	t.Helper()
	maps, err := readMaps(pid)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range maps {
		if m.Path == path && m.Perms[2] == 'x' {
			return m
		}
	}
	t.Fatalf("process %d has no executable mapping of %s", pid, path)
	return Mapping{}
}

func inodeOf(t *testing.T, f *os.File) (ino uint64, major, minor uint32) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino, unix.Major(st.Dev), unix.Minor(st.Dev)
}

// checkCodeMapped reads, from the live process, the bytes mapped where the
// file offset off lands and compares them with the file's bytes there: the
// offset names code the process really runs, not just a place in the file.
func checkCodeMapped(t *testing.T, pid int, path string, name string, off uint64, file []byte) {
	t.Helper()
	maps, err := readMaps(pid)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range maps {
		if m.Path != path || m.Perms[2] != 'x' || off < m.Offset || off >= m.Offset+(m.End-m.Start) {
			continue
		}
		mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
		if err != nil {
			t.Fatal(err)
		}
		defer mem.Close()
		got := make([]byte, 16)
		if _, err := mem.ReadAt(got, int64(m.Start+off-m.Offset)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, file[off:off+16]) {
			t.Errorf("%s: process %d runs % x at file offset %#x, the file has % x", name, pid, got, off, file[off:off+16])
		}
		return
	}
	t.Errorf("%s: file offset %#x of %s is not mapped executable in process %d", name, off, path, pid)
}

// resolveSymbols on a running workload finds every function of the fake
// runtime, in it, at the right offsets, and keeps only that file open.
func TestResolveSymbolsLiveProcess(t *testing.T) {
	requireRoot(t)
	t.Parallel()
	paths := buildFixtures(t)
	w := startWorkload(t, paths, paths.Env())
	want := expectedOffsets(t, paths.Runtime)
	libBytes, err := os.ReadFile(paths.Runtime)
	if err != nil {
		t.Fatal(err)
	}

	names := append(slices.Clone(apiFunctions), "npuprobeNoSuchFunction")
	sites, used, err := resolveSymbols(w.pid, names, "aclrtMalloc", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer closeELFs(used)
	if got := sortedNames(sites); !slices.Equal(got, apiFunctions) {
		t.Errorf("resolved %v, want %v", got, apiFunctions)
	}
	for name, s := range sites {
		if s.elf.mapping.Path != paths.Runtime {
			t.Errorf("%s resolved in %s, want %s", name, s.elf.mapping.Path, paths.Runtime)
		}
		if s.offset != want[name] {
			t.Errorf("%s at file offset %#x, want %#x", name, s.offset, want[name])
		}
		if len(s.others) != 0 {
			t.Errorf("%s also defined in %v; only one file defines it", name, s.others)
		}
		checkCodeMapped(t, w.pid, paths.Runtime, name, s.offset, libBytes)
	}
	if len(used) != 1 || used[0].file == nil || used[0].mapping.Path != paths.Runtime {
		t.Fatalf("files kept open: %d, want only %s", len(used), paths.Runtime)
	}
	ino, _, _ := inodeOf(t, used[0].file)
	st, err := os.Stat(paths.Runtime)
	if err != nil {
		t.Fatal(err)
	}
	if ino != st.Sys().(*syscall.Stat_t).Ino {
		t.Errorf("kept file has inode %d, the runtime %d", ino, st.Sys().(*syscall.Stat_t).Ino)
	}

	// A required name the runtime libraries lack makes the resolver read
	// every other mapped file too: libc defines gettid.
	sites2, used2, err := resolveSymbols(w.pid, []string{"aclrtFree", "gettid"}, "gettid", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer closeELFs(used2)
	if s := sites2["gettid"]; s == nil || filepath.Base(s.elf.mapping.Path) != "libc.so.6" {
		t.Errorf("gettid resolved to %+v, want libc.so.6", s)
	}
	if s := sites2["aclrtFree"]; s == nil || s.elf.mapping.Path != paths.Runtime {
		t.Errorf("aclrtFree resolved to %+v, want %s", s, paths.Runtime)
	}
}

// In the CANN 8.5 layout both the forwarding libascendcl.so and
// libacl_rt.so define every function: each resolves once, in the
// forwarder the process binds to, with libacl_rt.so reported as the other
// definition and not kept open.
func TestResolveSymbolsCompatLayout(t *testing.T) {
	requireRoot(t)
	t.Parallel()
	paths := buildFixtures(t)
	w := startWorkload(t, paths, paths.CompatEnv())
	fwd := filepath.Join(paths.CompatLibDir, "libascendcl.so")
	rt := filepath.Join(paths.CompatLibDir, "libacl_rt.so")
	mappingOf(t, w.pid, rt) // the premise: both are mapped
	want := expectedOffsets(t, fwd)
	rtOffsets := expectedOffsets(t, rt)

	sites, used, err := resolveSymbols(w.pid, apiFunctions, "aclrtMalloc", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer closeELFs(used)
	if got := sortedNames(sites); !slices.Equal(got, apiFunctions) {
		t.Errorf("resolved %v, want %v", got, apiFunctions)
	}
	for name, s := range sites {
		if s.elf.mapping.Path != fwd || s.offset != want[name] {
			t.Errorf("%s resolved to %s at %#x, want %s at %#x (libacl_rt.so has it at %#x)",
				name, s.elf.mapping.Path, s.offset, fwd, want[name], rtOffsets[name])
		}
		if !slices.Equal(s.others, []string{rt}) {
			t.Errorf("%s: also defined in %v, want [%s]", name, s.others, rt)
		}
	}
	if len(used) != 1 || used[0].mapping.Path != fwd {
		var kept []string
		for _, e := range used {
			kept = append(kept, e.mapping.Path)
		}
		t.Errorf("files kept open %v, want only %s", kept, fwd)
	}
}

func TestOpenMappedFile(t *testing.T) {
	requireRoot(t)
	t.Parallel()
	paths := buildFixtures(t)
	w := startWorkload(t, paths, paths.Env())
	m := mappingOf(t, w.pid, paths.Runtime)
	f, err := openMappedFile(w.pid, m)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ino, major, minor := inodeOf(t, f)
	if ino != m.Inode || major != m.DevMajor || minor != m.DevMinor {
		t.Errorf("opened inode %d on %d:%d, mapped %d on %d:%d", ino, major, minor, m.Inode, m.DevMajor, m.DevMinor)
	}
	disk, err := os.Open(paths.Runtime)
	if err != nil {
		t.Fatal(err)
	}
	defer disk.Close()
	if dino, _, _ := inodeOf(t, disk); dino != ino {
		t.Errorf("opened inode %d, %s is inode %d", ino, paths.Runtime, dino)
	}
}

// A library replaced on disk under a running process (an upgrade: a new
// file renamed over the old path) must still be read from the inode the
// process mapped, through /proc/PID/map_files, whether the caller's mapping
// predates the replacement (path now names another inode) or was read after
// it (the kernel marks the path deleted). The replacement is the
// compatibility forwarder: the same function names at other offsets, so
// reading the wrong file would move every probe.
func TestOpenMappedFileAfterReplace(t *testing.T) {
	requireRoot(t)
	t.Parallel()
	paths := buildFixtures(t)
	// A private copy of the runtime, since the test replaces it.
	libDir := t.TempDir()
	runtime := filepath.Join(libDir, "libascendcl.so")
	orig, err := os.ReadFile(paths.Runtime)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(runtime, orig, 0o755); err != nil {
		t.Fatal(err)
	}
	w := startWorkload(t, paths, []string{"LD_LIBRARY_PATH=" + libDir})
	before := mappingOf(t, w.pid, runtime)
	want := expectedOffsets(t, runtime)
	replacement := filepath.Join(paths.CompatLibDir, "libascendcl.so")
	other := expectedOffsets(t, replacement)
	if mapsEqual := func() bool {
		for n := range want {
			if want[n] != other[n] {
				return false
			}
		}
		return true
	}(); mapsEqual {
		t.Fatal("precondition: the replacement has the same offsets")
	}

	data, err := os.ReadFile(replacement)
	if err != nil {
		t.Fatal(err)
	}
	tmp := runtime + ".new"
	if err := os.WriteFile(tmp, data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, runtime); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(runtime)
	if err != nil {
		t.Fatal(err)
	}
	if st.Sys().(*syscall.Stat_t).Ino == before.Inode {
		t.Fatal("precondition: the replacement has the mapped inode number")
	}

	check := func(what string, m Mapping) {
		t.Helper()
		f, err := openMappedFile(w.pid, m)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		defer f.Close()
		ino, major, minor := inodeOf(t, f)
		if ino != before.Inode || major != before.DevMajor || minor != before.DevMinor {
			t.Errorf("%s: opened inode %d on %d:%d, the process mapped %d on %d:%d",
				what, ino, major, minor, before.Inode, before.DevMajor, before.DevMinor)
		}
		// And its content is the original library, not the replacement.
		head := make([]byte, 4096)
		if _, err := io.ReadFull(f, head); err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(head, data[:4096]) {
			t.Errorf("%s: opened the replacement's content", what)
		}
	}
	check("mapping read before the replacement", before)

	after := mappingOf(t, w.pid, runtime)
	if !after.Deleted || after.Inode != before.Inode {
		t.Errorf("after the replacement maps shows %+v, want the old inode marked deleted", after)
	}
	check("mapping read after the replacement", after)

	// The whole resolution reads the mapped file.
	sites, used, err := resolveSymbols(w.pid, apiFunctions, "aclrtMalloc", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer closeELFs(used)
	for _, name := range apiFunctions {
		s := sites[name]
		if s == nil || s.offset != want[name] {
			t.Errorf("%s after the replacement: %+v, want offset %#x (the replacement has %#x)", name, s, want[name], other[name])
		}
	}
}

// openInRoot resolves paths inside the target's root, so an absolute or
// dot-dot symlink in a container image cannot make the privileged agent open
// a host file. The target here is a process chrooted into a directory that
// has its own /etc/hostname.
func TestOpenInRootStaysInRoot(t *testing.T) {
	requireRoot(t)
	t.Parallel()
	root := t.TempDir()
	for _, d := range []string{"bin", "etc", "lib"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	compileC(t, filepath.Join(root, "bin", "pause"), "#include <unistd.h>\nint main(void) { pause(); return 0; }\n", "-static")
	if err := os.WriteFile(filepath.Join(root, "etc", "hostname"), []byte("inside the container\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{
		"absolute": "/etc/hostname",
		"dotdot":   "../../../../../../../../etc/hostname",
	} {
		if err := os.Symlink(target, filepath.Join(root, "lib", name)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("/bin/pause")
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })

	for _, p := range []string{"/etc/hostname", "/lib/absolute", "/lib/dotdot", "/../../etc/hostname"} {
		f, err := openInRoot(cmd.Process.Pid, p)
		if err != nil {
			t.Errorf("openInRoot(%s): %v", p, err)
			continue
		}
		b, _ := io.ReadAll(f)
		f.Close()
		if string(b) != "inside the container\n" {
			t.Errorf("openInRoot(%s) read %q: it left the target's root", p, b)
		}
	}
	if f, err := openInRoot(cmd.Process.Pid, "/lib/missing"); err == nil {
		f.Close()
		t.Error("openInRoot of a missing file succeeded")
	}
}
