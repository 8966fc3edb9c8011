package agent

import (
	"bytes"
	"encoding/binary"
	"os"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/bpf"
)

// decoderOffsets names, per field of the bpf2go type, the offset constant
// DecodeRecord reads it at. Padding is absent: it is never read.
var decoderOffsets = map[string]int{
	"Seq":       offSeq,
	"KtimeNs":   offKtime,
	"Addr":      offAddr,
	"Size":      offSize,
	"Arg":       offArg,
	"CtxStream": offCtxStream,
	"CtxSize":   offCtxSize,
	"Tgid":      offTgid,
	"Tid":       offTid,
	"Rc":        offRC,
	"CtxDevice": offCtxDevice,
	"Cpu":       offCPU,
	"Fn":        offFn,
	"Kind":      offKind,
	"Flags":     offFlags,
}

// decoderWidths is how many bytes DecodeRecord reads per field.
var decoderWidths = map[string]uintptr{
	"Seq": 8, "KtimeNs": 8, "Addr": 8, "Size": 8, "Arg": 8, "CtxStream": 8, "CtxSize": 8,
	"Tgid": 4, "Tid": 4, "Rc": 4, "CtxDevice": 4, "Cpu": 2, "Fn": 1, "Kind": 1, "Flags": 1,
}

func isPadding(name string) bool { return name == "_" || strings.HasPrefix(name, "Pad") }

// The hand-written offsets must be where bpf2go, reading the object's BTF,
// put each field of struct npu_event, and read with the field's width; a
// field the decoder does not know fails the test.
func TestRecordLayoutMatchesBTF(t *testing.T) {
	typ := reflect.TypeFor[bpf.NpuprobeNpuEvent]()
	if typ.Size() != recordSize {
		t.Errorf("sizeof(struct npu_event) = %d in the BTF, recordSize = %d", typ.Size(), recordSize)
	}
	seen := map[string]bool{}
	for i := range typ.NumField() {
		f := typ.Field(i)
		if isPadding(f.Name) {
			continue
		}
		seen[f.Name] = true
		off, ok := decoderOffsets[f.Name]
		if !ok {
			t.Errorf("npu_event field %s (offset %d) is not decoded: add it to DecodeRecord and this test", f.Name, f.Offset)
			continue
		}
		if f.Offset != uintptr(off) {
			t.Errorf("npu_event.%s is at offset %d in the BTF, the decoder reads offset %d", f.Name, f.Offset, off)
		}
		if f.Type.Size() != decoderWidths[f.Name] {
			t.Errorf("npu_event.%s is %d bytes in the BTF, the decoder reads %d", f.Name, f.Type.Size(), decoderWidths[f.Name])
		}
		if f.Offset+f.Type.Size() > recordSize {
			t.Errorf("npu_event.%s ends at %d, past the %d-byte record", f.Name, f.Offset+f.Type.Size(), recordSize)
		}
	}
	for name := range decoderOffsets {
		if !seen[name] {
			t.Errorf("the decoder reads %s, which struct npu_event no longer has", name)
		}
	}
}

