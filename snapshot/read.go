package snapshot

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"unicode/utf8"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"
)

// FormatError is a file that is not a readable memory snapshot: not a
// pickle, a truncated one, a protocol or opcode memory_viz cannot read, or
// a pickle that is not a snapshot dict. Error() is one line.
type FormatError struct {
	File string // as given; "" for a reader
	Msg  string
}

func (e *FormatError) Error() string {
	if e.File == "" {
		return e.Msg
	}
	return e.File + ": " + e.Msg
}

// Protocols memory_viz reads (§9.1): 2 (torch's C++ pickler), 3 and 4.
const (
	MinProtocol = 2
	MaxProtocol = 4
)

// ReadFile reads the snapshot in path.
func ReadFile(path string) (*Snapshot, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s, err := Decode(data)
	if err != nil {
		var fe *FormatError
		if errors.As(err, &fe) {
			fe.File = path
		}
		return nil, err
	}
	return s, nil
}

// Read reads a snapshot from r.
func Read(r io.Reader) (*Snapshot, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	return Decode(data)
}

// Decode decodes a snapshot pickle held in memory.
func Decode(data []byte) (*Snapshot, error) {
	proto, err := scan(data)
	if err != nil {
		return nil, err
	}
	raw, err := unpickle(data)
	if err != nil {
		return nil, err
	}
	var conv converter
	v, err := conv.value(raw, 0)
	if err != nil {
		return nil, &FormatError{Msg: "not a memory snapshot: " + err.Error()}
	}
	s, err := parseSnapshot(v)
	if err != nil {
		return nil, &FormatError{Msg: "not a memory snapshot: " + err.Error()}
	}
	s.Protocol = proto
	return s, nil
}

// ---------------------------------------------------------------- opcodes

// Opcodes memory_viz's unpickler understands (§9.1), with the length of
// their fixed argument; a negative length -n means an n-byte little-endian
// count followed by that many bytes.
var opcodes = map[byte]struct {
	name string
	arg  int
}{
	0x80: {"PROTO", 1},
	0x95: {"FRAME", 8},
	'(':  {"MARK", 0},
	'.':  {"STOP", 0},
	'}':  {"EMPTY_DICT", 0},
	'd':  {"DICT", 0},
	's':  {"SETITEM", 0},
	'u':  {"SETITEMS", 0},
	']':  {"EMPTY_LIST", 0},
	'l':  {"LIST", 0},
	'a':  {"APPEND", 0},
	'e':  {"APPENDS", 0},
	')':  {"EMPTY_TUPLE", 0},
	't':  {"TUPLE", 0},
	0x85: {"TUPLE1", 0},
	0x86: {"TUPLE2", 0},
	0x87: {"TUPLE3", 0},
	'N':  {"NONE", 0},
	0x88: {"NEWTRUE", 0},
	0x89: {"NEWFALSE", 0},
	'J':  {"BININT", 4},
	'K':  {"BININT1", 1},
	'M':  {"BININT2", 2},
	0x8a: {"LONG1", -1},
	'G':  {"BINFLOAT", 8},
	0x8c: {"SHORT_BINUNICODE", -1},
	'X':  {"BINUNICODE", -4},
	0x94: {"MEMOIZE", 0},
	'q':  {"BINPUT", 1},
	'r':  {"LONG_BINPUT", 4},
	'h':  {"BINGET", 1},
	'j':  {"LONG_BINGET", 4},
}

// Opcodes a pickle may hold that a snapshot never does, named for errors.
var foreignOpcodes = map[byte]string{
	'c': "GLOBAL", 0x93: "STACK_GLOBAL", 'R': "REDUCE", 'b': "BUILD", 0x81: "NEWOBJ",
	0x92: "NEWOBJ_EX", 'i': "INST", 'o': "OBJ", 'B': "BINBYTES", 'C': "SHORT_BINBYTES",
	0x8e: "BINBYTES8", 0x96: "BYTEARRAY8", 0x8b: "LONG4", 'I': "INT", 'L': "LONG",
	'S': "STRING", 'T': "BINSTRING", 'U': "SHORT_BINSTRING", 'V': "UNICODE",
	0x8d: "BINUNICODE8", 0x8f: "EMPTY_SET", 0x90: "ADDITEMS", 0x91: "FROZENSET",
	'0': "POP", '1': "POP_MARK", '2': "DUP", 'P': "PERSID", 'Q': "BINPERSID",
	0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 'F': "FLOAT", 'p': "PUT", 'g': "GET",
	0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}

