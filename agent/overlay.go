package agent

import (
	"bufio"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// A uprobe goes on the inode the kernel finds under a path, and for a file
// on overlayfs (any container image) that is the real file in the layer
// underneath (d_real_inode). Two containers started from one image see that
// one file through two overlay mounts, each reporting its own device, so
// neither fstat nor /proc/PID/maps tells that they are the same file; npuprobe
// would attach twice and every call would be recorded twice. realFileKey
// finds the layer file itself.

const overlayfsSuperMagic = 0x794c7630

// realFileKey returns the device and inode the kernel attaches uprobes to
// for file f, mapped by pid at path (as pid sees it). For a file on
// overlayfs it looks the file up in the mount's layers (upper first, then
// lower, as overlayfs does) in the host's filesystem; when that fails it
// falls back to what fstat says, which at worst attaches twice.
func realFileKey(pid int, path string, f *os.File) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, 0, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil || fs.Type != overlayfsSuperMagic {
		return st.Dev, st.Ino, nil
	}
	mnt, layers, ok := overlayLayersFor(pid, path)
	if !ok {
		return st.Dev, st.Ino, nil
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(path, mnt), "/")
	// Layer paths are in the mount namespace that made the overlay (the
	// host's): reachable through /proc/1/root when npuprobe runs in a
	// container with the host's PID namespace, directly when it runs on
	// the host.
	for _, root := range []string{"/proc/1/root", ""} {
		for _, layer := range layers {
			var ls unix.Stat_t
			if err := unix.Stat(root+layer+"/"+rel, &ls); err != nil {
				continue
			}
			// The topmost layer holding the path is the file overlayfs
			// shows; its inode number is the one overlayfs reports.
			if ls.Ino == st.Ino {
				return ls.Dev, ls.Ino, nil
			}
			break
		}
	}
	return st.Dev, st.Ino, nil
}

// overlayLayersFor finds the overlay mount holding path in pid's mount
// namespace and returns its mount point and its layer directories, upper
// first.
func overlayLayersFor(pid int, path string) (string, []string, bool) {
	f, err := os.Open(fmt.Sprintf("%s/%d/mountinfo", procRoot, pid))
	if err != nil {
		return "", nil, false
	}
	defer f.Close()
	var best string
	var bestLayers []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		mnt, fstype, opts, ok := parseMountinfoLine(sc.Text())
		if !ok || fstype != "overlay" {
			continue
		}
		if !(path == mnt || strings.HasPrefix(path, strings.TrimSuffix(mnt, "/")+"/")) || len(mnt) < len(best) {
			continue
		}
		var upper string
		var lower []string
		for _, o := range splitMountOptions(opts) {
			k, v, _ := strings.Cut(o, "=")
			switch k {
			case "upperdir":
				upper = v
			case "lowerdir":
				lower = splitLowerdir(v)
			}
		}
		layers := lower
		if upper != "" {
			layers = append([]string{upper}, lower...)
		}
		best, bestLayers = mnt, layers
	}
	return best, bestLayers, best != "" && len(bestLayers) > 0
}

// parseMountinfoLine returns the mount point, filesystem type and super
// options of a /proc/PID/mountinfo line.
func parseMountinfoLine(line string) (mnt, fstype, superOpts string, ok bool) {
	pre, post, found := strings.Cut(line, " - ")
	if !found {
		return "", "", "", false
	}
	f := strings.Fields(pre)
	g := strings.Fields(post)
	if len(f) < 5 || len(g) < 3 {
		return "", "", "", false
	}
	return unescapeMountinfo(f[4]), g[0], g[2], true
}

// unescapeMountinfo undoes the octal escapes (\040 for a space, ...) the
// kernel uses in mountinfo.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &c); err == nil {
				b.WriteByte(byte(c))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// splitMountOptions splits super options on commas not escaped with '\'.
func splitMountOptions(s string) []string {
	var out []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\' && i+1 < len(s):
			cur.WriteByte(s[i+1])
			i++
		case s[i] == ',':
			out = append(out, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(s[i])
		}
	}
	return append(out, unescapeMountinfo(cur.String()))
}

// splitLowerdir splits overlayfs's lowerdir list on ':' (the "::" data-only
// separator counts as one).
func splitLowerdir(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ":") {
		if p != "" {
			out = append(out, unescapeMountinfo(p))
		}
	}
	return out
}
