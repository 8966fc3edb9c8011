package agent

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path"
	"path/filepath"
)

// Hidden functions (torch_npu builds with -fvisibility=hidden) are absent
// from .dynsym. They can be found in the library's own .symtab when it is
// not stripped, or in a separate debug file, looked up the way gdb and perf
// do: by build-id under <debug dir>/.build-id/xx/yyyy.debug, or by the name
// in .gnu_debuglink next to the library, in its .debug/ subdirectory, or
// under <debug dir>/<library's directory>/. A debug file's symbol values are
// the stripped library's addresses, so offsets are computed with the
// library's own program headers.

// defaultDebugDir is where distributions install debug files.
const defaultDebugDir = "/usr/lib/debug"

// symbolSource says where hidden symbols were found.
type symbolSource struct {
	Kind string // ".dynsym", ".symtab", "build-id", "debuglink"
	Path string // the debug file, for build-id and debuglink
}

func (s symbolSource) String() string {
	if s.Path == "" {
		return s.Kind
	}
	return s.Kind + " debug file " + s.Path
}

// funcSymbol is a function's address and size.
type funcSymbol struct {
	value, size uint64
}

// lookupSymbols returns the wanted functions in f's .dynsym and .symtab, of
// any binding (hidden symbols are local in .symtab).
func lookupSymbols(f *elf.File, want map[string]bool) (found map[string]funcSymbol, hasSymtab bool) {
	found = make(map[string]funcSymbol)
	add := func(syms []elf.Symbol) {
		for _, s := range syms {
			if !want[s.Name] || s.Section == elf.SHN_UNDEF || s.Value == 0 {
				continue
			}
			if elf.ST_TYPE(s.Info) != elf.STT_FUNC { // see isDefinedFunction on IFUNCs
				continue
			}
			if _, dup := found[s.Name]; !dup {
				found[s.Name] = funcSymbol{s.Value, s.Size}
			}
		}
	}
	if syms, err := f.DynamicSymbols(); err == nil {
		add(syms)
	}
	if syms, err := f.Symbols(); err == nil {
		hasSymtab = true
		add(syms)
	}
	return found, hasSymtab
}

// buildID returns the GNU build-id note's bytes, or nil.
func buildID(f *elf.File) []byte {
	for _, p := range f.Progs {
		if p.Type != elf.PT_NOTE {
			continue
		}
		data, err := io.ReadAll(io.LimitReader(p.Open(), 1<<16))
		if err != nil {
			continue
		}
		if id := parseBuildIDNote(data, f.ByteOrder); id != nil {
			return id
		}
	}
	if s := f.Section(".note.gnu.build-id"); s != nil {
		if data, err := s.Data(); err == nil {
			return parseBuildIDNote(data, f.ByteOrder)
		}
	}
	return nil
}

// parseBuildIDNote walks ELF notes for NT_GNU_BUILD_ID owned by "GNU".
func parseBuildIDNote(data []byte, bo binary.ByteOrder) []byte {
	const ntGNUBuildID = 3
	align4 := func(n uint32) uint32 { return (n + 3) &^ 3 }
	for len(data) >= 12 {
		namesz, descsz, typ := bo.Uint32(data), bo.Uint32(data[4:]), bo.Uint32(data[8:])
		data = data[12:]
		if uint64(align4(namesz))+uint64(align4(descsz)) > uint64(len(data)) {
			return nil
		}
		name := data[:namesz]
		desc := data[align4(namesz) : align4(namesz)+descsz]
		data = data[align4(namesz)+align4(descsz):]
		if typ == ntGNUBuildID && bytes.Equal(bytes.TrimRight(name, "\x00"), []byte("GNU")) && len(desc) > 0 {
			return append([]byte(nil), desc...)
		}
	}
	return nil
}

// debugLink returns the file name and CRC32 of .gnu_debuglink.
func debugLink(f *elf.File) (string, uint32, bool) {
	s := f.Section(".gnu_debuglink")
	if s == nil {
		return "", 0, false
	}
	data, err := s.Data()
	if err != nil {
		return "", 0, false
	}
	nul := bytes.IndexByte(data, 0)
	if nul <= 0 {
		return "", 0, false
	}
	off := (nul + 4) &^ 3
	if off+4 > len(data) {
		return "", 0, false
	}
	return string(data[:nul]), f.ByteOrder.Uint32(data[off:]), true
}

// debugSearch finds the debug file of a library. Directories in debugDirs
// are in the agent's filesystem (--debug-dir, /usr/lib/debug); the
// library's own directory is searched inside the target's root.
type debugSearch struct {
	pid       int
	libPath   string // as the target sees it
	debugDirs []string
	tried     []string // every path looked at, for the error message
}