// scan checks the opcode stream before anything is decoded: a PROTO
// header with a protocol memory_viz reads, only opcodes it understands,
// every argument inside the file, STOP at the very end. This keeps
// malformed input from reaching the decoder's allocations (a length field
// of a truncated or garbage file) and names the problem precisely.
func scan(data []byte) (int, error) {
	if len(data) == 0 {
		return 0, &FormatError{Msg: "empty file, not a memory snapshot"}
	}
	if data[0] != 0x80 {
		return 0, &FormatError{Msg: notPickle(data)}
	}
	if len(data) < 2 {
		return 0, &FormatError{Msg: "truncated pickle: the file ends inside its PROTO header"}
	}
	proto := int(data[1])
	if proto < MinProtocol || proto > MaxProtocol {
		return 0, &FormatError{Msg: fmt.Sprintf("pickle protocol %d: memory snapshots are pickle protocol %d to %d, the ones memory_viz reads (re-save it with pickle protocol=4)",
			proto, MinProtocol, MaxProtocol)}
	}
	pos := 2
	for pos < len(data) {
		op := data[pos]
		info, ok := opcodes[op]
		if !ok {
			if name, known := foreignOpcodes[op]; known {
				return 0, &FormatError{Msg: fmt.Sprintf("pickle opcode %s at byte %d: a memory snapshot holds only dicts, lists, tuples, strings and numbers (memory_viz cannot read this file)", name, pos)}
			}
			return 0, &FormatError{Msg: fmt.Sprintf("corrupt pickle: invalid opcode 0x%02x at byte %d", op, pos)}
		}
		start := pos
		pos++
		n := info.arg
		if n < 0 {
			width := -n
			if pos+width > len(data) {
				return 0, truncated(info.name, start, len(data))
			}
			var count uint64
			for i := width - 1; i >= 0; i-- {
				count = count<<8 | uint64(data[pos+i])
			}
			pos += width
			if count > uint64(len(data)-pos) {
				return 0, truncated(info.name, start, len(data))
			}
			n = int(count)
			if op == 0x8a && n == 0 {
				return 0, &FormatError{Msg: fmt.Sprintf("corrupt pickle: empty LONG1 at byte %d", start)}
			}
			if (op == 'X' || op == 0x8c) && !utf8.Valid(data[pos:pos+n]) {
				return 0, &FormatError{Msg: fmt.Sprintf("corrupt pickle: string at byte %d is not UTF-8", start)}
			}
		}
		if pos+n > len(data) {
			return 0, truncated(info.name, start, len(data))
		}
		if op == 0x95 {
			var frame uint64
			for i := 7; i >= 0; i-- {
				frame = frame<<8 | uint64(data[pos+i])
			}
			if frame > uint64(len(data)-pos-8) {
				return 0, truncated("FRAME", start, len(data))
			}
		}
		if op == 0x80 {
			return 0, &FormatError{Msg: fmt.Sprintf("corrupt pickle: a second PROTO at byte %d", start)}
		}
		pos += n
		if op == '.' {
			if pos != len(data) {
				return 0, &FormatError{Msg: fmt.Sprintf("corrupt pickle: %d bytes after its end (STOP at byte %d): a concatenated or damaged file", len(data)-pos, start)}
			}
			return proto, nil
		}
	}
	return 0, &FormatError{Msg: fmt.Sprintf("truncated pickle: the file ends after %d bytes without the STOP that ends a pickle", len(data))}
}

func truncated(op string, at, size int) error {
	return &FormatError{Msg: fmt.Sprintf("truncated pickle: the file ends (at %d bytes) inside the %s that starts at byte %d", size, op, at)}
}