// The committed bpf2go type must describe the struct in the C source, so a
// C edit without `go generate ./bpf` fails here instead of in the field.
func TestGeneratedTypeMatchesCSource(t *testing.T) {
	m := regexp.MustCompile(`(?s)struct npu_event \{(.*?)\};`).FindStringSubmatch(bpfSource(t))
	if m == nil {
		t.Fatal("struct npu_event not found in bpf/npuprobe.bpf.c")
	}
	sizes := map[string]uintptr{"__u64": 8, "__s64": 8, "__u32": 4, "__s32": 4, "__u16": 2, "__s16": 2, "__u8": 1, "__s8": 1}
	decl := regexp.MustCompile(`^(__[us](?:8|16|32|64))\s+(\w+)(?:\[(\d+)\])?$`)
	var cFields []string
	var cSizes []uintptr
	for _, stmt := range strings.Split(stripComments(m[1]), ";") {
		stmt = strings.TrimSpace(stmt)
		if stmt == "" {
			continue
		}
		d := decl.FindStringSubmatch(stmt)
		if d == nil {
			t.Fatalf("struct npu_event: cannot read member %q", stmt)
		}
		n := uintptr(1)
		if d[3] != "" {
			k, _ := strconv.Atoi(d[3])
			n = uintptr(k)
		}
		cFields = append(cFields, goFieldName(d[2]))
		cSizes = append(cSizes, sizes[d[1]]*n)
	}
	typ := reflect.TypeFor[bpf.NpuprobeNpuEvent]()
	var goFields []string
	var goSizes []uintptr
	for i := range typ.NumField() {
		if f := typ.Field(i); f.Name != "_" {
			goFields = append(goFields, f.Name)
			goSizes = append(goSizes, f.Type.Size())
		}
	}
	if !reflect.DeepEqual(cFields, goFields) || !reflect.DeepEqual(cSizes, goSizes) {
		t.Errorf("struct npu_event in C: %v %v\nbpf2go type:            %v %v\n(run go generate ./bpf)", cFields, cSizes, goFields, goSizes)
	}
}

// goFieldName is bpf2go's name for a C member: ctx_stream -> CtxStream.
func goFieldName(c string) string {
	var b strings.Builder
	for _, part := range strings.Split(c, "_") {
		if part != "" {
			b.WriteString(strings.ToUpper(part[:1]) + part[1:])
		}
	}
	return b.String()
}

func stripComments(s string) string {
	return regexp.MustCompile(`(?s)/\*.*?\*/|//[^\n]*`).ReplaceAllString(s, "")
}

// cEnum returns the NAME = value entries of "enum name { ... };" in the
// BPF source.
func cEnum(t *testing.T, src, name string) map[string]int {
	t.Helper()
	re := regexp.MustCompile(`(?s)enum\s+` + regexp.QuoteMeta(name) + `\s*\{(.*?)\};`)
	m := re.FindStringSubmatch(src)
	if m == nil {
		t.Fatalf("enum %s not found in bpf/npuprobe.bpf.c", name)
	}
	out := make(map[string]int)
	next := 0
	for _, item := range strings.Split(stripComments(m[1]), ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		k, v, hasValue := strings.Cut(item, "=")
		k = strings.TrimSpace(k)
		if hasValue {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 0, 64)
			if err != nil {
				t.Fatalf("enum %s: cannot read the value of %s: %q", name, k, v)
			}
			next = int(n)
		}
		if _, dup := out[k]; dup {
			t.Fatalf("enum %s: %s twice", name, k)
		}
		out[k] = next
		next++
	}
	return out
}

func bpfSource(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../bpf/npuprobe.bpf.c")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// record encodes ev as the BPF programs lay out struct npu_event: the
// bpf2go type field by field, little-endian (both BPF targets are).
func record(t testing.TB, ev bpf.NpuprobeNpuEvent) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.LittleEndian, &ev); err != nil {
		t.Fatal(err)
	}
	if buf.Len() != recordSize {
		t.Fatalf("encoded npu_event is %d bytes, want %d", buf.Len(), recordSize)
	}
	return buf.Bytes()
}

// noRecord marks an enum npu_fn value whose program never emits a record.
const noRecord allocmodel.Call = 0

