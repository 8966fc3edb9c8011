// Package bench holds npuprobe's benchmarks (see BENCHMARKS.md and
// bench/run): synthetic but realistic event streams in the exact ring-buffer
// record layout, synthetic snapshots, and the helpers the Go benchmarks and
// the npubench command share.
package bench

import (
	"encoding/binary"
	"unsafe"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/bpf"
)

// RecordSize is sizeof(struct npu_event): the type bpf2go generated from
// the BPF object's BTF, so the streams here have the kernel's layout.
const RecordSize = int(unsafe.Sizeof(bpf.NpuprobeNpuEvent{}))

// Field offsets, from the generated type.
var (
	offSeq       = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Seq)
	offKtime     = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.KtimeNs)
	offAddr      = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Addr)
	offSize      = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Size)
	offArg       = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Arg)
	offCtxStream = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.CtxStream)
	offCtxSize   = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.CtxSize)
	offTgid      = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Tgid)
	offTid       = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Tid)
	offRC        = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Rc)
	offCtxDevice = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.CtxDevice)
	offCPU       = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Cpu)
	offFn        = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Fn)
	offKind      = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Kind)
	offFlags     = unsafe.Offsetof(bpf.NpuprobeNpuEvent{}.Flags)
)

// Record flags (enum npu_event_flag in bpf/npuprobe.bpf.c).
const (
	flagCtx       = 1
	flagCtxStream = 2
	flagCtxDevice = 4
)

// AppendRecord appends ev as the BPF programs write it. allocmodel's Call
// and Outcome values are the record's fn and kind codes (a test in package
// agent keeps them in step).
func AppendRecord(dst []byte, ev *allocmodel.Event) []byte {
	n := len(dst)
	dst = append(dst, make([]byte, RecordSize)...)
	b := dst[n:]
	le := binary.LittleEndian
	le.PutUint64(b[offSeq:], ev.Seq)
	le.PutUint64(b[offKtime:], uint64(ev.MonoNs))
	le.PutUint64(b[offAddr:], ev.Addr)
	le.PutUint64(b[offSize:], ev.Size)
	le.PutUint64(b[offArg:], ev.Arg)
	le.PutUint32(b[offTgid:], ev.Tgid)
	le.PutUint32(b[offTid:], ev.Tid)
	le.PutUint32(b[offRC:], uint32(ev.RC))
	le.PutUint16(b[offCPU:], ev.CPU)
	b[offFn] = byte(ev.Call)
	b[offKind] = byte(ev.Outcome)
	var flags byte
	if ev.Ctx.Valid {
		flags |= flagCtx
		le.PutUint64(b[offCtxSize:], ev.Ctx.Size)
	}
	if ev.Ctx.HasStream {
		flags |= flagCtxStream
		le.PutUint64(b[offCtxStream:], ev.Ctx.Stream)
	}
	if ev.Ctx.HasDevice {
		flags |= flagCtxDevice
		le.PutUint32(b[offCtxDevice:], uint32(int32(ev.Ctx.Device)))
	}
	b[offFlags] = flags
	return dst
}
