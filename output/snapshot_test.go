package output_test

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/output"
)

// The spec's worked example (snapshot-format §13).
const (
	exSeg    = 0x12C040000000 // segment base
	exStream = 0xAAAAD1E2F3A0 // aclrtStream pointer value
	exT0     = 1767225600000000
)

func workedExample() *allocmodel.Snapshot {
	entry := func(a allocmodel.Action, addr, size uint64, dt int64) allocmodel.TraceEntry {
		return allocmodel.TraceEntry{MonoNs: 1000 + dt, TimeUs: exT0 + dt, Action: a, Addr: addr, Size: size, Stream: exStream}
	}
	return &allocmodel.Snapshot{
		Level: allocmodel.LevelTensor,
		Segments: []allocmodel.Segment{{
			Device:    0,
			Address:   exSeg,
			TotalSize: 2097152,
			Stream:    exStream,
			Type:      allocmodel.SegmentSmall,
			Blocks: []allocmodel.Block{
				{Address: exSeg, Size: 4608, RequestedSize: 4096, State: allocmodel.BlockInactive},
				{Address: exSeg + 0x1200, Size: 1536, RequestedSize: 1000, State: allocmodel.BlockActiveAllocated},
				{Address: exSeg + 0x1800, Size: 2091008, RequestedSize: 0, State: allocmodel.BlockInactive},
			},
		}},
		Traces: [][]allocmodel.TraceEntry{{
			entry(allocmodel.ActionSegmentAlloc, exSeg, 2097152, 0),
			entry(allocmodel.ActionAlloc, exSeg, 4096, 12),
			entry(allocmodel.ActionAlloc, exSeg+0x1200, 1000, 40),
			entry(allocmodel.ActionFreeRequested, exSeg, 4096, 95),
			entry(allocmodel.ActionFreeCompleted, exSeg, 4096, 95),
		}},
		Pools:       []allocmodel.PoolID{{0, 0}},
		Overwritten: []uint64{0},
	}
}

var exSettings = []output.Setting{
	{Key: "trace_alloc_max_entries", Value: 0},
	{Key: "trace_alloc_overflowed", Value: false},
	{Key: "npuprobe", Value: []output.Setting{
		{Key: "level", Value: "tensor"},
		{Key: "events", Value: uint64(1) << 40},
		{Key: "drops", Value: int64(-3)},
		{Key: "ratio", Value: 0.25},
		{Key: "note", Value: nil},
		{Key: "empty", Value: []output.Setting{}},
	}},
}

// The spec's dict, verbatim, plus the allocator_settings written above.
const exPython = `
SEG = 0x12C040000000          # segment base (illustrative device VA, < 2**53)
STREAM = 0xAAAAD1E2F3A0       # aclrtStream pointer value as int (illustrative)

snapshot = {
    'segments': [{
        'device': 0,
        'address': SEG,
        'total_size': 2097152,
        'allocated_size': 1536,        # the live 1000 B tensor's block
        'active_size': 1536,
        'requested_size': 1000,
        'stream': STREAM,
        'segment_type': 'small',
        'segment_pool_id': (0, 0),
        'is_expandable': False,
        'frames': [],
        'blocks': [
            {'address': SEG,          'size': 4608,    'requested_size': 4096,
             'state': 'inactive',         'frames': []},   # freed tensor, cached
            {'address': SEG + 0x1200, 'size': 1536,    'requested_size': 1000,
             'state': 'active_allocated', 'frames': []},   # live tensor
            {'address': SEG + 0x1800, 'size': 2091008, 'requested_size': 0,
             'state': 'inactive',         'frames': []},   # never-used remainder
        ],
    }],
    'device_traces': [[   # device 0, oldest -> newest
        {'action': 'segment_alloc',  'addr': SEG,          'size': 2097152,
         'stream': STREAM, 'pool_id': (0, 0), 'time_us': 1767225600000000},
        {'action': 'alloc',          'addr': SEG,          'size': 4096,
         'stream': STREAM, 'pool_id': (0, 0), 'time_us': 1767225600000012},
        {'action': 'alloc',          'addr': SEG + 0x1200, 'size': 1000,
         'stream': STREAM, 'pool_id': (0, 0), 'time_us': 1767225600000040},
        {'action': 'free_requested', 'addr': SEG,          'size': 4096,
         'stream': STREAM, 'pool_id': (0, 0), 'time_us': 1767225600000095},
        {'action': 'free_completed', 'addr': SEG,          'size': 4096,
         'stream': STREAM, 'pool_id': (0, 0), 'time_us': 1767225600000095},
    ]],
}
snapshot['allocator_settings'] = {
    'trace_alloc_max_entries': 0,
    'trace_alloc_overflowed': False,
    'npuprobe': {'level': 'tensor', 'events': 2**40, 'drops': -3, 'ratio': 0.25, 'note': None, 'empty': {}},
}
`