// fnsInC is what every enum npu_fn value must decode to.
var fnsInC = map[string]allocmodel.Call{
	"NPU_FN_MALLOC":                 allocmodel.CallMalloc,
	"NPU_FN_MALLOC_ALIGN32":         allocmodel.CallMallocAlign32,
	"NPU_FN_MALLOC_CACHED":          allocmodel.CallMallocCached,
	"NPU_FN_FREE":                   allocmodel.CallFree,
	"NPU_FN_SET_DEVICE":             allocmodel.CallSetDevice,
	"NPU_FN_GET_DEVICE":             allocmodel.CallGetDevice,
	"NPU_FN_GET_MEM_INFO":           allocmodel.CallGetMemInfo,
	"NPU_FN_RESERVE_MEM_ADDRESS":    allocmodel.CallReserveMemAddress,
	"NPU_FN_RELEASE_MEM_ADDRESS":    allocmodel.CallReleaseMemAddress,
	"NPU_FN_MALLOC_PHYSICAL":        allocmodel.CallMallocPhysical,
	"NPU_FN_FREE_PHYSICAL":          allocmodel.CallFreePhysical,
	"NPU_FN_MAP_MEM":                allocmodel.CallMapMem,
	"NPU_FN_UNMAP_MEM":              allocmodel.CallUnmapMem,
	"NPU_FN_DLOPEN":                 allocmodel.CallDlopen,
	"NPU_FN_EXEC":                   allocmodel.CallExec,
	"NPU_FN_TORCH_ALLOCATE":         allocmodel.CallTorchAllocate,
	"NPU_FN_TORCH_LOCAL_RAW_DELETE": allocmodel.CallTorchLocalRawDelete,
	"NPU_FN_TORCH_RAW_ALLOC":        allocmodel.CallTorchRawAlloc,
	"NPU_FN_TORCH_RAW_ALLOC_STREAM": allocmodel.CallTorchRawAllocWithStream,
	"NPU_FN_TORCH_RAW_DELETE":       allocmodel.CallTorchRawDelete,
	// Supplies context to other records (last_mallocs); emits none itself.
	"NPU_FN_TORCH_MALLOC": noRecord,
}

// The C enum, allocmodel's constants and the decoder's table must agree
// value for value: a renumbering on any side fails here.
func TestFunctionCodesMatchC(t *testing.T) {
	fns := cEnum(t, bpfSource(t), "npu_fn")
	for name := range fns {
		if _, ok := fnsInC[name]; !ok {
			t.Errorf("enum npu_fn has %s = %d, unknown to this test: map it to an allocmodel.Call (or noRecord)", name, fns[name])
		}
	}
	maxValue := 0
	for name, call := range fnsInC {
		v, ok := fns[name]
		if !ok {
			t.Errorf("enum npu_fn has no %s", name)
			continue
		}
		maxValue = max(maxValue, v)
		if v <= 0 || v > 255 {
			t.Errorf("%s = %d does not fit the record's u8 fn", name, v)
			continue
		}
		var ev allocmodel.Event
		err := DecodeRecord(record(t, bpf.NpuprobeNpuEvent{Fn: uint8(v), Kind: 2}), &ev)
		if call == noRecord {
			if err == nil {
				t.Errorf("%s = %d decodes as %v; it is never recorded", name, v, ev.Call)
			}
			continue
		}
		if v != int(call) {
			t.Errorf("%s = %d in C, allocmodel.Call %v = %d", name, v, call, call)
		}
		if v >= len(fnToCall) || fnToCall[v] != call {
			t.Errorf("fnToCall does not map %s (%d) to %v", name, v, call)
		}
		if err != nil {
			t.Errorf("%s: %v", name, err)
		} else if ev.Call != call {
			t.Errorf("record with fn %d (%s) decodes as %v, want %v", v, name, ev.Call, call)
		}
	}
	if maxValue != maxFnCode {
		t.Errorf("largest enum npu_fn value is %d, maxFnCode is %d", maxValue, maxFnCode)
	}
	// No table entry without its C value.
	for v, call := range fnToCall {
		if call == 0 {
			continue
		}
		found := false
		for name, cv := range fns {
			found = found || (cv == v && fnsInC[name] == call)
		}
		if !found {
			t.Errorf("fnToCall[%d] = %v, but enum npu_fn has no such value for it", v, call)
		}
	}
}

