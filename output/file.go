package output

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// FileMode is the mode of every file npuprobe writes: snapshots reveal a
// process's memory layout and addresses, so only their owner reads them.
const FileMode = 0o600

// Dir is an output directory, opened once so that every file is created
// relative to the same directory even if its path is renamed or replaced by
// a symlink later.
type Dir struct {
	path string
	fd   int
}

// OpenDir opens dir for writing snapshots and proves it writable by creating
// and removing a probe file, so that a bad directory is refused at start,
// not when the first snapshot is due.
func OpenDir(dir string) (*Dir, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	d := &Dir{path: dir, fd: fd}
	probe, err := d.createTemp("probe")
	if err != nil {
		d.Close()
		return nil, &os.PathError{Op: "create file in", Path: dir, Err: err}
	}
	probe.f.Close()
	probe.remove()
	return d, nil
}

// Path is the directory's path as given.
func (d *Dir) Path() string { return d.path }

// Close releases the directory.
func (d *Dir) Close() error { return unix.Close(d.fd) }

type tempFile struct {
	d    *Dir
	name string
	f    *os.File
}

func (t *tempFile) remove() { unix.Unlinkat(t.d.fd, t.name, 0) }

// createTemp creates a new hidden file with a random name, refusing to
// follow a symlink or reuse an existing file.
func (d *Dir) createTemp(purpose string) (*tempFile, error) {
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, err
	}
	name := ".npuprobe-" + purpose + "-" + hex.EncodeToString(rnd[:]) + ".tmp"
	fd, err := unix.Openat(d.fd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, FileMode)
	if err != nil {
		return nil, err
	}
	// The umask may have narrowed the mode; it can never widen it, but make
	// the mode exact regardless.
	if err := unix.Fchmod(fd, FileMode); err != nil {
		unix.Close(fd)
		unix.Unlinkat(d.fd, name, 0)
		return nil, err
	}
	return &tempFile{d: d, name: name, f: os.NewFile(uintptr(fd), filepath.Join(d.path, name))}, nil
}

// ErrExists is returned when the final name is already taken.
var ErrExists = errors.New("file exists")

// WriteFile writes a new file called name through write, atomically: the
// data goes to a temporary file that is synced and then renamed to name, so
// name appears complete or not at all. An existing name is never replaced.
// On any error, including a full disk, the temporary file is removed.
func (d *Dir) WriteFile(name string, write func(io.Writer) error) (string, error) {
	return d.writeFile(name, write, unix.RENAME_NOREPLACE)
}

// ReplaceFile is WriteFile for a name the user chose: an existing file (or
// symlink, which is replaced, never followed) of that name is replaced
// atomically.
func (d *Dir) ReplaceFile(name string, write func(io.Writer) error) (string, error) {
	return d.writeFile(name, write, 0)
}

func (d *Dir) writeFile(name string, write func(io.Writer) error, renameFlags uint) (string, error) {
	if name == "" || strings.ContainsRune(name, '/') || name == "." || name == ".." {
		return "", fmt.Errorf("invalid file name %q", name)
	}
	t, err := d.createTemp("write")
	if err != nil {
		return "", fmt.Errorf("create temporary file in %s: %w", d.path, err)
	}
	ok := false
	defer func() {
		if !ok {
			t.f.Close()
			t.remove()
		}
	}()
	bw := bufio.NewWriterSize(t.f, 1<<20)
	if err := write(bw); err != nil {
		return "", err
	}
	if err := bw.Flush(); err != nil {
		return "", fmt.Errorf("write %s: %w", filepath.Join(d.path, name), err)
	}
	if err := t.f.Sync(); err != nil {
		return "", fmt.Errorf("sync %s: %w", filepath.Join(d.path, name), err)
	}
	if err := t.f.Close(); err != nil {
		return "", fmt.Errorf("close %s: %w", filepath.Join(d.path, name), err)
	}
	if err := unix.Renameat2(d.fd, t.name, d.fd, name, renameFlags); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return "", fmt.Errorf("%s: %w", filepath.Join(d.path, name), ErrExists)
		}
		return "", fmt.Errorf("rename to %s: %w", filepath.Join(d.path, name), err)
	}
	ok = true
	// Make the rename itself durable.
	unix.Fsync(d.fd)
	return filepath.Join(d.path, name), nil
}