// notPickle describes a file that does not start with a PROTO opcode.
func notPickle(data []byte) string {
	head := data[:min(len(data), 8)]
	trimmed := bytes.TrimLeft(data[:min(len(data), 64)], " \t\r\n")
	switch {
	case len(trimmed) > 0 && (trimmed[0] == '{' || trimmed[0] == '['):
		return "not a pickle: the file looks like JSON (memory snapshots are pickles)"
	case bytes.HasPrefix(data, []byte("PK\x03\x04")):
		return "not a pickle: the file is a zip archive (torch.save output?), not a memory snapshot pickle"
	case bytes.HasPrefix(data, []byte("<")):
		return "not a pickle: the file looks like HTML or XML, not a memory snapshot pickle"
	}
	if len(data) > 1 && (data[0] == '(' || data[0] == '}' || data[0] == ']') {
		return "pickle protocol 0 or 1 (no PROTO header): memory snapshots are pickle protocol 2 to 4"
	}
	return fmt.Sprintf("not a pickle (starts with bytes % x): a memory snapshot is a pickle starting with 0x80", head)
}

// unpickle decodes with gopickle, turning any error or panic into a
// FormatError: scan has vetted the opcodes, but not the stack discipline.
func unpickle(data []byte) (v any, err error) {
	defer func() {
		if r := recover(); r != nil {
			v, err = nil, &FormatError{Msg: fmt.Sprintf("corrupt pickle: %v", r)}
		}
	}()
	u := pickle.NewUnpickler(bytes.NewReader(data))
	u.FindClass = func(module, name string) (any, error) {
		return nil, fmt.Errorf("refusing to load class %s.%s", module, name)
	}
	v, err = u.Load()
	if err != nil {
		return nil, &FormatError{Msg: "corrupt pickle: " + err.Error()}
	}
	return v, nil
}

// ---------------------------------------------------------------- values

// maxExpanded bounds the values a file expands to when every memo
// back-reference is followed (shared lists can describe exponentially many;
// a real snapshot with a million entries and shared stacks has ~10^8).
const maxExpanded = 1 << 31

// maxDepth bounds nesting; a snapshot nests about six deep.
const maxDepth = 64

// converter turns gopickle's values into Values. An object the pickle
// shares (a memo back-reference) is converted once and shared in the
// result too; a cycle is an error.
type converter struct {
	done   map[any]converted
	active map[any]bool
}

type converted struct {
	v    Value
	size int64 // values in the subtree with shared parts counted each time
}

func (c *converter) value(v any, depth int) (Value, error) {
	out, _, err := c.convert(v, depth)
	return out, err
}

func (c *converter) convert(v any, depth int) (Value, int64, error) {
	if depth > maxDepth {
		return nil, 0, errors.New("values nested too deeply")
	}
	switch v := v.(type) {
	case nil, bool, float64, string:
		return v, 1, nil
	case int:
		return int64(v), 1, nil
	case *big.Int:
		return nil, 0, fmt.Errorf("integer %v does not fit in 64 bits", v)
	case *types.Dict, *types.List, *types.Tuple:
		if c.done == nil {
			c.done, c.active = make(map[any]converted), make(map[any]bool)
		}
		if r, ok := c.done[v]; ok {
			return r.v, r.size, nil
		}
		if c.active[v] {
			return nil, 0, errors.New("a container contains itself")
		}
		c.active[v] = true
		out, size, err := c.container(v, depth)
		delete(c.active, v)
		if err != nil {
			return nil, 0, err
		}
		if size > maxExpanded {
			return nil, 0, errors.New("shared references expand to more values than any real snapshot holds")
		}
		c.done[v] = converted{out, size}
		return out, size, nil
	}
	return nil, 0, fmt.Errorf("unexpected pickled value of type %T", v)
}