func TestEventKindsMatchC(t *testing.T) {
	kinds := cEnum(t, bpfSource(t), "npu_event_kind")
	want := map[string]allocmodel.Outcome{
		"NPU_EV_ENTRY":  allocmodel.OutcomeEntry,
		"NPU_EV_RETURN": allocmodel.OutcomeReturned,
		"NPU_EV_FAILED": allocmodel.OutcomeFailed,
		"NPU_EV_OOM":    allocmodel.OutcomeOOM,
	}
	if len(kinds) != len(want) {
		t.Errorf("enum npu_event_kind has %d values %v, the test knows %d", len(kinds), kinds, len(want))
	}
	for name, outcome := range want {
		v, ok := kinds[name]
		if !ok {
			t.Errorf("enum npu_event_kind has no %s", name)
			continue
		}
		if v != int(outcome) {
			t.Errorf("%s = %d in C, allocmodel outcome = %d", name, v, outcome)
		}
		if v <= 0 || v >= len(kindToOutcome) || kindToOutcome[v] != outcome {
			t.Errorf("kindToOutcome does not map %s (%d) to %d", name, v, outcome)
		}
		var ev allocmodel.Event
		if err := DecodeRecord(record(t, bpf.NpuprobeNpuEvent{Fn: 1, Kind: uint8(v)}), &ev); err != nil {
			t.Errorf("%s: %v", name, err)
		} else if ev.Outcome != outcome {
			t.Errorf("record with kind %d (%s) decodes as outcome %d, want %d", v, name, ev.Outcome, outcome)
		}
	}
	if len(kindToOutcome) != len(kinds)+1 {
		t.Errorf("kindToOutcome has %d entries, want %d (index 0 unused)", len(kindToOutcome), len(kinds)+1)
	}
}

func TestEventFlagsMatchC(t *testing.T) {
	flags := cEnum(t, bpfSource(t), "npu_event_flag")
	want := map[string]int{"NPU_EVF_CTX": flagCtx, "NPU_EVF_CTX_STREAM": flagCtxStream, "NPU_EVF_CTX_DEVICE": flagCtxDevice, "NPU_EVF_STOPPED": flagStopped}
	if len(flags) != len(want) {
		t.Errorf("enum npu_event_flag has %v, the decoder knows %v", flags, want)
	}
	for name, v := range want {
		if got, ok := flags[name]; !ok || got != v {
			t.Errorf("%s = %d in C (present %v), the decoder tests bit %d", name, got, ok, v)
		}
	}
}

// Tracer.Loss reads the counters by literal index: pin the C side.
func TestCounterIndexes(t *testing.T) {
	ctrs := cEnum(t, bpfSource(t), "npu_counter")
	want := map[string]int{
		"NPU_CTR_SEQ": 0, "NPU_CTR_RINGBUF_FULL": 1, "NPU_CTR_RETURN_UNPAIRED": 2,
		"NPU_CTR_PENDING_FULL": 3, "NPU_CTR_READ_FAILED": 4,
	}
	for name, v := range want {
		if got, ok := ctrs[name]; !ok || got != v {
			t.Errorf("enum npu_counter: %s = %d (present %v); Tracer.Loss reads index %d", name, got, ok, v)
		}
	}
}

