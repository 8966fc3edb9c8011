package output_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/npuprobe/npuprobe/output"
)

// mountTmpfs mounts a fresh tmpfs and returns its path; it skips the test
// when mounting is not possible (not root, or no CAP_SYS_ADMIN in a
// container), because only a real read-only or full file system shows the
// behaviour (root bypasses permission bits).
func mountTmpfs(t *testing.T, flags uintptr, data string) string {
	t.Helper()
	mp := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", flags|unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		t.Skipf("cannot mount a tmpfs (%v): this test needs root with CAP_SYS_ADMIN", err)
	}
	// Registered after TempDir's cleanup, so it runs before it.
	t.Cleanup(func() {
		if err := unix.Unmount(mp, 0); err != nil {
			t.Errorf("unmount %s: %v", mp, err)
		}
	})
	return mp
}

// names lists dir's entries, hidden ones included.
func names(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := []string{}
	for _, de := range des {
		out = append(out, de.Name())
	}
	sort.Strings(out)
	return out
}

func expectNames(t *testing.T, dir string, want ...string) {
	t.Helper()
	if want == nil {
		want = []string{}
	}
	sort.Strings(want)
	if got := names(t, dir); !equalStrings(got, want) {
		t.Errorf("%s holds %q, want %q", dir, got, want)
	}
}

func equalStrings(a, b []string) bool {
	return strings.Join(a, "\x00") == strings.Join(b, "\x00") && len(a) == len(b)
}

func openDir(t *testing.T, dir string) *output.Dir {
	t.Helper()
	d, err := output.OpenDir(dir)
	if err != nil {
		t.Fatalf("OpenDir(%s): %v", dir, err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func writeBytes(b []byte) func(io.Writer) error {
	return func(w io.Writer) error {
		_, err := w.Write(b)
		return err
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestOpenDir(t *testing.T) {
	t.Run("ok", func(t *testing.T) {
		dir := t.TempDir()
		d, err := output.OpenDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if d.Path() != dir {
			t.Errorf("Path() = %q, want %q", d.Path(), dir)
		}
		expectNames(t, dir) // the probe file is gone
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	t.Run("missing", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "nope")
		d, err := output.OpenDir(dir)
		if err == nil {
			d.Close()
			t.Fatal("OpenDir of a missing directory succeeded")
		}
		if !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("err = %v, want ErrNotExist", err)
		}
		var pe *fs.PathError
		if !errors.As(err, &pe) || pe.Path != dir {
			t.Errorf("err = %#v, want a PathError naming %s", err, dir)
		}
	})
	t.Run("file", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "file")
		if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		d, err := output.OpenDir(path)
		if err == nil {
			d.Close()
			t.Fatal("OpenDir of a regular file succeeded")
		}
		if !errors.Is(err, unix.ENOTDIR) {
			t.Errorf("err = %v, want ENOTDIR", err)
		}
	})
	t.Run("read-only", func(t *testing.T) {
		mp := mountTmpfs(t, unix.MS_RDONLY, "size=64k")
		d, err := output.OpenDir(mp)
		if err == nil {
			d.Close()
			t.Fatal("OpenDir of a read-only file system succeeded")
		}
		if !errors.Is(err, unix.EROFS) {
			t.Errorf("err = %v, want EROFS", err)
		}
		var pe *fs.PathError
		if !errors.As(err, &pe) || pe.Path != mp {
			t.Errorf("err = %#v, want a PathError naming %s", err, mp)
		}
	})
}

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	d := openDir(t, dir)
	path, err := d.WriteFile("snap.pickle", writeBytes([]byte("hello")))
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "snap.pickle"); path != want {
		t.Errorf("path %q, want %q", path, want)
	}
	if got := readFile(t, path); got != "hello" {
		t.Errorf("content %q", got)
	}
	// An empty file is a file too.
	if _, err := d.WriteFile("empty", func(io.Writer) error { return nil }); err != nil {
		t.Fatal(err)
	}
	expectNames(t, dir, "snap.pickle", "empty")
	if got := readFile(t, filepath.Join(dir, "empty")); got != "" {
		t.Errorf("empty file holds %q", got)
	}
}

