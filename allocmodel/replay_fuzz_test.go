package allocmodel_test

import (
	"encoding/binary"
	"testing"

	am "github.com/npuprobe/npuprobe/allocmodel"
)

// FuzzTensorTraceReplays: whatever events arrive, lost or out of order, at
// tensor level with fixed-size segments the trace replays backwards from
// the snapshot's state without an entry falling outside its segment, with
// resyncs from a live state in between.
func FuzzTensorTraceReplays(f *testing.F) {
	f.Add(make([]byte, 240))
	f.Fuzz(func(t *testing.T, data []byte) {
		m := am.New(am.Config{Level: am.LevelTensor, MaxEntries: 1 << 16})
		const base = 0x7f0000000000
		for i := 0; i+12 <= len(data); i += 12 {
			chunk := data[i : i+12]
			calls := []am.Call{am.CallMallocAlign32, am.CallFree, am.CallTorchAllocate, am.CallTorchLocalRawDelete}
			ev := am.Event{
				MonoNs:  int64(i + 1),
				Tid:     uint32(chunk[0]%2 + 1),
				Call:    calls[int(chunk[1])%len(calls)],
				Outcome: am.OutcomeReturned,
				Addr:    base + uint64(chunk[3]%16)<<21 + uint64(chunk[4]%8)<<19,
				Size:    uint64(binary.LittleEndian.Uint32(chunk[5:])) % (8 << 20),
			}
			switch ev.Call {
			case am.CallMallocAlign32:
				ev.Addr &^= 1<<21 - 1
				ev.Size = uint64(chunk[9]%4+1) << 21
				ev.Ctx = am.Context{Valid: true, Size: ev.Size / 2, HasDevice: true}
			case am.CallFree, am.CallTorchLocalRawDelete:
				ev.Outcome = am.OutcomeEntry
			case am.CallTorchAllocate:
				ev.Arg = 20 << 8
			}
			m.Apply(&ev)
			if chunk[10] == 0xff {
				// A resync with a live state made of this chunk's bits.
				var live am.LiveState
				for k := range 4 {
					if chunk[11]>>k&1 != 0 {
						addr := base + uint64(k)<<23
						live.Segments = append(live.Segments, am.LiveAllocation{Addr: addr, Size: uint64(k+1) << 21, Device: 0, ByAllocator: true})
						live.Blocks = append(live.Blocks, am.LiveAllocation{Addr: addr, Size: uint64(chunk[9]) << 12, Device: 0})
					}
				}
				m.Resync(live)
			}
		}
		replayBackwards(t, m.Snapshot())
	})
}