func TestDecodeRoundTrip(t *testing.T) {
	in := bpf.NpuprobeNpuEvent{
		Seq:       0x0102030405060708,
		KtimeNs:   0x7fffffff_fffffff0, // largest CLOCK_MONOTONIC an int64 holds
		Addr:      0xffff_8000_1234_5640,
		Size:      20 << 20,
		Arg:       0xfedcba9876543210,
		CtxStream: 0x1111_2222_3333_4444,
		CtxSize:   3 << 20,
		Tgid:      0xfffffffe,
		Tid:       4242,
		Rc:        207001,
		CtxDevice: -1,
		Cpu:       0xfffe,
		Fn:        2, // aclrtMallocAlign32
		Kind:      4, // OOM
		Flags:     flagCtx | flagCtxStream | flagCtxDevice,
		Pad:       [3]uint8{0xff, 0xff, 0xff}, // never read
	}
	var ev allocmodel.Event
	if err := DecodeRecord(record(t, in), &ev); err != nil {
		t.Fatal(err)
	}
	want := allocmodel.Event{
		Seq: in.Seq, MonoNs: int64(in.KtimeNs), Addr: in.Addr, Size: in.Size, Arg: in.Arg,
		Tgid: in.Tgid, Tid: in.Tid, CPU: in.Cpu,
		Call: allocmodel.CallMallocAlign32, Outcome: allocmodel.OutcomeOOM, RC: 207001,
		Ctx: allocmodel.Context{Valid: true, Size: 3 << 20, HasStream: true, Stream: 0x1111_2222_3333_4444, HasDevice: true, Device: -1},
	}
	if ev != want {
		t.Errorf("decoded %+v\nwant    %+v", ev, want)
	}

	// Distinct small values everywhere, so that no field is read from its
	// neighbour's bytes; ctx_* without their flag bits are ignored; the
	// previous event's context does not leak into this one.
	in = bpf.NpuprobeNpuEvent{Seq: 1, KtimeNs: 2, Addr: 3, Size: 4, Arg: 5, CtxStream: 6, CtxSize: 7,
		Tgid: 8, Tid: 9, Rc: -1, CtxDevice: 10, Cpu: 11, Fn: 4, Kind: 3}
	if err := DecodeRecord(record(t, in), &ev); err != nil {
		t.Fatal(err)
	}
	want = allocmodel.Event{Seq: 1, MonoNs: 2, Addr: 3, Size: 4, Arg: 5, Tgid: 8, Tid: 9, CPU: 11,
		Call: allocmodel.CallFree, Outcome: allocmodel.OutcomeFailed, RC: -1}
	if ev != want {
		t.Errorf("decoded %+v\nwant    %+v", ev, want)
	}

	// Each flag bit brings exactly its own fields.
	in.Flags = flagCtxStream
	if err := DecodeRecord(record(t, in), &ev); err != nil {
		t.Fatal(err)
	}
	if want := (allocmodel.Context{HasStream: true, Stream: 6}); ev.Ctx != want {
		t.Errorf("stream flag only: Ctx %+v, want %+v", ev.Ctx, want)
	}
	in.Flags = flagCtxDevice
	if err := DecodeRecord(record(t, in), &ev); err != nil {
		t.Fatal(err)
	}
	if want := (allocmodel.Context{HasDevice: true, Device: 10}); ev.Ctx != want {
		t.Errorf("device flag only: Ctx %+v, want %+v", ev.Ctx, want)
	}

	// The ring buffer may hand over a longer sample; bytes past the record
	// are ignored.
	in.Flags = 0
	long := append(record(t, in), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
	if err := DecodeRecord(long, &ev); err != nil || ev != want {
		t.Errorf("record with trailing bytes: %+v, %v", ev, err)
	}
}

func TestDecodeRejects(t *testing.T) {
	valid := bpf.NpuprobeNpuEvent{Fn: 1, Kind: 2}
	for fn := 0; fn < 256; fn++ {
		if fn < len(fnToCall) && fnToCall[fn] != 0 {
			continue
		}
		ev := valid
		ev.Fn = uint8(fn)
		var out allocmodel.Event
		if err := DecodeRecord(record(t, ev), &out); err == nil || !strings.Contains(err.Error(), "unknown function") {
			t.Errorf("fn %d: err %v, want an unknown-function error", fn, err)
		}
	}
	for _, kind := range []uint8{0, uint8(len(kindToOutcome)), 0x80, 0xff} {
		ev := valid
		ev.Kind = kind
		var out allocmodel.Event
		if err := DecodeRecord(record(t, ev), &out); err == nil || !strings.Contains(err.Error(), "unknown kind") {
			t.Errorf("kind %d: err %v, want an unknown-kind error", kind, err)
		}
	}
	full := record(t, valid)
	for n := 0; n < recordSize; n++ {
		var out allocmodel.Event
		if err := DecodeRecord(full[:n], &out); err == nil {
			t.Errorf("%d-byte record accepted", n)
		}
	}
	var out allocmodel.Event
	if err := DecodeRecord(nil, &out); err == nil {
		t.Error("nil record accepted")
	}
}

func BenchmarkDecodeRecord(b *testing.B) {
	raw := record(b, bpf.NpuprobeNpuEvent{Fn: 1, Kind: 2, Addr: 1 << 40, Size: 2 << 20, Flags: flagCtx})
	var ev allocmodel.Event
	b.ReportAllocs()
	for b.Loop() {
		if err := DecodeRecord(raw, &ev); err != nil {
			b.Fatal(err)
		}
	}
}