func TestWriteFileMode(t *testing.T) {
	for _, mask := range []int{0, 0o002, 0o022, 0o077, 0o777} {
		t.Run(fmt.Sprintf("umask %04o", mask), func(t *testing.T) {
			old := unix.Umask(mask)
			defer unix.Umask(old)
			dir := t.TempDir()
			d := openDir(t, dir)
			for _, replace := range []bool{false, true} {
				name := fmt.Sprintf("f-%v", replace)
				write := d.WriteFile
				if replace {
					write = d.ReplaceFile
				}
				path, err := write(name, writeBytes([]byte("data")))
				if err != nil {
					t.Fatal(err)
				}
				fi, err := os.Lstat(path)
				if err != nil {
					t.Fatal(err)
				}
				if !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o600 || fi.Mode()&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky) != 0 {
					t.Errorf("%s: mode %v, want -rw-------", name, fi.Mode())
				}
			}
		})
	}
	if output.FileMode != 0o600 {
		t.Errorf("FileMode = %o", output.FileMode)
	}
}

func TestWriteFileNeverReplaces(t *testing.T) {
	tests := []struct {
		name  string
		plant func(t *testing.T, dir, outside string)
	}{
		{"regular file", func(t *testing.T, dir, outside string) {
			if err := os.WriteFile(filepath.Join(dir, "snap"), []byte("old"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"empty file", func(t *testing.T, dir, outside string) {
			if err := os.WriteFile(filepath.Join(dir, "snap"), nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"directory", func(t *testing.T, dir, outside string) {
			if err := os.Mkdir(filepath.Join(dir, "snap"), 0o755); err != nil {
				t.Fatal(err)
			}
		}},
		{"symlink to a file", func(t *testing.T, dir, outside string) {
			if err := os.Symlink(filepath.Join(outside, "target"), filepath.Join(dir, "snap")); err != nil {
				t.Fatal(err)
			}
		}},
		{"dangling symlink", func(t *testing.T, dir, outside string) {
			if err := os.Symlink(filepath.Join(outside, "missing"), filepath.Join(dir, "snap")); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir, outside := t.TempDir(), t.TempDir()
			if err := os.WriteFile(filepath.Join(outside, "target"), []byte("target"), 0o644); err != nil {
				t.Fatal(err)
			}
			tt.plant(t, dir, outside)
			before, err := os.Lstat(filepath.Join(dir, "snap"))
			if err != nil {
				t.Fatal(err)
			}
			d := openDir(t, dir)
			path, err := d.WriteFile("snap", writeBytes([]byte("new")))
			if !errors.Is(err, output.ErrExists) {
				t.Errorf("WriteFile over a %s: err = %v, want ErrExists", tt.name, err)
			}
			if path != "" {
				t.Errorf("path %q on failure", path)
			}
			after, err := os.Lstat(filepath.Join(dir, "snap"))
			if err != nil {
				t.Fatal(err)
			}
			if !os.SameFile(before, after) || before.Mode() != after.Mode() || before.Size() != after.Size() {
				t.Errorf("the existing %s was changed", tt.name)
			}
			if tt.name == "regular file" {
				if got := readFile(t, filepath.Join(dir, "snap")); got != "old" {
					t.Errorf("existing file now holds %q", got)
				}
			}
			expectNames(t, dir, "snap") // no temporary file left
			if got := readFile(t, filepath.Join(outside, "target")); got != "target" {
				t.Errorf("symlink target now holds %q", got)
			}
			expectNames(t, outside, "target") // nothing created through the link
		})
	}
}

func TestReplaceFile(t *testing.T) {
	t.Run("new name", func(t *testing.T) {
		dir := t.TempDir()
		d := openDir(t, dir)
		path, err := d.ReplaceFile("out.pickle", writeBytes([]byte("v1")))
		if err != nil || path != filepath.Join(dir, "out.pickle") {
			t.Fatalf("ReplaceFile = %q, %v", path, err)
		}
		if got := readFile(t, path); got != "v1" {
			t.Errorf("content %q", got)
		}
	})
	t.Run("existing file is replaced by a new inode", func(t *testing.T) {
		dir := t.TempDir()
		name := filepath.Join(dir, "out.pickle")
		if err := os.WriteFile(name, []byte("old content"), 0o644); err != nil {
			t.Fatal(err)
		}
		// A hard link keeps the old inode visible: replacing must not
		// truncate and rewrite it in place.
		if err := os.Link(name, filepath.Join(dir, "keep")); err != nil {
			t.Fatal(err)
		}
		d := openDir(t, dir)
		if _, err := d.ReplaceFile("out.pickle", writeBytes([]byte("new"))); err != nil {
			t.Fatal(err)
		}
		if got := readFile(t, name); got != "new" {
			t.Errorf("content %q, want new", got)
		}
		if got := readFile(t, filepath.Join(dir, "keep")); got != "old content" {
			t.Errorf("the old inode was rewritten: %q", got)
		}
		fi, _ := os.Stat(name)
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("mode %v, want 0600 (not the replaced file's 0644)", fi.Mode())
		}
		expectNames(t, dir, "out.pickle", "keep")
	})
	t.Run("symlink is replaced, not followed", func(t *testing.T) {
		dir, outside := t.TempDir(), t.TempDir()
		target := filepath.Join(outside, "target")
		if err := os.WriteFile(target, []byte("target"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, filepath.Join(dir, "out.pickle")); err != nil {
			t.Fatal(err)
		}
		d := openDir(t, dir)
		if _, err := d.ReplaceFile("out.pickle", writeBytes([]byte("new"))); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Lstat(filepath.Join(dir, "out.pickle"))
		if err != nil || !fi.Mode().IsRegular() {
			t.Fatalf("out.pickle is %v, %v; want a regular file", fi.Mode(), err)
		}
		if got := readFile(t, filepath.Join(dir, "out.pickle")); got != "new" {
			t.Errorf("content %q", got)
		}
		if got := readFile(t, target); got != "target" {
			t.Errorf("the symlink's target was written: %q", got)
		}
	})
	t.Run("directory is not replaced", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Mkdir(filepath.Join(dir, "out.pickle"), 0o755); err != nil {
			t.Fatal(err)
		}
		d := openDir(t, dir)
		if _, err := d.ReplaceFile("out.pickle", writeBytes([]byte("new"))); err == nil {
			t.Error("ReplaceFile over a directory succeeded")
		}
		expectNames(t, dir, "out.pickle")
		if fi, err := os.Lstat(filepath.Join(dir, "out.pickle")); err != nil || !fi.IsDir() {
			t.Errorf("the directory is gone")
		}
	})
	t.Run("readers see old or new, never partial", func(t *testing.T) {
		dir := t.TempDir()
		d := openDir(t, dir)
		const size = 512 << 10
		content := func(c byte) []byte { return bytes.Repeat([]byte{c}, size) }
		if _, err := d.ReplaceFile("live", writeBytes(content('a'))); err != nil {
			t.Fatal(err)
		}
		var stop atomic.Bool
		var wg sync.WaitGroup
		var reads atomic.Int64
		errs := make(chan error, 1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				b, err := os.ReadFile(filepath.Join(dir, "live"))
				if err == nil && (len(b) != size || bytes.Count(b, b[:1]) != size) {
					err = fmt.Errorf("read %d bytes, first %q, not uniform", len(b), b[:min(1, len(b))])
				}
				if err != nil {
					errs <- err
					return
				}
				reads.Add(1)
			}
		}()
		for i := 0; i < 40; i++ {
			if _, err := d.ReplaceFile("live", writeBytes(content(byte('b'+i%20)))); err != nil {
				t.Fatal(err)
			}
		}
		stop.Store(true)
		wg.Wait()
		select {
		case err := <-errs:
			t.Errorf("reader: %v", err)
		default:
		}
		if reads.Load() == 0 {
			t.Errorf("the reader never read")
		}
		expectNames(t, dir, "live")
	})
}

var errCallback = errors.New("callback failed")

func TestWriteFileCallbackFails(t *testing.T) {
	tests := []struct {
		name  string
		write func(w io.Writer) error
	}{
		{"before writing", func(w io.Writer) error { return errCallback }},
		{"after a little", func(w io.Writer) error {
			w.Write([]byte("partial"))
			return errCallback
		}},
		{"after more than the buffer", func(w io.Writer) error {
			// 3 MiB: past the 1 MiB buffer, so data reached the file.
			for i := 0; i < 3; i++ {
				if _, err := w.Write(bytes.Repeat([]byte{'x'}, 1<<20)); err != nil {
					return err
				}
			}
			return fmt.Errorf("midway: %w", errCallback)
		}},
	}
	for _, tt := range tests {
		for _, replace := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/replace=%v", tt.name, replace), func(t *testing.T) {
				dir := t.TempDir()
				d := openDir(t, dir)
				write := d.WriteFile
				if replace {
					write = d.ReplaceFile
				}
				path, err := write("snap", tt.write)
				if !errors.Is(err, errCallback) {
					t.Errorf("err = %v, want the callback's error", err)
				}
				if path != "" {
					t.Errorf("path %q on failure", path)
				}
				expectNames(t, dir)
			})
		}
	}
	t.Run("existing file survives a failed replace", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "snap"), []byte("old"), 0o600); err != nil {
			t.Fatal(err)
		}
		d := openDir(t, dir)
		if _, err := d.ReplaceFile("snap", tests[2].write); !errors.Is(err, errCallback) {
			t.Errorf("err = %v", err)
		}
		if got := readFile(t, filepath.Join(dir, "snap")); got != "old" {
			t.Errorf("content %q, want old", got)
		}
		expectNames(t, dir, "snap")
	})
	t.Run("panic", func(t *testing.T) {
		dir := t.TempDir()
		d := openDir(t, dir)
		func() {
			defer func() {
				if r := recover(); r != "boom" {
					t.Errorf("recovered %v, want the callback's panic", r)
				}
			}()
			d.WriteFile("snap", func(w io.Writer) error {
				w.Write(bytes.Repeat([]byte{'x'}, 2<<20))
				panic("boom")
			})
		}()
		expectNames(t, dir)
	})
}