func (c *converter) container(v any, depth int) (Value, int64, error) {
	switch v := v.(type) {
	case *types.Dict:
		d := &Dict{Items: make([]Item, 0, len(*v))}
		size := int64(1)
		var index map[Value]int
		if len(*v) > 16 {
			index = make(map[Value]int, len(*v))
		}
		for _, e := range *v {
			k, ks, err := c.convert(e.Key, depth+1)
			if err != nil {
				return nil, 0, err
			}
			if !hashable(k) {
				return nil, 0, fmt.Errorf("dict key of type %s", typeName(k))
			}
			val, vs, err := c.convert(e.Value, depth+1)
			if err != nil {
				return nil, 0, err
			}
			size = min(size+ks+vs, maxExpanded+1)
			// A repeated key keeps its place and the last value wins, as in Python.
			at := -1
			if index != nil {
				if i, ok := index[k]; ok {
					at = i
				}
			} else {
				for i := range d.Items {
					if d.Items[i].Key == k {
						at = i
						break
					}
				}
			}
			if at >= 0 {
				d.Items[at].Value = val
				continue
			}
			if index != nil {
				index[k] = len(d.Items)
			}
			d.Items = append(d.Items, Item{Key: k, Value: val})
		}
		return d, size, nil
	case *types.List:
		return c.slice(*v, depth, false)
	case *types.Tuple:
		return c.slice(*v, depth, true)
	}
	return nil, 0, fmt.Errorf("unexpected pickled value of type %T", v)
}

func (c *converter) slice(items []any, depth int, tuple bool) (Value, int64, error) {
	out := make([]Value, len(items))
	size := int64(1)
	for i, it := range items {
		v, s, err := c.convert(it, depth+1)
		if err != nil {
			return nil, 0, err
		}
		out[i] = v
		size = min(size+s, maxExpanded+1)
	}
	if tuple {
		return Tuple(out), size, nil
	}
	return List(out), size, nil
}

func hashable(v Value) bool {
	switch v.(type) {
	case nil, bool, int64, float64, string:
		return true
	}
	return false
}

// typeName is the Python name of a value's type, for error messages.
func typeName(v Value) string {
	switch v.(type) {
	case nil:
		return "None"
	case bool:
		return "bool"
	case int64:
		return "int"
	case float64:
		return "float"
	case string:
		return "str"
	case List:
		return "list"
	case Tuple:
		return "tuple"
	case *Dict:
		return "dict"
	}
	return fmt.Sprintf("%T", v)
}

// ---------------------------------------------------------------- schema

// fields reads a dict with string keys: known keys are handed to the
// matching parse function, others are kept in order in extra.
type fields struct {
	ctx   *parseCtx
	path  string
	dict  *Dict
	extra []Item
	seen  map[string]Value
}

// parseCtx shares what is parsed once: a frames list the pickle shares
// (torch shares one per stack) becomes one []Frame.
type parseCtx struct {
	frames map[*Value][]Frame
}

func (c *parseCtx) newFields(path string, v Value) (*fields, error) {
	d, ok := v.(*Dict)
	if !ok {
		return nil, fmt.Errorf("%s is a %s, want a dict", path, typeName(v))
	}
	f := &fields{ctx: c, path: path, dict: d, seen: make(map[string]Value, len(d.Items))}
	for _, it := range d.Items {
		k, ok := it.Key.(string)
		if !ok {
			return nil, fmt.Errorf("%s has a key of type %s, want str", path, typeName(it.Key))
		}
		f.seen[k] = it.Value
	}
	return f, nil
}

// keep records the keys not in known as extra, in file order.
func (f *fields) keep(known ...string) {
	for _, it := range f.dict.Items {
		k := it.Key.(string)
		isKnown := false
		for _, kk := range known {
			if k == kk {
				isKnown = true
				break
			}
		}
		if !isKnown {
			f.extra = append(f.extra, it)
		}
	}
}

func (f *fields) missing(key string) error {
	return fmt.Errorf("%s has no %q key", f.path, key)
}

func (f *fields) wrong(key, want string, v Value) error {
	return fmt.Errorf("%s[%q] is a %s, want %s", f.path, key, typeName(v), want)
}

func (f *fields) int(key string, required bool) (Opt[int64], error) {
	v, ok := f.seen[key]
	if !ok {
		if required {
			return Opt[int64]{}, f.missing(key)
		}
		return Opt[int64]{}, nil
	}
	n, ok := v.(int64)
	if !ok {
		return Opt[int64]{}, f.wrong(key, "an int", v)
	}
	return Some(n), nil
}

func (f *fields) str(key string, required bool) (Opt[string], error) {
	v, ok := f.seen[key]
	if !ok {
		if required {
			return Opt[string]{}, f.missing(key)
		}
		return Opt[string]{}, nil
	}
	s, ok := v.(string)
	if !ok {
		return Opt[string]{}, f.wrong(key, "a str", v)
	}
	return Some(s), nil
}

