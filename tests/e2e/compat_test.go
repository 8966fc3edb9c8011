package e2e

import (
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
)

// probedFunctions are the runtime functions npuprobe traces at segment level.
var probedFunctions = []string{
	"aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached", "aclrtFree",
	"aclrtSetDevice", "aclrtGetDevice", "aclrtGetMemInfo",
	"aclrtReserveMemAddress", "aclrtReleaseMemAddress", "aclrtMallocPhysical",
	"aclrtFreePhysical", "aclrtMapMem", "aclrtUnmapMem",
}

// TestCompatLayoutTracedOnce runs the segment workload on the layout of
// CANN 8.5 and later: libascendcl.so is a compatibility library whose every
// aclrt* function calls the libacl_rt.so function of the same name, so both
// mapped files define every probed symbol and every call runs through both.
// npuprobe must attach once, in libascendcl.so where the process binds, say
// so, and record every call exactly once.
func TestCompatLayoutTracedOnce(t *testing.T) {
	const threads, calls = 3, 12000
	fwd := filepath.Join(fixtures.CompatLibDir, "libascendcl.so")
	rt := filepath.Join(fixtures.CompatLibDir, "libacl_rt.so")
	fwdOffsets := functionOffsets(t, fwd)
	rtOffsets := functionOffsets(t, rt)
	for _, fn := range probedFunctions {
		if _, ok := fwdOffsets[fn]; !ok {
			t.Fatalf("premise: the forwarder does not define %s", fn)
		}
		if _, ok := rtOffsets[fn]; !ok {
			t.Fatalf("premise: libacl_rt.so does not define %s", fn)
		}
	}
	for name, off := range rtOffsets {
		for fname, foff := range fwdOffsets {
			if off == foff {
				t.Fatalf("premise: %s in libacl_rt.so and %s in the forwarder share offset %#x; probes could not be told apart", name, fname, off)
			}
		}
	}

	w := startWorkload(t, fixtures.SegmentWorkload, fixtures.CompatEnv(),
		"--threads", fmt.Sprint(threads), "--calls", fmt.Sprint(calls), "--pre-attach", "24")
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", w.pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, lib := range []string{fwd, rt} {
		if !strings.Contains(string(maps), " "+lib+"\n") {
			t.Fatalf("premise: the workload does not map %s", lib)
		}
	}
	if strings.Contains(string(maps), fixtures.Runtime) {
		t.Fatalf("premise: the workload maps the plain-layout runtime %s", fixtures.Runtime)
	}

	out := t.TempDir()
	a := startAgent(t, "--pid", fmt.Sprint(w.pid), "--out", out, "--status-interval", "100ms")

	// What npuprobe says: one file attached, and for each function the other
	// definition, not traced.
	log := a.log()
	attached := regexp.MustCompile(`(?m)^npuprobe: attached to pid (\d+) \(.*\): (\d+) functions in (.+)$`).FindAllStringSubmatch(log, -1)
	if len(attached) != 1 || attached[0][1] != fmt.Sprint(w.pid) || attached[0][2] != fmt.Sprint(len(probedFunctions)) || attached[0][3] != fwd {
		t.Errorf("attach report %q, want one line: %d functions in %s", attached, len(probedFunctions), fwd)
	}
	for _, fn := range probedFunctions {
		want := fmt.Sprintf("npuprobe: %s is also defined in %s; traced once, where the process binds it (%s)\n", fn, rt, fwd)
		if !strings.Contains(log, want) {
			t.Errorf("stderr lacks %q", strings.TrimSpace(want))
		}
	}

	// What the kernel has: npuprobe's uprobes, all through one file, at the
	// forwarder's offsets, one entry probe per function, none in
	// libacl_rt.so.
	checkAttachedOnce(t, uprobeLinksOf(t, a.cmd.Process.Pid), fwdOffsets, rtOffsets)

	w.send("go")
	w.expectLine("done", 2*time.Minute)
	// Every call is one event: each call runs through both definitions, so
	// probes on both would make twice as many.
	waitEvents(t, a, calls)
	path := a.snapshot()

	gt := w.groundTruth()
	checkWorkloadShape(t, gt, threads, calls)
	checkSegmentSnapshot(t, gt, loadSnapshot(t, path))

	w.send("exit")
	final := a.expect(exitRE, time.Minute)[1]
	if code := a.wait(30 * time.Second); code != 0 {
		t.Fatalf("npuprobe exited %d after the target exited", code)
	}
	checkSegmentSnapshot(t, gt, loadSnapshot(t, final))
}