// pySnapshotChecks holds checks every snapshot pickle must pass in CPython.
const pySnapshotChecks = `
import pickle, pickletools, sys

def load(path):
    data = open(path, "rb").read()
    protos = [arg for op, arg, pos in pickletools.genops(data) if op.name == "PROTO"]
    if protos != [4]: raise SystemExit("PROTO %r" % protos)
    return pickle.loads(data)

def check_identity(snap):
    # Every trace entry and block is its own dict (spec §9.2); the encoder
    # shares no dict or list at all.
    entries = [e for tr in snap["device_traces"] for e in tr]
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    for name, objs in (("trace entries", entries), ("blocks", blocks)):
        if len({id(o) for o in objs}) != len(objs):
            raise SystemExit("shared %s" % name)
    containers = []
    def walk(v):
        if type(v) in (dict, list):
            containers.append(v)
            for x in (v.values() if type(v) is dict else v): walk(x)
    walk(snap)
    if len({id(o) for o in containers}) != len(containers):
        raise SystemExit("a dict or list is shared")

def check_types(snap):
    for s in snap["segments"]:
        if type(s["segment_pool_id"]) is not tuple: raise SystemExit("segment_pool_id is %r" % type(s["segment_pool_id"]))
        if type(s["device"]) is not int: raise SystemExit("device is not an int")
        if type(s["is_expandable"]) is not bool: raise SystemExit("is_expandable is not a bool")
    for tr in snap["device_traces"]:
        for e in tr:
            if type(e["pool_id"]) is not tuple: raise SystemExit("pool_id is %r" % type(e["pool_id"]))
            if not all(type(x) is int for x in e["pool_id"]): raise SystemExit("pool_id holds non-ints")
            want = {"action", "size", "stream", "time_us", "pool_id"}
            want.add("device_free" if e["action"] == "oom" else "addr")
            if set(e) != want: raise SystemExit("entry keys %r, want %r" % (sorted(e), sorted(want)))
`

func TestWriteSnapshotWorkedExample(t *testing.T) {
	var buf bytes.Buffer
	if err := output.WriteSnapshot(&buf, workedExample(), exSettings); err != nil {
		t.Fatal(err)
	}
	mustWalk(t, buf.Bytes())
	script := pyStrictEq + pySnapshotChecks + exPython + `
got = load(sys.argv[1])
r = strict_eq(got, snapshot)
if r: raise SystemExit(r)
check_identity(got)
check_types(got)
# The two adjacent free entries are equal in value, yet distinct objects.
tr = got["device_traces"][0]
if tr[3]["addr"] != tr[4]["addr"] or tr[3] is tr[4]: raise SystemExit("free pair")
print("ok")
`
	if out := runPython(t, script, writeTemp(t, buf.Bytes())); string(out) != "ok\n" {
		t.Errorf("python3: %q", out)
	}

	// gopickle sees the same, with torch's key order.
	got := gopickleLoad(t, buf.Bytes()).(dict)
	var keys []string
	for _, x := range got {
		keys = append(keys, x.K)
	}
	if want := []string{"segments", "device_traces", "allocator_settings"}; !reflect.DeepEqual(keys, want) {
		t.Errorf("top-level keys %v, want %v", keys, want)
	}
	seg := got[0].V.(list)[0].(dict)
	keys = nil
	for _, x := range seg {
		keys = append(keys, x.K)
	}
	if want := []string{"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
		"stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}; !reflect.DeepEqual(keys, want) {
		t.Errorf("segment keys %v, want %v", keys, want)
	}
	wantEntry := dict{
		{"action", "alloc"}, {"addr", int64(exSeg + 0x1200)}, {"size", int64(1000)},
		{"stream", int64(exStream)}, {"time_us", int64(exT0 + 40)}, {"pool_id", tuple{int64(0), int64(0)}},
	}
	if e := got[1].V.(list)[0].(list)[2]; !reflect.DeepEqual(e, wantEntry) {
		t.Errorf("third entry %#v, want %#v", e, wantEntry)
	}
}

