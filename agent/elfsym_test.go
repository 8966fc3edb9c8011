package agent

import (
	"bytes"
	"debug/elf"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
)

func readSymbolsOf(t *testing.T, path string) *elfSymbols {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	es, err := readDynamicSymbols(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return es
}

// nmDefined returns what `nm -D --defined-only` lists as code: name ->
// value. It is the reference for which functions a library exports.
func nmDefined(t *testing.T, path string) map[string]uint64 {
	t.Helper()
	out, err := exec.Command("nm", "-D", "--defined-only", path).Output()
	if err != nil {
		t.Fatalf("nm -D %s: %v", path, err)
	}
	defs := make(map[string]uint64)
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || !strings.ContainsAny(f[1], "TWi") { // text, weak, indirect
			continue
		}
		v, err := strconv.ParseUint(f[0], 16, 64)
		if err != nil {
			t.Fatalf("nm line %q: %v", line, err)
		}
		defs[strings.SplitN(f[2], "@", 2)[0]] = v
	}
	return defs
}

// execLoads returns the executable PT_LOAD segments as `readelf -lW` prints
// them: offset, vaddr, memsz.
func execLoads(t *testing.T, path string) [][3]uint64 {
	t.Helper()
	out, err := exec.Command("readelf", "-lW", path).Output()
	if err != nil {
		t.Fatalf("readelf -lW %s: %v", path, err)
	}
	re := regexp.MustCompile(`(?m)^\s*LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+\s+0x[0-9a-f]+\s+(0x[0-9a-f]+)\s+([RWE ]+?)\s+0x`)
	var loads [][3]uint64
	for _, m := range re.FindAllStringSubmatch(string(out), -1) {
		if !strings.Contains(m[4], "E") {
			continue
		}
		var l [3]uint64
		for i := range 3 {
			l[i], _ = strconv.ParseUint(m[i+1], 0, 64)
		}
		loads = append(loads, l)
	}
	if len(loads) == 0 {
		t.Fatalf("readelf found no executable LOAD segment in %s:\n%s", path, out)
	}
	return loads
}

