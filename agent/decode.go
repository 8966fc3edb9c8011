package agent

import (
	"encoding/binary"
	"fmt"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// recordSize is sizeof(struct npu_event) in bpf/npuprobe.bpf.c. A test
// checks it, and every field offset below, against the type bpf2go
// generated from the object's BTF.
const recordSize = 80

// Field offsets of struct npu_event.
const (
	offSeq       = 0
	offKtime     = 8
	offAddr      = 16
	offSize      = 24
	offArg       = 32
	offCtxStream = 40
	offCtxSize   = 48
	offTgid      = 56
	offTid       = 60
	offRC        = 64
	offCtxDevice = 68
	offCPU       = 72
	offFn        = 74
	offKind      = 75
	offFlags     = 76
	maxFnCode    = 33
)

// fnToCall maps enum npu_fn to the model's Call. Index = enum value.
var fnToCall = [maxFnCode + 1]allocmodel.Call{
	1:  allocmodel.CallMalloc,
	2:  allocmodel.CallMallocAlign32,
	3:  allocmodel.CallMallocCached,
	4:  allocmodel.CallFree,
	5:  allocmodel.CallSetDevice,
	6:  allocmodel.CallGetDevice,
	7:  allocmodel.CallGetMemInfo,
	8:  allocmodel.CallReserveMemAddress,
	9:  allocmodel.CallReleaseMemAddress,
	10: allocmodel.CallMallocPhysical,
	11: allocmodel.CallFreePhysical,
	12: allocmodel.CallMapMem,
	13: allocmodel.CallUnmapMem,
	16: allocmodel.CallTorchAllocate,
	17: allocmodel.CallTorchLocalRawDelete,
	18: allocmodel.CallTorchRawAlloc,
	19: allocmodel.CallTorchRawAllocWithStream,
	20: allocmodel.CallTorchRawDelete,
	32: allocmodel.CallDlopen,
	33: allocmodel.CallExec,
}

// Bits of the record's flags (enum npu_event_flag).
const (
	flagCtx       = 1
	flagCtxStream = 2
	flagCtxDevice = 4
	flagStopped   = 8
)

// kindToOutcome maps enum npu_event_kind to the model's Outcome.
var kindToOutcome = [...]allocmodel.Outcome{
	1: allocmodel.OutcomeEntry,
	2: allocmodel.OutcomeReturned,
	3: allocmodel.OutcomeFailed,
	4: allocmodel.OutcomeOOM,
}

// DecodeRecord decodes one ring-buffer record into ev. It decodes by hand
// rather than with encoding/binary's reflection: this runs for every event
// and must cost nanoseconds.
func DecodeRecord(b []byte, ev *allocmodel.Event) error {
	if len(b) < recordSize {
		return fmt.Errorf("record of %d bytes, want %d", len(b), recordSize)
	}
	le := binary.LittleEndian // both BPF targets are little-endian
	fn, kind := b[offFn], b[offKind]
	if fn == 0 || int(fn) >= len(fnToCall) || fnToCall[fn] == 0 {
		return fmt.Errorf("record with unknown function %d", fn)
	}
	if kind == 0 || int(kind) >= len(kindToOutcome) {
		return fmt.Errorf("record with unknown kind %d", kind)
	}
	flags := b[offFlags]
	*ev = allocmodel.Event{
		Seq:     le.Uint64(b[offSeq:]),
		MonoNs:  int64(le.Uint64(b[offKtime:])),
		Addr:    le.Uint64(b[offAddr:]),
		Size:    le.Uint64(b[offSize:]),
		Arg:     le.Uint64(b[offArg:]),
		Tgid:    le.Uint32(b[offTgid:]),
		Tid:     le.Uint32(b[offTid:]),
		CPU:     le.Uint16(b[offCPU:]),
		Call:    fnToCall[fn],
		Outcome: kindToOutcome[kind],
		RC:      int32(le.Uint32(b[offRC:])),
	}
	if flags&flagCtx != 0 {
		ev.Ctx = allocmodel.Context{Valid: true, Size: le.Uint64(b[offCtxSize:])}
	}
	if flags&flagCtxStream != 0 {
		ev.Ctx.Stream, ev.Ctx.HasStream = le.Uint64(b[offCtxStream:]), true
	}
	ev.Stopped = flags&flagStopped != 0
	if flags&flagCtxDevice != 0 {
		ev.Ctx.Device, ev.Ctx.HasDevice = int(int32(le.Uint32(b[offCtxDevice:]))), true
	}
	return nil
}