func TestWriteFileDiskFull(t *testing.T) {
	mp := mountTmpfs(t, 0, "size=64k")
	d := openDir(t, mp)
	tests := []struct {
		name  string
		write func(w io.Writer) error
	}{
		{"one 1 MiB write", writeBytes(bytes.Repeat([]byte{'x'}, 1<<20))},
		{"4 KiB writes", func(w io.Writer) error {
			chunk := bytes.Repeat([]byte{'y'}, 4096)
			for i := 0; i < 256; i++ {
				if _, err := w.Write(chunk); err != nil {
					return err
				}
			}
			return nil
		}},
		{"3 MiB, past the buffer", func(w io.Writer) error {
			for i := 0; i < 3; i++ {
				if _, err := w.Write(bytes.Repeat([]byte{'z'}, 1<<20)); err != nil {
					return err
				}
			}
			return nil
		}},
	}
	for _, tt := range tests {
		for _, replace := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/replace=%v", tt.name, replace), func(t *testing.T) {
				write := d.WriteFile
				if replace {
					write = d.ReplaceFile
				}
				path, err := write("big.pickle", tt.write)
				if err == nil {
					t.Fatalf("writing 1 MiB to a 64 KiB file system succeeded: %s", path)
				}
				if !errors.Is(err, unix.ENOSPC) {
					t.Errorf("err = %v, want ENOSPC", err)
				}
				expectNames(t, mp)
			})
		}
	}
	// The space was given back: a small file still fits.
	if _, err := d.WriteFile("small", writeBytes(bytes.Repeat([]byte{'s'}, 16<<10))); err != nil {
		t.Errorf("a 16 KiB file after the failures: %v", err)
	}
	expectNames(t, mp, "small")
}