// checkOffsets compares fileOffset for every defined function with three
// independent derivations: readelf's program headers, the section headers
// (vaddr - sh_addr + sh_offset of the section holding it), and cilium/ebpf's
// own symbol table of the file, which must name the function at exactly
// that offset.
func checkOffsets(t *testing.T, path string, es *elfSymbols) {
	t.Helper()
	loads := execLoads(t, path)
	ef, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ef.Close()
	ex, err := link.OpenExecutable(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range sortedNames(es.defined) {
		v := es.defined[name]
		off, err := fileOffset(es.progs, v)
		if err != nil {
			t.Errorf("%s: fileOffset(%#x): %v", name, v, err)
			continue
		}
		var fromReadelf []uint64
		for _, l := range loads {
			if v >= l[1] && v < l[1]+l[2] {
				fromReadelf = append(fromReadelf, v-l[1]+l[0])
			}
		}
		if len(fromReadelf) != 1 || fromReadelf[0] != off {
			t.Errorf("%s at %#x: file offset %#x, readelf's segments give %#x", name, v, off, fromReadelf)
		}
		var sec *elf.Section
		for _, s := range ef.Sections {
			if s.Flags&elf.SHF_EXECINSTR != 0 && v >= s.Addr && v < s.Addr+s.Size {
				sec = s
			}
		}
		if sec == nil {
			t.Errorf("%s at %#x is in no executable section", name, v)
		} else if want := v - sec.Addr + sec.Offset; want != off {
			t.Errorf("%s: file offset %#x, section %s gives %#x", name, off, sec.Name, want)
		}
		so, err := ex.Symbol(off)
		if err != nil || so.Symbol != name || so.Offset != 0 {
			t.Errorf("%s: cilium/ebpf finds %+v (err %v) at file offset %#x", name, so, err, off)
		}
	}
}

// localFunctions lists what .symtab (kept by -g) has as functions the
// dynamic linker cannot bind to: static ones and hidden ones.
func localFunctions(t *testing.T, path string) []string {
	t.Helper()
	ef, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ef.Close()
	syms, err := ef.Symbols()
	if err != nil {
		t.Fatalf("%s has no .symtab: %v", path, err)
	}
	var out []string
	for _, s := range syms {
		if elf.ST_TYPE(s.Info) == elf.STT_FUNC && s.Section != elf.SHN_UNDEF &&
			(elf.ST_BIND(s.Info) == elf.STB_LOCAL || elf.ST_VISIBILITY(s.Other) == elf.STV_HIDDEN) {
			out = append(out, s.Name)
		}
	}
	return out
}

// readDynamicSymbols on the fixtures' libraries: exactly the exported
// aclrt* functions, at nm's addresses, at the file offsets readelf,
// the section headers and cilium/ebpf agree on.
func TestReadDynamicSymbolsFixtures(t *testing.T) {
	t.Parallel()
	paths := buildFixtures(t)
	for _, lib := range []string{
		paths.Runtime,
		filepath.Join(paths.CompatLibDir, "libacl_rt.so"),
		filepath.Join(paths.CompatLibDir, "libascendcl.so"),
	} {
		t.Run(filepath.Base(filepath.Dir(lib))+"/"+filepath.Base(lib), func(t *testing.T) {
			es := readSymbolsOf(t, lib)
			if got := sortedNames(es.defined); !slices.Equal(got, apiFunctions) {
				t.Errorf("defined %v, want exactly %v", got, apiFunctions)
			}
			nm := nmDefined(t, lib)
			for name, v := range es.defined {
				if nm[name] != v {
					t.Errorf("%s at %#x, nm says %#x", name, v, nm[name])
				}
			}
			locals := localFunctions(t, lib)
			if len(locals) == 0 {
				t.Fatal("no static or hidden function in .symtab: the test would prove nothing")
			}
			for _, name := range locals {
				if _, ok := es.defined[name]; ok {
					t.Errorf("static/hidden function %s counted as defined", name)
				}
			}
			checkOffsets(t, lib, es)
		})
	}
}

// A library with every kind of symbol the filter must tell apart, linked at
// a non-zero base so that virtual addresses differ from file offsets.
const symbolZoo = `
#include <stdio.h>
__attribute__((visibility("default"))) int exported_fn(int x) { return x + 1; }
__attribute__((visibility("default"), weak)) int weak_fn(int x) { return x + 2; }
__attribute__((visibility("protected"))) int protected_fn(int x) { return x + 3; }
__attribute__((visibility("hidden"), noinline)) int hidden_fn(int x) { return x * 5; }
static __attribute__((noinline)) int static_fn(int x) { return x * 7; }
__attribute__((visibility("default"))) int exported_data = 5;
__attribute__((visibility("default"))) int calls_out(int x) {
	/* puts is an import: an undefined .dynsym entry. */
	return static_fn(x) + hidden_fn(x) + puts("x");
}
`

func TestDefinedFunctionFilter(t *testing.T) {
	t.Parallel()
	lib := filepath.Join(t.TempDir(), "libzoo.so")
	compileC(t, lib, symbolZoo, "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Ttext-segment=0x400000")
	es := readSymbolsOf(t, lib)
	want := []string{"calls_out", "exported_fn", "protected_fn", "weak_fn"}
	if got := sortedNames(es.defined); !slices.Equal(got, want) {
		t.Errorf("defined %v, want %v", got, want)
	}
	// The premise: the executable segment's addresses are not its offsets,
	// so a vaddr passed off as an offset would be caught below.
	for _, l := range execLoads(t, lib) {
		if l[0] == l[1] {
			t.Fatalf("executable segment at offset %#x = vaddr: the test cannot tell them apart", l[0])
		}
	}
	checkOffsets(t, lib, es)

	// What no compiler output here has: .dynsym entries that are hidden,
	// local, objects, imports or valueless.
	def := elf.Symbol{Name: "f", Info: elf.ST_INFO(elf.STB_GLOBAL, elf.STT_FUNC), Section: 12, Value: 0x1000}
	cases := []struct {
		name string
		mod  func(*elf.Symbol)
		want bool
	}{
		{"global default function", func(*elf.Symbol) {}, true},
		{"weak", func(s *elf.Symbol) { s.Info = elf.ST_INFO(elf.STB_WEAK, elf.STT_FUNC) }, true},
		{"protected", func(s *elf.Symbol) { s.Other = byte(elf.STV_PROTECTED) }, true},
		{"hidden", func(s *elf.Symbol) { s.Other = byte(elf.STV_HIDDEN) }, false},
		{"internal", func(s *elf.Symbol) { s.Other = byte(elf.STV_INTERNAL) }, false},
		{"local", func(s *elf.Symbol) { s.Info = elf.ST_INFO(elf.STB_LOCAL, elf.STT_FUNC) }, false},
		{"object", func(s *elf.Symbol) { s.Info = elf.ST_INFO(elf.STB_GLOBAL, elf.STT_OBJECT) }, false},
		{"no type", func(s *elf.Symbol) { s.Info = elf.ST_INFO(elf.STB_GLOBAL, elf.STT_NOTYPE) }, false},
		{"import", func(s *elf.Symbol) { s.Section, s.Value = elf.SHN_UNDEF, 0 }, false},
		{"import with a PLT address", func(s *elf.Symbol) { s.Section = elf.SHN_UNDEF }, false},
		{"absolute zero", func(s *elf.Symbol) { s.Section, s.Value = elf.SHN_ABS, 0 }, false},
	}
	for _, c := range cases {
		s := def
		c.mod(&s)
		if got := isDefinedFunction(s); got != c.want {
			t.Errorf("%s: isDefinedFunction = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestFileOffset(t *testing.T) {
	progs := []elf.ProgHeader{
		{Type: elf.PT_LOAD, Flags: elf.PF_R, Off: 0, Vaddr: 0x400000, Memsz: 0x800},
		{Type: elf.PT_LOAD, Flags: elf.PF_R | elf.PF_X, Off: 0x1000, Vaddr: 0x401000, Memsz: 0x2000},
		{Type: elf.PT_DYNAMIC, Flags: elf.PF_R | elf.PF_X, Off: 0x9000, Vaddr: 0x409000, Memsz: 0x100},
		{Type: elf.PT_LOAD, Flags: elf.PF_R | elf.PF_X, Off: 0x5000, Vaddr: 0x600000, Memsz: 0x1000},
		{Type: elf.PT_LOAD, Flags: elf.PF_R | elf.PF_W, Off: 0x6000, Vaddr: 0x607000, Memsz: 0x1000},
	}
	for _, c := range []struct {
		vaddr, off uint64
		ok         bool
	}{
		{0x401000, 0x1000, true},
		{0x402fff, 0x2fff, true},
		{0x403000, 0, false}, // one past the segment
		{0x600010, 0x5010, true},
		{0x400100, 0, false}, // read-only segment
		{0x409010, 0, false}, // executable, but not PT_LOAD
		{0x607010, 0, false}, // data
		{0, 0, false},
	} {
		off, err := fileOffset(progs, c.vaddr)
		if (err == nil) != c.ok || (c.ok && off != c.off) {
			t.Errorf("fileOffset(%#x) = %#x, %v; want %#x, ok %v", c.vaddr, off, err, c.off, c.ok)
		}
	}
}

// tryRead runs readDynamicSymbols and turns an escaped panic into a test
// failure naming the input.
func tryRead(t *testing.T, what string, data []byte) (es *elfSymbols, err error) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("%s: readDynamicSymbols panicked: %v", what, p)
		}
	}()
	return readDynamicSymbols(bytes.NewReader(data))
}

// A malformed or hostile file in a traced container must give an error, not
// crash the agent (or hang it, or make it allocate without bound).
func TestReadDynamicSymbolsMalformed(t *testing.T) {
	t.Parallel()
	paths := buildFixtures(t)
	good, err := os.ReadFile(paths.Runtime)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tryRead(t, "the library itself", good); err != nil {
		t.Fatal(err)
	}
	ef, err := elf.NewFile(bytes.NewReader(good))
	if err != nil {
		t.Fatal(err)
	}
	// Section headers come last in the file, so every strict prefix lacks
	// some of them and is unreadable.
	shoff := uint64(len(good)) - uint64(len(ef.Sections))*64
	if le := ef.ByteOrder; ef.Class != elf.ELFCLASS64 || le.Uint64(good[0x28:]) != shoff {
		t.Fatalf("precondition: section header table is not at the end of %s", paths.Runtime)
	}
	lengths := []int{0, 1, 4, 15, 16, 52, 63, 64, 65, int(shoff) - 1, int(shoff), int(shoff) + 1, len(good) - 1}
	for n := 0; n < len(good); n += 97 {
		lengths = append(lengths, n)
	}
	for _, n := range lengths {
		if _, err := tryRead(t, fmt.Sprintf("prefix of %d bytes", n), good[:n]); err == nil {
			t.Errorf("prefix of %d of %d bytes accepted", n, len(good))
		}
	}

	rng := rand.New(rand.NewPCG(1, 2))
	garbage := make([]byte, 4096)
	for i := range garbage {
		garbage[i] = byte(rng.Uint32())
	}
	if _, err := tryRead(t, "garbage", garbage); err == nil {
		t.Error("random bytes accepted")
	}
	withMagic := append([]byte("\x7fELF\x02\x01\x01"), garbage[7:]...)
	if _, err := tryRead(t, "garbage after an ELF magic", withMagic); err == nil {
		t.Error("garbage after an ELF magic accepted")
	}

	// Hostile headers: absurd counts, sizes and links. Each must fail or
	// succeed quickly, without a panic.
	put64 := func(b []byte, at int, v uint64) []byte {
		c := slices.Clone(b)
		ef.ByteOrder.PutUint64(c[at:], v)
		return c
	}
	put16 := func(b []byte, at int, v uint16) []byte {
		c := slices.Clone(b)
		ef.ByteOrder.PutUint16(c[at:], v)
		return c
	}
	put32 := func(b []byte, at int, v uint32) []byte {
		c := slices.Clone(b)
		ef.ByteOrder.PutUint32(c[at:], v)
		return c
	}
	dynsym := ef.Section(".dynsym")
	dynsymHdr := int(shoff) + 64*slices.Index(ef.Sections, dynsym)
	hostile := map[string][]byte{
		"e_phoff past the end":    put64(good, 0x20, 1<<62),
		"e_shoff past the end":    put64(good, 0x28, 1<<62),
		"e_phnum 65535":           put16(good, 0x38, 0xffff),
		"e_shnum 65535":           put16(good, 0x3c, 0xffff),
		"e_shstrndx out of range": put16(good, 0x3e, 0xfffe),
		".dynsym size 2^60":       put64(good, dynsymHdr+0x20, 1<<60),
		".dynsym offset 2^60":     put64(good, dynsymHdr+0x18, 1<<60),
		".dynsym link to nowhere": put32(good, dynsymHdr+0x28, 0xfffe),
		".dynsym entsize 0":       put64(good, dynsymHdr+0x38, 0),
	}
	for what, data := range hostile {
		start := time.Now()
		es, err := tryRead(t, what, data)
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("%s: took %v", what, d)
		}
		t.Logf("%s: %d functions, err %v", what, len(symbolsOrNil(es)), err)
	}

	// Random corruption anywhere in the file.
	for i := range 2000 {
		data := slices.Clone(good)
		for range 1 + rng.IntN(8) {
			data[rng.IntN(len(data))] = byte(rng.Uint32())
		}
		tryRead(t, fmt.Sprintf("corruption %d", i), data)
	}
}

func symbolsOrNil(es *elfSymbols) map[string]uint64 {
	if es == nil {
		return nil
	}
	return es.defined
}
