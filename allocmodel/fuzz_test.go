package allocmodel_test

import (
	"encoding/binary"
	"testing"

	am "github.com/npuprobe/npuprobe/allocmodel"
)

// FuzzModel applies arbitrary event sequences, as a corrupt or adversarial
// ring buffer could deliver them, at both levels, and checks the model's
// invariants after each: no panic, blocks tile every segment exactly and
// in order, and the snapshot's traces have one list per device.
func FuzzModel(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20})
	f.Add(make([]byte, 200))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, level := range []am.Level{am.LevelSegment, am.LevelTensor} {
			m := am.New(am.Config{Level: level, MaxEntries: 64})
			const base = 0x7f0000000000
			for i := 0; i+12 <= len(data); i += 12 {
				chunk := data[i : i+12]
				calls := []am.Call{am.CallMalloc, am.CallFree, am.CallSetDevice, am.CallGetMemInfo,
					am.CallTorchAllocate, am.CallTorchLocalRawDelete, am.CallReserveMemAddress,
					am.CallMapMem, am.CallUnmapMem, am.CallMallocPhysical, am.CallReleaseMemAddress}
				ev := am.Event{
					MonoNs:  int64(i),
					Tid:     uint32(chunk[0] % 3),
					Call:    calls[int(chunk[1])%len(calls)],
					Outcome: am.Outcome(chunk[2]%4 + 1),
					Addr:    base + uint64(binary.LittleEndian.Uint16(chunk[3:]))*512,
					Size:    uint64(binary.LittleEndian.Uint32(chunk[5:])) % (64 << 20),
					Arg:     uint64(chunk[9] % 4),
				}
				if chunk[10]&1 != 0 {
					ev.Ctx = am.Context{Valid: true, Size: ev.Size / 2, HasDevice: chunk[10]&2 != 0, Device: int(chunk[11] % 4)}
				}
				m.Apply(&ev)
				if i%120 == 0 {
					m.Resync(am.LiveState{Segments: []am.LiveAllocation{{Addr: ev.Addr, Size: 2 << 20, Device: -1, ByAllocator: true}}})
				}
			}
			snap := m.Snapshot()
			for _, s := range snap.Segments {
				addr := s.Address
				for _, b := range s.Blocks {
					if b.Address != addr || b.Size == 0 {
						t.Fatalf("level %v: segment %#x: block %#x+%d does not follow %#x", level, s.Address, b.Address, b.Size, addr)
					}
					addr += b.Size
				}
				if addr != s.Address+s.TotalSize {
					t.Fatalf("level %v: segment %#x: blocks end at %#x, segment at %#x", level, s.Address, addr, s.Address+s.TotalSize)
				}
				if s.Device >= len(snap.Traces) {
					t.Fatalf("segment on device %d, %d traces", s.Device, len(snap.Traces))
				}
			}
		}
	})
}

// FuzzParseAllocConf: any configuration string parses or errors cleanly,
// and a parsed one rounds every size to a multiple of 512 no smaller than
// the request.
func FuzzParseAllocConf(f *testing.F) {
	f.Add("max_split_size_mb:40,roundup_power2_divisions:4", uint64(1000))
	f.Add("roundup_power2_divisions:[1:2,64:8,>:4]", uint64(5<<20))
	f.Add("expandable_segments:True,base_addr_aligned_kb:16", uint64(0))
	f.Fuzz(func(t *testing.T, s string, size uint64) {
		c, err := am.ParseAllocConf(s)
		if err != nil {
			return
		}
		size %= 1 << 40
		r := c.RoundSize(size)
		if r < size || r%512 != 0 {
			t.Fatalf("%q: RoundSize(%d) = %d", s, size, r)
		}
	})
}