func (f *fields) bool(key string) (Opt[bool], error) {
	v, ok := f.seen[key]
	if !ok {
		return Opt[bool]{}, nil
	}
	b, ok := v.(bool)
	if !ok {
		return Opt[bool]{}, f.wrong(key, "a bool", v)
	}
	return Some(b), nil
}

func (f *fields) pair(key string) (Opt[[2]int64], error) {
	v, ok := f.seen[key]
	if !ok {
		return Opt[[2]int64]{}, nil
	}
	var items []Value
	switch t := v.(type) {
	case Tuple:
		items = t
	case List: // JSON round trips turn tuples into lists
		items = t
	}
	if len(items) != 2 {
		return Opt[[2]int64]{}, f.wrong(key, "a pair of ints", v)
	}
	a, ok1 := items[0].(int64)
	b, ok2 := items[1].(int64)
	if !ok1 || !ok2 {
		return Opt[[2]int64]{}, f.wrong(key, "a pair of ints", v)
	}
	return Some([2]int64{a, b}), nil
}

func (f *fields) list(key string, required bool) (List, bool, error) {
	v, ok := f.seen[key]
	if !ok {
		if required {
			return nil, false, f.missing(key)
		}
		return nil, false, nil
	}
	l, ok := v.(List)
	if !ok {
		return nil, false, f.wrong(key, "a list", v)
	}
	return l, true, nil
}

func (f *fields) frames(key string) (Opt[[]Frame], error) {
	l, ok, err := f.list(key, false)
	if err != nil || !ok {
		return Opt[[]Frame]{}, err
	}
	if len(l) == 0 {
		return Some([]Frame{}), nil
	}
	if cached, ok := f.ctx.frames[&l[0]]; ok && len(cached) == len(l) {
		return Some(cached), nil
	}
	out := make([]Frame, len(l))
	for i, v := range l {
		ff, err := f.ctx.newFields(fmt.Sprintf("%s[%q][%d]", f.path, key, i), v)
		if err != nil {
			return Opt[[]Frame]{}, err
		}
		name, err := ff.str("name", true)
		if err != nil {
			return Opt[[]Frame]{}, err
		}
		file, err := ff.str("filename", true)
		if err != nil {
			return Opt[[]Frame]{}, err
		}
		line, err := ff.int("line", false)
		if err != nil {
			return Opt[[]Frame]{}, err
		}
		ff.keep("filename", "name", "line")
		out[i] = Frame{Filename: file.V, Name: name.V, Line: line, Extra: ff.extra}
	}
	f.ctx.frames[&l[0]] = out
	return Some(out), nil
}

// maxDevice bounds device ordinals (torch has at most a few hundred).
const maxDevice = 1 << 16