// find returns the opened debug file and how it was found.
func (s *debugSearch) find(lib *elf.File) (*os.File, symbolSource, error) {
	if id := buildID(lib); id != nil {
		hexID := hex.EncodeToString(id)
		rel := filepath.Join(".build-id", hexID[:2], hexID[2:]+".debug")
		for _, dir := range s.debugDirs {
			p := filepath.Join(dir, rel)
			s.tried = append(s.tried, p)
			if f, err := os.Open(p); err == nil {
				if matchesBuildID(f, id) {
					return f, symbolSource{Kind: "build-id", Path: p}, nil
				}
				f.Close()
			}
		}
		p := path.Join(defaultDebugDir, rel)
		s.tried = append(s.tried, "target:"+p)
		if f, err := openInRoot(s.pid, p); err == nil {
			if matchesBuildID(f, id) {
				return f, symbolSource{Kind: "build-id", Path: p + " (in the target's root)"}, nil
			}
			f.Close()
		}
	}
	if name, crc, ok := debugLink(lib); ok && name == path.Base(name) {
		libDir := path.Dir(s.libPath)
		for _, p := range []string{path.Join(libDir, name), path.Join(libDir, ".debug", name), path.Join(defaultDebugDir, libDir, name)} {
			if p == s.libPath {
				continue
			}
			s.tried = append(s.tried, "target:"+p)
			if f, err := openInRoot(s.pid, p); err == nil {
				if matchesCRC(f, crc) {
					return f, symbolSource{Kind: "debuglink", Path: p + " (in the target's root)"}, nil
				}
				f.Close()
			}
		}
		for _, dir := range s.debugDirs {
			for _, p := range []string{filepath.Join(dir, name), filepath.Join(dir, libDir, name)} {
				s.tried = append(s.tried, p)
				if f, err := os.Open(p); err == nil {
					if matchesCRC(f, crc) {
						return f, symbolSource{Kind: "debuglink", Path: p}, nil
					}
					f.Close()
				}
			}
		}
	}
	return nil, symbolSource{}, errors.New("no debug file found")
}

func matchesBuildID(f *os.File, want []byte) bool {
	ef, err := safeELF(f)
	if err != nil {
		return false
	}
	return bytes.Equal(buildID(ef), want)
}

func matchesCRC(f *os.File, want uint32) bool {
	h := crc32.NewIEEE()
	if _, err := io.Copy(h, f); err != nil {
		return false
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return false
	}
	return h.Sum32() == want
}

// safeELF parses an ELF header, turning debug/elf's panics on hostile input
// into errors.
func safeELF(r io.ReaderAt) (f *elf.File, err error) {
	defer func() {
		if p := recover(); p != nil {
			f, err = nil, fmt.Errorf("malformed ELF file: %v", p)
		}
	}()
	return elf.NewFile(r)
}

// hiddenFunc is a resolved function: its entry's file offset, its size,
// and the offsets of its return instructions.
type hiddenFunc struct {
	offset  uint64
	size    uint64
	returns returnSites
}

// resolveHidden finds the wanted functions in lib (opened, as mapped by
// pid at libPath): its .dynsym, its .symtab, then its debug file. It
// returns file offsets for uprobes, where they were found, and, when some
// are missing, a description of every place looked at.
func resolveHidden(pid int, lib *os.File, libPath string, want []string, debugDirs []string) (map[string]hiddenFunc, symbolSource, []string, error) {
	wanted := make(map[string]bool, len(want))
	for _, n := range want {
		wanted[n] = true
	}
	ef, err := safeELF(lib)
	if err != nil {
		return nil, symbolSource{}, nil, err
	}
	progs := progHeaders(ef)
	found, hasSymtab := lookupSymbols(ef, wanted)
	src := symbolSource{Kind: ".dynsym"}
	if hasSymtab {
		src.Kind = ".symtab"
	}
	var tried []string
	if len(found) < len(want) {
		search := &debugSearch{pid: pid, libPath: libPath, debugDirs: append(append([]string(nil), debugDirs...), defaultDebugDir)}
		dbg, dsrc, derr := search.find(ef)
		tried = search.tried
		if derr == nil {
			defer dbg.Close()
			if def, err := safeELF(dbg); err == nil {
				more, _ := lookupSymbols(def, wanted)
				if len(more) > len(found) {
					found, src = more, dsrc
				}
			}
		}
	}
	funcs := make(map[string]hiddenFunc, len(found))
	for name, sym := range found {
		off, err := fileOffset(progs, sym.value)
		if err != nil {
			continue
		}
		code := make([]byte, sym.size)
		if _, err := lib.ReadAt(code, int64(off)); err != nil {
			continue
		}
		funcs[name] = hiddenFunc{offset: off, size: sym.size, returns: findReturnSites(ef.Machine, code)}
	}
	return funcs, src, tried, nil
}