func TestInvalidNames(t *testing.T) {
	for _, name := range []string{"", ".", "..", "a/b", "/etc/passwd", "../escape", "sub/", "/"} {
		for _, replace := range []bool{false, true} {
			t.Run(fmt.Sprintf("%q/replace=%v", name, replace), func(t *testing.T) {
				dir := t.TempDir()
				d := openDir(t, dir)
				write := d.WriteFile
				if replace {
					write = d.ReplaceFile
				}
				called := false
				path, err := write(name, func(w io.Writer) error {
					called = true
					_, err := w.Write([]byte("x"))
					return err
				})
				if err == nil || !strings.Contains(err.Error(), "invalid file name") {
					t.Errorf("err = %v, want invalid file name", err)
				}
				if called || path != "" {
					t.Errorf("callback called %v, path %q", called, path)
				}
				expectNames(t, dir)
			})
		}
	}
	t.Run("NUL byte", func(t *testing.T) {
		dir := t.TempDir()
		d := openDir(t, dir)
		if _, err := d.WriteFile("a\x00b", writeBytes([]byte("x"))); err == nil {
			t.Error("a name with a NUL byte was accepted")
		}
		expectNames(t, dir)
	})
}

// TestDirFollowsRename: files go to the directory that was opened, even
// after its path is renamed and replaced by a symlink elsewhere.
func TestDirFollowsRename(t *testing.T) {
	root := t.TempDir()
	orig, moved, other := filepath.Join(root, "out"), filepath.Join(root, "moved"), filepath.Join(root, "other")
	for _, p := range []string{orig, other} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	d := openDir(t, orig)
	if err := os.Rename(orig, moved); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, orig); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteFile("snap", writeBytes([]byte("x"))); err != nil {
		t.Fatal(err)
	}
	expectNames(t, moved, "snap")
	expectNames(t, other)
}