// TestWriteSnapshotDevicesPoolsOOM: several devices (one with an empty
// trace), pools other than the default, oom entries with device_free and no
// addr, value-identical entries written as distinct dicts, and segment sizes
// summed from blocks of every state.
func TestWriteSnapshotDevicesPoolsOOM(t *testing.T) {
	const base = 0x7f0000000000
	snap := &allocmodel.Snapshot{
		Level: allocmodel.LevelTensor,
		Segments: []allocmodel.Segment{
			{Device: 0, Address: base, TotalSize: 20 << 20, Stream: 0, Pool: 0, Type: allocmodel.SegmentLarge,
				Blocks: []allocmodel.Block{{Address: base, Size: 20 << 20}}},
			{Device: 2, Address: base + (1 << 30), TotalSize: 6144, Stream: 7, Pool: 1, Type: allocmodel.SegmentSmall, Expandable: true,
				Blocks: []allocmodel.Block{
					{Address: base + (1 << 30), Size: 1024, RequestedSize: 1000, State: allocmodel.BlockActiveAllocated},
					{Address: base + (1 << 30) + 1024, Size: 2048, RequestedSize: 2000, State: allocmodel.BlockActivePendingFree},
					{Address: base + (1 << 30) + 3072, Size: 512, RequestedSize: 7, State: allocmodel.BlockInactive},
					{Address: base + (1 << 30) + 3584, Size: 2560, RequestedSize: 2500, State: allocmodel.BlockActiveAllocated},
				}},
			// A pool index the snapshot does not list is written as (0, 0).
			{Device: 2, Address: base + (2 << 30), TotalSize: 512, Pool: 9,
				Blocks: []allocmodel.Block{{Address: base + (2 << 30), Size: 512}}},
		},
		Traces: [][]allocmodel.TraceEntry{
			{
				{TimeUs: exT0, Action: allocmodel.ActionOOM, Addr: 123456789, Size: 30 << 20},
				{TimeUs: exT0 + 1, Action: allocmodel.ActionSegmentFree, Addr: base + 512, Size: 0},
				{TimeUs: exT0 + 1, Action: allocmodel.ActionSegmentFree, Addr: base + 512, Size: 0},
			},
			{},
			{
				{TimeUs: exT0 + 2, Action: allocmodel.ActionSnapshot, Addr: 0, Size: 3584, Pool: 1},
				{TimeUs: exT0 + 3, Action: allocmodel.ActionOOM, Addr: 0, Size: 1 << 30, Stream: 7, Pool: 1},
			},
		},
		Pools: []allocmodel.PoolID{{0, 0}, {1, 7}},
	}
	var buf bytes.Buffer
	if err := output.WriteSnapshot(&buf, snap, nil); err != nil {
		t.Fatal(err)
	}
	seg := func(dev, addr, total, alloc, active, req, stream int64, typ string, pool tuple, exp bool, blocks list) dict {
		return dict{{"device", dev}, {"address", addr}, {"total_size", total}, {"allocated_size", alloc},
			{"active_size", active}, {"requested_size", req}, {"stream", stream}, {"segment_type", typ},
			{"segment_pool_id", pool}, {"is_expandable", exp}, {"frames", list{}}, {"blocks", blocks}}
	}
	blk := func(addr, size, req int64, state string) dict {
		return dict{{"address", addr}, {"size", size}, {"requested_size", req}, {"state", state}, {"frames", list{}}}
	}
	ent := func(action, addrKey string, addr, size, stream, timeUs int64, pool tuple) dict {
		return dict{{"action", action}, {addrKey, addr}, {"size", size}, {"stream", stream}, {"time_us", timeUs}, {"pool_id", pool}}
	}
	p00, p17 := tuple{int64(0), int64(0)}, tuple{int64(1), int64(7)}
	b1 := int64(base + (1 << 30))
	want := dict{
		{"segments", list{
			seg(0, base, 20<<20, 0, 0, 0, 0, "large", p00, false, list{blk(base, 20<<20, 0, "inactive")}),
			seg(2, b1, 6144, 1024+2560, 1024+2048+2560, 1000+2000+2500, 7, "small", p17, true, list{
				blk(b1, 1024, 1000, "active_allocated"),
				blk(b1+1024, 2048, 2000, "active_pending_free"),
				blk(b1+3072, 512, 7, "inactive"),
				blk(b1+3584, 2560, 2500, "active_allocated"),
			}),
			seg(2, base+(2<<30), 512, 0, 0, 0, 0, "large", p00, false, list{blk(base+(2<<30), 512, 0, "inactive")}),
		}},
		{"device_traces", list{
			list{
				ent("oom", "device_free", 123456789, 30<<20, 0, exT0, p00),
				ent("segment_free", "addr", base+512, 0, 0, exT0+1, p00),
				ent("segment_free", "addr", base+512, 0, 0, exT0+1, p00),
			},
			list{},
			list{
				ent("snapshot", "addr", 0, 3584, 0, exT0+2, p17),
				ent("oom", "device_free", 0, 1<<30, 7, exT0+3, p17),
			},
		}},
		{"allocator_settings", dict{}},
	}
	if got := gopickleLoad(t, buf.Bytes()); !reflect.DeepEqual(got, want) {
		t.Errorf("gopickle read\n%#v\nwant\n%#v", got, want)
	}
	_, got := pyInspect(t, buf.Bytes())
	if !reflect.DeepEqual(got, want) {
		t.Errorf("python3 read\n%#v\nwant\n%#v", got, want)
	}
	script := pyStrictEq + pySnapshotChecks + `
got = load(sys.argv[1])
check_identity(got)
check_types(got)
ooms = [e for tr in got["device_traces"] for e in tr if e["action"] == "oom"]
if len(ooms) != 2 or any("addr" in e for e in ooms): raise SystemExit("oom entries %r" % ooms)
if [e["device_free"] for e in ooms] != [123456789, 0]: raise SystemExit("device_free %r" % ooms)
if len(got["device_traces"]) != 3 or got["device_traces"][1] != []: raise SystemExit("device_traces shape")
print("ok")
`
	if out := runPython(t, script, writeTemp(t, buf.Bytes())); string(out) != "ok\n" {
		t.Errorf("python3: %q", out)
	}
}

