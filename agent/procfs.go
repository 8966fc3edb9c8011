package agent

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// procRoot is where procfs is mounted; tests point it elsewhere.
var procRoot = "/proc"

// Mapping is one file-backed line of /proc/PID/maps.
type Mapping struct {
	Start, End uint64
	Perms      string
	Offset     uint64
	DevMajor   uint32
	DevMinor   uint32
	Inode      uint64
	Path       string // as the target sees it, inside its own mount namespace
	Deleted    bool   // the file was unlinked or replaced after mapping
}

// ParseMaps parses the text of /proc/PID/maps, keeping file-backed
// mappings. Pseudo-paths such as [heap] and anonymous mappings are skipped.
func ParseMaps(r io.Reader) ([]Mapping, error) {
	var out []Mapping
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	line := 0
	for sc.Scan() {
		line++
		m, ok, err := parseMapsLine(sc.Bytes())
		if err != nil {
			return nil, fmt.Errorf("maps line %d: %w", line, err)
		}
		if ok {
			out = append(out, m)
		}
	}
	return out, sc.Err()
}

func parseMapsLine(b []byte) (Mapping, bool, error) {
	var m Mapping
	// address perms offset dev inode [path]; the path is the rest of the
	// line and may contain spaces.
	fields := make([][]byte, 0, 5)
	rest := b
	for len(fields) < 5 {
		rest = bytes.TrimLeft(rest, " ")
		i := bytes.IndexByte(rest, ' ')
		if i < 0 {
			if len(rest) > 0 {
				fields = append(fields, rest)
				rest = nil
			}
			break
		}
		fields = append(fields, rest[:i])
		rest = rest[i+1:]
	}
	if len(fields) < 5 {
		return m, false, errors.New("too few fields")
	}
	start, end, ok := strings.Cut(string(fields[0]), "-")
	if !ok {
		return m, false, errors.New("bad address range")
	}
	var err error
	if m.Start, err = strconv.ParseUint(start, 16, 64); err != nil {
		return m, false, fmt.Errorf("bad start address: %w", err)
	}
	if m.End, err = strconv.ParseUint(end, 16, 64); err != nil {
		return m, false, fmt.Errorf("bad end address: %w", err)
	}
	m.Perms = string(fields[1])
	if m.Offset, err = strconv.ParseUint(string(fields[2]), 16, 64); err != nil {
		return m, false, fmt.Errorf("bad offset: %w", err)
	}
	maj, min, ok := strings.Cut(string(fields[3]), ":")
	if !ok {
		return m, false, errors.New("bad device")
	}
	major, err1 := strconv.ParseUint(maj, 16, 32)
	minor, err2 := strconv.ParseUint(min, 16, 32)
	if err1 != nil || err2 != nil {
		return m, false, errors.New("bad device")
	}
	m.DevMajor, m.DevMinor = uint32(major), uint32(minor)
	if m.Inode, err = strconv.ParseUint(string(fields[4]), 10, 64); err != nil {
		return m, false, fmt.Errorf("bad inode: %w", err)
	}
	path := string(bytes.TrimLeft(rest, " "))
	if m.Inode == 0 || path == "" || path[0] != '/' {
		return m, false, nil // anonymous or pseudo mapping
	}
	if p, found := strings.CutSuffix(path, " (deleted)"); found {
		path, m.Deleted = p, true
	}
	m.Path = path
	return m, true, nil
}

// readMaps returns the file-backed mappings of pid.
func readMaps(pid int) ([]Mapping, error) {
	f, err := os.Open(fmt.Sprintf("%s/%d/maps", procRoot, pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ParseMaps(f)
}

// ParseEnviron splits the NUL-separated text of /proc/PID/environ.
func ParseEnviron(b []byte) map[string]string {
	env := make(map[string]string)
	for _, kv := range bytes.Split(b, []byte{0}) {
		k, v, ok := bytes.Cut(kv, []byte{'='})
		if ok && len(k) > 0 {
			env[string(k)] = string(v)
		}
	}
	return env
}

// ReadEnviron returns the environment pid started with.
func ReadEnviron(pid int) (map[string]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("%s/%d/environ", procRoot, pid))
	if err != nil {
		return nil, err
	}
	return ParseEnviron(b), nil
}

// processStatus holds the fields of /proc/PID/status npuprobe needs.
type processStatus struct {
	Name string
	Tgid int
	// NSpid lists the PID in each PID namespace, outermost first.
	NSpid []int
}

func parseStatus(r io.Reader) (processStatus, error) {
	var st processStatus
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Name":
			st.Name = v
		case "Tgid":
			n, err := strconv.Atoi(v)
			if err != nil {
				return st, fmt.Errorf("bad Tgid %q", v)
			}
			st.Tgid = n
		case "NSpid":
			for _, f := range strings.Fields(v) {
				n, err := strconv.Atoi(f)
				if err != nil {
					return st, fmt.Errorf("bad NSpid %q", v)
				}
				st.NSpid = append(st.NSpid, n)
			}
		}
	}
	return st, sc.Err()
}

func readStatus(pid int) (processStatus, error) {
	f, err := os.Open(fmt.Sprintf("%s/%d/status", procRoot, pid))
	if err != nil {
		return processStatus{}, err
	}
	defer f.Close()
	return parseStatus(f)
}
