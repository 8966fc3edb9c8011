package agent

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// openMappedFile opens the file behind mapping m of process pid: the very
// file the process mapped, as it sees it, without letting the target's
// filesystem lead the agent anywhere else.
//
// First choice: m.Path resolved inside the target's root with openat2 and
// RESOLVE_IN_ROOT, so absolute symlinks and ".." in a container image stay
// inside the container (the agent is privileged; a hostile image must not
// make it open host files). The result must be the mapped inode: if the file
// was replaced since it was mapped (an upgrade under a running job), or the
// filesystem reports a different device (overlayfs), the second choice is
// /proc/PID/map_files/START-END, a link to exactly the mapped file.
func openMappedFile(pid int, m Mapping) (*os.File, error) {
	var firstErr error
	if !m.Deleted {
		f, err := openInRoot(pid, m.Path)
		if err == nil {
			if sameInode(f, m) {
				return f, nil
			}
			f.Close()
			firstErr = fmt.Errorf("%s in the target's root is not the mapped file", m.Path)
		} else {
			firstErr = err
		}
	}
	mapFile := fmt.Sprintf("%s/%d/map_files/%x-%x", procRoot, pid, m.Start, m.End)
	f, err := os.OpenFile(mapFile, os.O_RDONLY, 0)
	if err == nil {
		return f, nil
	}
	if firstErr != nil {
		return nil, fmt.Errorf("%w; and %s: %w", firstErr, mapFile, err)
	}
	return nil, err
}

func openInRoot(pid int, path string) (*os.File, error) {
	root := fmt.Sprintf("%s/%d/root", procRoot, pid)
	rootFd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: root, Err: err}
	}
	defer unix.Close(rootFd)
	fd, err := unix.Openat2(rootFd, path, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOCTTY,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		if errors.Is(err, unix.ENOSYS) {
			return nil, fmt.Errorf("openat2 needs Linux 5.6: %w", err)
		}
		return nil, &os.PathError{Op: "open in target root", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), root+path), nil
}

func sameInode(f *os.File, m Mapping) bool {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return false
	}
	return st.Ino == m.Inode && unix.Major(st.Dev) == m.DevMajor && unix.Minor(st.Dev) == m.DevMinor
}
