package agent

import (
	"fmt"
	"os"
	"path"
	"sort"
	"strings"
)

// mappedELF is one distinct file mapped executable into the target.
type mappedELF struct {
	mapping Mapping // its first executable mapping
	rank    int     // lower is preferred when several files define a symbol
	file    *os.File
	syms    *elfSymbols
	loadErr error
}

// symbolSite is where a function is attached: the file that defines it and
// the file offset of its entry.
type symbolSite struct {
	elf    *mappedELF
	offset uint64
	// others lists further mapped files defining the same name. npuprobe
	// attaches once, where the process binds, so nothing is counted twice.
	others []string
}

// libraryRank orders the files that may define the runtime API, following
// how torch_npu binds: it dlopen()s "libascendcl.so" and dlsym()s from it
// (the library first, then its dependencies), and its PLT calls bind in
// load order, where libascendcl.so (a DT_NEEDED of torch_npu) also precedes
// its own dependency libacl_rt.so. CANN 8.5 and later define the API in
// libacl_rt.so and ship libascendcl.so as a compatibility library.
func libraryRank(p string) int {
	base := path.Base(p)
	switch {
	case strings.HasPrefix(base, "libascendcl.so"):
		return 0
	case strings.HasPrefix(base, "libacl_rt.so"):
		return 1
	}
	return 2
}

// targetELFs lists the distinct executable file mappings of pid, preferred
// runtime libraries first, and keeps no file open. Files named in preload
// (LD_PRELOAD) rank before everything: the dynamic linker puts them first
// in the global scope.
func targetELFs(pid int, preload ...string) ([]*mappedELF, error) {
	maps, err := readMaps(pid)
	if err != nil {
		return nil, err
	}
	type fileKey struct {
		major, minor uint32
		inode        uint64
	}
	seen := make(map[fileKey]bool)
	var out []*mappedELF
	for _, m := range maps {
		if !strings.Contains(m.Perms, "x") {
			continue
		}
		k := fileKey{m.DevMajor, m.DevMinor, m.Inode}
		if seen[k] {
			continue
		}
		seen[k] = true
		e := &mappedELF{mapping: m, rank: libraryRank(m.Path)}
		for _, p := range preload {
			if path.Base(p) == path.Base(m.Path) {
				e.rank = -1
			}
		}
		out = append(out, e)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].rank < out[j].rank })
	return out, nil
}

// load opens the file and reads its symbols, once.
func (e *mappedELF) load(pid int) error {
	if e.syms != nil || e.loadErr != nil {
		return e.loadErr
	}
	f, err := openMappedFile(pid, e.mapping)
	if err != nil {
		e.loadErr = err
		return err
	}
	syms, err := readDynamicSymbols(f)
	if err != nil {
		f.Close()
		e.loadErr = fmt.Errorf("%s: %w", e.mapping.Path, err)
		return e.loadErr
	}
	e.file, e.syms = f, syms
	return nil
}

func (e *mappedELF) close() {
	if e.file != nil {
		e.file.Close()
		e.file = nil
	}
}

// resolveSymbols finds, for each name, the mapped file that defines it.
// Likely runtime libraries are read first; every other mapped file is read
// only if the required name is still unresolved, since a Python process maps
// hundreds of libraries. Names defined nowhere are absent from the result.
// The caller must close the returned files (closeELFs).
func resolveSymbols(pid int, names []string, required string, preload []string) (map[string]*symbolSite, []*mappedELF, error) {
	elfs, err := targetELFs(pid, preload...)
	if err != nil {
		return nil, nil, err
	}
	sites := make(map[string]*symbolSite)
	scan := func(e *mappedELF) {
		if e.load(pid) != nil {
			return
		}
		for _, n := range names {
			v, ok := e.syms.defined[n]
			if !ok {
				continue
			}
			if s := sites[n]; s != nil {
				s.others = append(s.others, e.mapping.Path)
				continue
			}
			off, err := fileOffset(e.syms.progs, v)
			if err != nil {
				continue
			}
			sites[n] = &symbolSite{elf: e, offset: off}
		}
	}
	for _, e := range elfs {
		if e.rank < 2 {
			scan(e)
		}
	}
	// A preloaded library is scanned for the sake of ordering only: keep it
	// as the site only if it defines the name, which scan already ensured.
	if sites[required] == nil {
		for _, e := range elfs {
			if e.rank == 2 {
				scan(e)
			}
		}
	}
	// Keep open only the files something will be attached to.
	var used []*mappedELF
	for _, e := range elfs {
		inUse := false
		for _, s := range sites {
			if s.elf == e {
				inUse = true
				break
			}
		}
		if inUse {
			used = append(used, e)
		} else {
			e.close()
		}
	}
	return sites, used, nil
}

func closeELFs(elfs []*mappedELF) {
	for _, e := range elfs {
		e.close()
	}
}
