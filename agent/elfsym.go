package agent

import (
	"debug/elf"
	"errors"
	"fmt"
	"io"
)

// elfSymbols is what npuprobe needs from one ELF file: the functions it
// defines and how to turn their addresses into file offsets.
type elfSymbols struct {
	// defined maps a function name to its virtual address (st_value) for
	// every function the file defines and exports.
	defined map[string]uint64
	progs   []elf.ProgHeader
}

// readDynamicSymbols reads the functions an ELF file defines in .dynsym:
// what the dynamic linker (and so dlsym and PLT calls) can bind to.
//
// A symbol counts as defined when it is a function, global or weak,
// default or protected visibility, and has a section: an undefined entry is
// an import, not a definition. GNU indirect functions are left out: their
// value is the resolver, which runs once at load time, not the function
// calls reach.
func readDynamicSymbols(r io.ReaderAt) (es *elfSymbols, err error) {
	// debug/elf trusts the file's offsets; a corrupt or hostile library in
	// a traced container must not crash the agent.
	defer func() {
		if p := recover(); p != nil {
			es, err = nil, fmt.Errorf("malformed ELF file: %v", p)
		}
	}()
	f, err := elf.NewFile(r)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil && !errors.Is(err, elf.ErrNoSymbols) {
		return nil, err
	}
	es = &elfSymbols{defined: make(map[string]uint64), progs: progHeaders(f)}
	for _, s := range syms {
		if isDefinedFunction(s) {
			es.defined[s.Name] = s.Value
		}
	}
	return es, nil
}

func progHeaders(f *elf.File) []elf.ProgHeader {
	out := make([]elf.ProgHeader, 0, len(f.Progs))
	for _, p := range f.Progs {
		out = append(out, p.ProgHeader)
	}
	return out
}

func isDefinedFunction(s elf.Symbol) bool {
	if elf.ST_TYPE(s.Info) != elf.STT_FUNC {
		return false
	}
	bind := elf.ST_BIND(s.Info)
	if bind != elf.STB_GLOBAL && bind != elf.STB_WEAK {
		return false
	}
	vis := elf.ST_VISIBILITY(s.Other)
	if vis != elf.STV_DEFAULT && vis != elf.STV_PROTECTED {
		return false
	}
	return s.Section != elf.SHN_UNDEF && s.Value != 0
}

// fileOffset converts a virtual address of the ELF file into the file
// offset the kernel's uprobe API takes: the address's place in the
// executable PT_LOAD segment that contains it.
func fileOffset(progs []elf.ProgHeader, vaddr uint64) (uint64, error) {
	for _, p := range progs {
		if p.Type != elf.PT_LOAD || p.Flags&elf.PF_X == 0 {
			continue
		}
		if vaddr >= p.Vaddr && vaddr < p.Vaddr+p.Memsz {
			return vaddr - p.Vaddr + p.Off, nil
		}
	}
	return 0, fmt.Errorf("address %#x is in no executable segment", vaddr)
}