func parseSnapshot(v Value) (*Snapshot, error) {
	if _, ok := v.(List); ok {
		return nil, errors.New("the pickle is a list, the pre-2.0 torch format (a dict with segments and device_traces is needed)")
	}
	ctx := &parseCtx{frames: make(map[*Value][]Frame)}
	top, err := ctx.newFields("the top level", v)
	if err != nil {
		return nil, fmt.Errorf("the pickle holds a %s, not a snapshot dict", typeName(v))
	}
	s := &Snapshot{}
	segs, _, err := top.list("segments", true)
	if err != nil {
		return nil, err
	}
	traces, _, err := top.list("device_traces", true)
	if err != nil {
		return nil, err
	}
	if st, ok := top.seen["allocator_settings"]; ok {
		d, ok := st.(*Dict)
		if !ok {
			return nil, top.wrong("allocator_settings", "a dict", st)
		}
		s.AllocatorSettings = d
	}
	if ea, ok, err := top.list("external_annotations", false); err != nil {
		return nil, err
	} else if ok {
		s.ExternalAnnotations = Some(ea)
	}
	top.keep("segments", "device_traces", "allocator_settings", "external_annotations")
	s.Extra = top.extra

	s.Segments = make([]Segment, len(segs))
	for i, sv := range segs {
		if err := ctx.parseSegment(fmt.Sprintf("segments[%d]", i), sv, &s.Segments[i]); err != nil {
			return nil, err
		}
	}
	s.DeviceTraces = make([][]TraceEntry, len(traces))
	if len(traces) > maxDevice {
		return nil, fmt.Errorf("device_traces has %d devices", len(traces))
	}
	for d, tv := range traces {
		tl, ok := tv.(List)
		if !ok {
			return nil, fmt.Errorf("device_traces[%d] is a %s, want a list", d, typeName(tv))
		}
		s.DeviceTraces[d] = make([]TraceEntry, len(tl))
		for k, ev := range tl {
			if err := ctx.parseEntry(fmt.Sprintf("device_traces[%d][%d]", d, k), ev, &s.DeviceTraces[d][k]); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

func (ctx *parseCtx) parseSegment(path string, v Value, s *Segment) error {
	f, err := ctx.newFields(path, v)
	if err != nil {
		return err
	}
	dev, err := f.int("device", true)
	if err != nil {
		return err
	}
	if dev.V < 0 || dev.V >= maxDevice {
		return fmt.Errorf("%s has device %d", path, dev.V)
	}
	s.Device = int(dev.V)
	var addr, total Opt[int64]
	if addr, err = f.int("address", true); err != nil {
		return err
	}
	if total, err = f.int("total_size", true); err != nil {
		return err
	}
	s.Address, s.TotalSize = addr.V, total.V
	if s.AllocatedSize, err = f.int("allocated_size", false); err != nil {
		return err
	}
	if s.ActiveSize, err = f.int("active_size", false); err != nil {
		return err
	}
	if s.RequestedSize, err = f.int("requested_size", false); err != nil {
		return err
	}
	if s.Stream, err = f.int("stream", false); err != nil {
		return err
	}
	if s.SegmentType, err = f.str("segment_type", false); err != nil {
		return err
	}
	if s.SegmentPoolID, err = f.pair("segment_pool_id"); err != nil {
		return err
	}
	if s.IsExpandable, err = f.bool("is_expandable"); err != nil {
		return err
	}
	if s.Frames, err = f.frames("frames"); err != nil {
		return err
	}
	blocks, _, err := f.list("blocks", true)
	if err != nil {
		return err
	}
	s.Blocks = make([]Block, len(blocks))
	for i, bv := range blocks {
		bf, err := ctx.newFields(fmt.Sprintf("%s.blocks[%d]", path, i), bv)
		if err != nil {
			return err
		}
		b := &s.Blocks[i]
		if b.Address, err = bf.int("address", false); err != nil {
			return err
		}
		size, err := bf.int("size", true)
		if err != nil {
			return err
		}
		b.Size = size.V
		if b.RequestedSize, err = bf.int("requested_size", false); err != nil {
			return err
		}
		state, err := bf.str("state", true)
		if err != nil {
			return err
		}
		b.State = state.V
		if b.Frames, err = bf.frames("frames"); err != nil {
			return err
		}
		bf.keep("address", "size", "requested_size", "state", "frames")
		b.Extra = bf.extra
	}
	f.keep("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
		"stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks")
	s.Extra = f.extra
	return nil
}

func (ctx *parseCtx) parseEntry(path string, v Value, e *TraceEntry) error {
	f, err := ctx.newFields(path, v)
	if err != nil {
		return err
	}
	action, err := f.str("action", true)
	if err != nil {
		return err
	}
	e.Action = action.V
	if e.Addr, err = f.int("addr", false); err != nil {
		return err
	}
	if e.DeviceFree, err = f.int("device_free", false); err != nil {
		return err
	}
	if !e.Addr.Set && !e.DeviceFree.Set {
		if e.Action == ActionOOM {
			return f.missing("device_free")
		}
		return f.missing("addr")
	}
	size, err := f.int("size", true)
	if err != nil {
		return err
	}
	e.Size = size.V
	if e.Stream, err = f.int("stream", false); err != nil {
		return err
	}
	if e.TimeUs, err = f.int("time_us", false); err != nil {
		return err
	}
	if e.Frames, err = f.frames("frames"); err != nil {
		return err
	}
	if e.PoolID, err = f.pair("pool_id"); err != nil {
		return err
	}
	f.keep("action", "addr", "device_free", "size", "stream", "time_us", "frames", "pool_id")
	e.Extra = f.extra
	return nil
}