func TestWriteSnapshotEmpty(t *testing.T) {
	var buf bytes.Buffer
	snap := &allocmodel.Snapshot{Level: allocmodel.LevelSegment, Pools: []allocmodel.PoolID{{0, 0}}}
	if err := output.WriteSnapshot(&buf, snap, nil); err != nil {
		t.Fatal(err)
	}
	want := dict{{"segments", list{}}, {"device_traces", list{}}, {"allocator_settings", dict{}}}
	if got := gopickleLoad(t, buf.Bytes()); !reflect.DeepEqual(got, want) {
		t.Errorf("read %#v, want %#v", got, want)
	}
}

func TestWriteSnapshotErrors(t *testing.T) {
	tests := []struct {
		name     string
		snap     func(s *allocmodel.Snapshot)
		settings []output.Setting
		want     error
		wantText string
	}{
		{
			name:     "unsupported setting type",
			settings: []output.Setting{{Key: "x", Value: int32(1)}},
			wantText: "unsupported setting value int32",
		},
		{
			name:     "unsupported nested setting type",
			settings: []output.Setting{{Key: "x", Value: []output.Setting{{Key: "y", Value: []string{"a"}}}}},
			wantText: "unsupported setting value []string",
		},
		{
			name:     "setting out of range",
			settings: []output.Setting{{Key: "x", Value: uint64(1) << 60}},
			want:     output.ErrIntRange,
		},
		{
			name: "segment address beyond 2^53",
			snap: func(s *allocmodel.Snapshot) { s.Segments[0].Address = 1<<53 + 1 },
			want: output.ErrIntRange,
		},
		{
			name: "stream beyond 2^53",
			snap: func(s *allocmodel.Snapshot) { s.Traces[0][2].Stream = 0xffff_ffff_ffff_0000 },
			want: output.ErrIntRange,
		},
		{
			name: "block size beyond 2^53",
			snap: func(s *allocmodel.Snapshot) { s.Segments[0].Blocks[1].Size = 1 << 62 },
			want: output.ErrIntRange,
		},
		{
			name: "pool id beyond 2^53",
			snap: func(s *allocmodel.Snapshot) { s.Pools[0] = allocmodel.PoolID{0, -1 << 60} },
			want: output.ErrIntRange,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			snap := workedExample()
			if tt.snap != nil {
				tt.snap(snap)
			}
			var buf bytes.Buffer
			err := output.WriteSnapshot(&buf, snap, tt.settings)
			switch {
			case err == nil:
				t.Fatal("WriteSnapshot succeeded")
			case tt.want != nil && !errors.Is(err, tt.want):
				t.Errorf("err = %v, want %v", err, tt.want)
			case tt.wantText != "" && !strings.Contains(err.Error(), tt.wantText):
				t.Errorf("err = %v, want it to mention %q", err, tt.wantText)
			}
			if bytes.HasSuffix(buf.Bytes(), []byte{opStop}) {
				t.Errorf("a failed snapshot ends in STOP")
			}
		})
	}
	// The writer's error is returned too.
	err := output.WriteSnapshot(&failWriter{limit: 10}, workedExample(), nil)
	if !errors.Is(err, errDiskFull) {
		t.Errorf("failing writer: err = %v", err)
	}
}