// functionOffsets returns the file offset of every function lib exports.
func functionOffsets(t *testing.T, lib string) map[string]uint64 {
	t.Helper()
	f, err := elf.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]uint64)
	for _, s := range syms {
		if elf.ST_TYPE(s.Info) != elf.STT_FUNC || s.Section == elf.SHN_UNDEF {
			continue
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_LOAD && p.Flags&elf.PF_X != 0 && s.Value >= p.Vaddr && s.Value < p.Vaddr+p.Memsz {
				out[s.Name] = s.Value - p.Vaddr + p.Off
			}
		}
	}
	return out
}

type uprobeLink struct {
	ret    bool
	file   string // as given to the kernel at attach time
	offset uint64
}

var linkIDRE = regexp.MustCompile(`(?m)^link_id:\s+(\d+)$`)

// uprobeLinksOf lists the uprobe links process pid holds, found through the
// link IDs in its fdinfo, so that links of other processes (another test
// run, say) are never counted.
func uprobeLinksOf(t *testing.T, pid int) []uprobeLink {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fdinfo", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []uprobeLink
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		m := linkIDRE.FindSubmatch(b)
		if m == nil {
			continue
		}
		id, _ := strconv.ParseUint(string(m[1]), 10, 32)
		l, err := link.NewFromID(link.ID(id))
		if err != nil {
			t.Fatalf("link %d of npuprobe: %v", id, err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			t.Fatalf("link %d of npuprobe: %v", id, err)
		}
		pe := info.PerfEvent()
		if pe == nil || pe.Uprobe() == nil {
			continue
		}
		out = append(out, uprobeLink{
			ret:    pe.Type == link.PerfEventUretprobe,
			file:   pe.Uprobe().File,
			offset: uint64(pe.Uprobe().Offset),
		})
	}
	return out
}

func checkAttachedOnce(t *testing.T, links []uprobeLink, fwdOffsets, rtOffsets map[string]uint64) {
	t.Helper()
	if len(links) == 0 {
		t.Fatal("npuprobe holds no uprobe link")
	}
	nameAt := make(map[uint64]string)
	for _, fn := range probedFunctions {
		nameAt[fwdOffsets[fn]] = fn
	}
	rtNameAt := make(map[uint64]string)
	for fn, off := range rtOffsets {
		rtNameAt[off] = fn
	}
	entries := make(map[string]int)
	returns := make(map[string]int)
	for _, l := range links {
		if l.file != links[0].file {
			t.Errorf("uprobes attached through two files: %s and %s", links[0].file, l.file)
		}
		fn, ok := nameAt[l.offset]
		if !ok {
			t.Errorf("uprobe (return %v) at offset %#x: no probed function of the forwarder (libacl_rt.so's %q is there)",
				l.ret, l.offset, rtNameAt[l.offset])
			continue
		}
		if l.ret {
			returns[fn]++
		} else {
			entries[fn]++
		}
	}
	for _, fn := range probedFunctions {
		if entries[fn] != 1 || returns[fn] > 1 {
			t.Errorf("%s: %d entry and %d return probes, want one entry probe and at most one return probe", fn, entries[fn], returns[fn])
		}
	}
	for _, fn := range []string{"aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached"} {
		if returns[fn] != 1 {
			t.Errorf("%s has no return probe: allocations are recorded at return", fn)
		}
	}
	t.Logf("%d uprobe links, all through %s, at the forwarder's offsets", len(links), links[0].file)
}

var eventsRE = regexp.MustCompile(`: (\d+) events, `)

// waitEvents waits until the status line reports at least want events, and
// requires exactly want.
func waitEvents(t *testing.T, a *agentProc, want uint64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		m := a.expect(eventsRE, time.Until(deadline))
		n, _ := strconv.ParseUint(m[1], 10, 64)
		if n > want {
			t.Fatalf("npuprobe counted %d events for %d calls: some calls were traced twice", n, want)
		}
		if n == want {
			return
		}
	}
}
