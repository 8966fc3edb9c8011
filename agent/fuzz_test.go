package agent

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/npuprobe/npuprobe/allocmodel"
)

// FuzzDecodeRecord: any bytes either decode to an event whose fields are
// the record's own, or are rejected; never a panic.
func FuzzDecodeRecord(f *testing.F) {
	rec := make([]byte, recordSize)
	binary.LittleEndian.PutUint64(rec[offAddr:], 0x7f0000001000)
	rec[offFn], rec[offKind] = 2, 2
	f.Add(rec)
	f.Add(rec[:10])
	f.Add(bytes.Repeat([]byte{0xff}, recordSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		var ev allocmodel.Event
		err := DecodeRecord(b, &ev)
		if err != nil {
			return
		}
		if len(b) < recordSize {
			t.Fatalf("decoded a %d-byte record", len(b))
		}
		if ev.Addr != binary.LittleEndian.Uint64(b[offAddr:]) || ev.Tid != binary.LittleEndian.Uint32(b[offTid:]) {
			t.Fatal("fields not taken from the record")
		}
		if ev.Call == 0 || ev.Outcome == 0 {
			t.Fatal("decoded an unknown function or kind")
		}
	})
}

// FuzzParseMaps: /proc/PID/maps text of any shape parses or errors; kept
// mappings are file-backed with an absolute path and a sane range.
func FuzzParseMaps(f *testing.F) {
	f.Add("7f0000000000-7f0000021000 r-xp 00000000 fd:01 1234 /usr/lib/libascendcl.so\n")
	f.Add("55d4c000-55d4d000 rw-p 00000000 00:00 0 [heap]\n7f00-7f01 r--p 0 103:05 9 /a b (deleted)\n")
	f.Add("garbage")
	f.Fuzz(func(t *testing.T, text string) {
		maps, err := ParseMaps(bytes.NewReader([]byte(text)))
		if err != nil {
			return
		}
		for _, m := range maps {
			if m.Path == "" || m.Path[0] != '/' || m.Inode == 0 {
				t.Fatalf("kept a mapping without a file: %+v", m)
			}
		}
	})
}

// FuzzParseEnviron: keys never contain '=' or NUL.
func FuzzParseEnviron(f *testing.F) {
	f.Add([]byte("PYTORCH_NPU_ALLOC_CONF=max_split_size_mb:64\x00RANK=0\x00"))
	f.Add([]byte("=x\x00A==b\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		for k := range ParseEnviron(b) {
			if k == "" || bytes.ContainsAny([]byte(k), "=\x00") {
				t.Fatalf("bad key %q", k)
			}
		}
	})
}

// FuzzParseStatus: never panics; a parsed Tgid is what the text says.
func FuzzParseStatus(f *testing.F) {
	f.Add("Name:\tpython3\nTgid:\t42\nNSpid:\t42\t7\n")
	f.Add("Tgid: x\n")
	f.Fuzz(func(t *testing.T, text string) {
		parseStatus(bytes.NewReader([]byte(text)))
	})
}
