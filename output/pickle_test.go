package output_test

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"

	"github.com/npuprobe/npuprobe/output"
)

// Pickle opcodes (pickletools names in comments).
const (
	opMark            = '(' // MARK
	opStop            = '.' // STOP
	opBinInt          = 'J' // BININT
	opBinInt1         = 'K' // BININT1
	opBinInt2         = 'M' // BININT2
	opNone            = 'N' // NONE
	opBinUnicode      = 'X' // BINUNICODE
	opAppend          = 'a' // APPEND
	opAppends         = 'e' // APPENDS
	opBinGet          = 'h' // BINGET
	opLongBinGet      = 'j' // LONG_BINGET
	opEmptyList       = ']' // EMPTY_LIST
	opSetItem         = 's' // SETITEM
	opSetItems        = 'u' // SETITEMS
	opEmptyDict       = '}' // EMPTY_DICT
	opEmptyTuple      = ')' // EMPTY_TUPLE
	opTuple           = 't' // TUPLE
	opBinFloat        = 'G' // BINFLOAT
	opProto           = 0x80
	opTuple1          = 0x85
	opTuple2          = 0x86
	opTuple3          = 0x87
	opNewTrue         = 0x88
	opNewFalse        = 0x89
	opLong1           = 0x8a
	opShortBinUnicode = 0x8c
	opMemoize         = 0x94
	opFrame           = 0x95

	// frameTarget is the frame size at which CPython (and the encoder)
	// closes a frame.
	frameTarget = 64 << 10
)

var update = flag.Bool("update", false, "rewrite testdata/golden_small.pickle")

// ---- A tiny value model for tests -----------------------------------------

// dict is an ordered dict with string keys; list is a list; pair is what
// IntPair writes (a 2-tuple of ints); tuple is a decoded tuple.
type (
	dict []kv
	kv   struct {
		K string
		V any
	}
	list  []any
	pair  [2]int64
	tuple []any
	// fbits is a float64 compared bit for bit (every NaN is one value).
	fbits uint64
)

// encode writes v with the encoder's API.
func encode(e *output.Encoder, v any) {
	switch v := v.(type) {
	case nil:
		e.None()
	case bool:
		e.Bool(v)
	case int:
		e.Int(int64(v))
	case int64:
		e.Int(v)
	case uint64:
		e.Uint(v)
	case float64:
		e.Float(v)
	case string:
		e.String(v)
	case pair:
		e.IntPair(v[0], v[1])
	case list:
		e.BeginList(len(v))
		for _, x := range v {
			e.Elem()
			encode(e, x)
		}
		e.EndList()
	case dict:
		e.BeginDict(len(v))
		for _, x := range v {
			e.Key(x.K)
			encode(e, x.V)
		}
		e.EndDict()
	default:
		panic(fmt.Sprintf("encode: unsupported %T", v))
	}
}

func pickleOf(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := output.NewEncoder(&buf)
	encode(e, v)
	if err := e.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if e.Err() != nil {
		t.Fatalf("Err() = %v after a successful Close", e.Err())
	}
	return buf.Bytes()
}

func floatKey(f float64) fbits {
	if math.IsNaN(f) {
		return fbits(0x7ff8000000000000)
	}
	return fbits(math.Float64bits(f))
}

// canon turns an expected value into what a decoder must produce.
func canon(v any) any {
	switch v := v.(type) {
	case int:
		return int64(v)
	case uint64:
		return int64(v)
	case float64:
		return floatKey(v)
	case pair:
		return tuple{v[0], v[1]}
	case list:
		out := list{}
		for _, x := range v {
			out = append(out, canon(x))
		}
		return out
	case dict:
		out := dict{}
		for _, x := range v {
			out = append(out, kv{x.K, canon(x.V)})
		}
		return out
	}
	return v
}

// fromGopickle converts gopickle's output to the canonical form.
func fromGopickle(v any) (any, error) {
	switch v := v.(type) {
	case nil, bool, string:
		return v, nil
	case int:
		return int64(v), nil
	case *big.Int:
		return nil, fmt.Errorf("integer %v does not fit int64", v)
	case float64:
		return floatKey(v), nil
	case *types.List:
		out := list{}
		for _, x := range *v {
			c, err := fromGopickle(x)
			if err != nil {
				return nil, err
			}
			out = append(out, c)
		}
		return out, nil
	case *types.Tuple:
		out := tuple{}
		for _, x := range *v {
			c, err := fromGopickle(x)
			if err != nil {
				return nil, err
			}
			out = append(out, c)
		}
		return out, nil
	case *types.Dict:
		out := dict{}
		seen := map[string]bool{}
		for _, x := range *v {
			k, ok := x.Key.(string)
			if !ok {
				return nil, fmt.Errorf("dict key %#v is not a str", x.Key)
			}
			if seen[k] {
				return nil, fmt.Errorf("dict key %q set twice", k)
			}
			seen[k] = true
			c, err := fromGopickle(x.Value)
			if err != nil {
				return nil, err
			}
			out = append(out, kv{k, c})
		}
		return out, nil
	}
	return nil, fmt.Errorf("unexpected decoded type %T", v)
}

func gopickleLoad(t testing.TB, data []byte) any {
	t.Helper()
	v, err := pickle.Loads(string(data))
	if err != nil {
		t.Fatalf("gopickle: %v", err)
	}
	c, err := fromGopickle(v)
	if err != nil {
		t.Fatalf("gopickle result: %v", err)
	}
	return c
}

// ---- A Go walker over the opcodes the encoder may write --------------------

type op struct {
	code byte
	pos  int    // offset of the opcode byte
	arg  []byte // argument bytes (string payloads included)
}

// fixed argument lengths of the whitelisted opcodes; -1: length-prefixed.
var argLen = map[byte]int{
	opMark: 0, opStop: 0, opBinInt: 4, opBinInt1: 1, opBinInt2: 2, opNone: 0,
	opBinUnicode: -1, opAppend: 0, opAppends: 0, opBinGet: 1, opLongBinGet: 4,
	opEmptyList: 0, opSetItem: 0, opSetItems: 0, opEmptyDict: 0, opEmptyTuple: 0,
	opTuple: 0, opBinFloat: 8, opProto: 1, opTuple1: 0, opTuple2: 0, opTuple3: 0,
	opNewTrue: 0, opNewFalse: 0, opLong1: -1, opShortBinUnicode: -1, opMemoize: 0,
	opFrame: 8,
}

// walk splits data into opcodes, checking that every opcode is one the
// encoder may write, that frames are well formed (declared length exact,
// never straddled by an opcode, never nested) and that data ends at STOP.
func walk(data []byte) ([]op, error) {
	var ops []op
	frameEnd := -1
	for i := 0; i < len(data); {
		if frameEnd == i {
			frameEnd = -1
		}
		code := data[i]
		n, ok := argLen[code]
		if !ok {
			return ops, fmt.Errorf("offset %d: opcode %#x not allowed", i, code)
		}
		start := i + 1
		switch code {
		case opShortBinUnicode, opLong1:
			if start >= len(data) {
				return ops, fmt.Errorf("offset %d: truncated", i)
			}
			n = 1 + int(data[start])
		case opBinUnicode:
			if start+4 > len(data) {
				return ops, fmt.Errorf("offset %d: truncated", i)
			}
			n = 4 + int(binary.LittleEndian.Uint32(data[start:]))
		}
		end := start + n
		if end > len(data) {
			return ops, fmt.Errorf("offset %d: opcode %#x runs past the end", i, code)
		}
		if frameEnd >= 0 && end > frameEnd {
			return ops, fmt.Errorf("offset %d: opcode %#x straddles the frame ending at %d", i, code, frameEnd)
		}
		o := op{code: code, pos: i, arg: data[start:end]}
		ops = append(ops, o)
		if code == opFrame {
			if frameEnd >= 0 {
				return ops, fmt.Errorf("offset %d: frame inside a frame", i)
			}
			frameEnd = end + int(binary.LittleEndian.Uint64(o.arg))
			if frameEnd > len(data) {
				return ops, fmt.Errorf("offset %d: frame runs past the end", i)
			}
		}
		i = end
		if code == opStop {
			if i != len(data) {
				return ops, fmt.Errorf("offset %d: %d bytes after STOP", i, len(data)-i)
			}
			if frameEnd >= 0 && frameEnd != i {
				return ops, fmt.Errorf("STOP before the end of the frame")
			}
			return ops, nil
		}
	}
	return ops, errors.New("no STOP")
}

func mustWalk(t testing.TB, data []byte) []op {
	t.Helper()
	ops, err := walk(data)
	if err != nil {
		t.Fatalf("walk: %v", err)
	}
	if len(ops) < 2 || ops[0].code != opProto || ops[0].arg[0] != 4 || ops[0].pos != 0 {
		t.Fatalf("pickle does not start with PROTO 4: % x", data[:min(len(data), 16)])
	}
	return ops
}

func countOps(ops []op) map[byte]int {
	n := map[byte]int{}
	for _, o := range ops {
		n[o.code]++
	}
	return n
}

// ---- python3 ---------------------------------------------------------------

// pyHelper loads a pickle with CPython's C unpickler and its pure-Python
// unpickler (strict about frames), disassembles it with pickletools (which
// checks stack and memo use) and prints JSON: the opcode names, the PROTO
// argument, the frame sizes and the value in a tagged form.
const pyHelper = `
import io, json, math, pickle, pickletools, sys

def conv(v):
    t = type(v)
    if v is None: return {"none": True}
    if t is bool: return {"bool": v}
    if t is int: return {"int": str(v)}
    if t is float: return {"float": v.hex()}
    if t is str: return {"str": v}
    if t is list: return {"list": [conv(x) for x in v]}
    if t is tuple: return {"tuple": [conv(x) for x in v]}
    if t is dict: return {"dict": [[conv(k), conv(x)] for k, x in v.items()]}
    raise TypeError("unexpected type %r" % t)

data = open(sys.argv[1], "rb").read()
ops, proto, frames = [], None, []
for o, arg, pos in pickletools.genops(data):
    ops.append(o.name)
    if o.name == "PROTO": proto = arg
    if o.name == "FRAME": frames.append(arg)
pickletools.dis(data, io.StringIO())
c = conv(pickle.loads(data))
py = conv(pickle._loads(data))
if c != py:
    raise SystemExit("C and pure-Python unpicklers disagree")
json.dump({"ops": ops, "proto": proto, "frames": frames, "value": c}, sys.stdout)
`

// strictEq is Python source for a type-exact comparison (True == 1 and
// (0, 0) == [0, 0] do not count as equal); dict key order is not compared.
const pyStrictEq = `
import math
def strict_eq(a, b, path="value"):
    if type(a) is not type(b):
        return "%s: type %s, want %s (%r vs %r)" % (path, type(a).__name__, type(b).__name__, a, b)
    if type(a) is dict:
        if set(a) != set(b):
            return "%s: keys %s, want %s" % (path, sorted(a), sorted(b))
        for k in b:
            r = strict_eq(a[k], b[k], "%s[%r]" % (path, k))
            if r: return r
        return None
    if type(a) in (list, tuple):
        if len(a) != len(b):
            return "%s: length %d, want %d" % (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            r = strict_eq(x, y, "%s[%d]" % (path, i))
            if r: return r
        return None
    if type(a) is float and math.isnan(a) and math.isnan(b):
        return None
    if a != b:
        return "%s: %r, want %r" % (path, a, b)
    return None
`

func python(t testing.TB) string {
	t.Helper()
	p, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is needed to check pickles against CPython: %v", err)
	}
	return p
}

// runPython runs script with args and returns its stdout.
func runPython(t testing.TB, script string, args ...string) []byte {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "helper.py")
	if err := os.WriteFile(path, []byte(script), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python(t), append([]string{path}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python3: %v\n%s", err, stderr.String())
	}
	return out
}

type pyResult struct {
	Ops    []string        `json:"ops"`
	Proto  int             `json:"proto"`
	Frames []int           `json:"frames"`
	Value  json.RawMessage `json:"value"`
}

func writeTemp(t testing.TB, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "x.pickle")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func pyInspect(t testing.TB, data []byte) (pyResult, any) {
	t.Helper()
	out := runPython(t, pyHelper, writeTemp(t, data))
	var r pyResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("python output: %v", err)
	}
	var raw any
	if err := json.Unmarshal(r.Value, &raw); err != nil {
		t.Fatal(err)
	}
	v, err := fromPyJSON(raw)
	if err != nil {
		t.Fatalf("python value: %v", err)
	}
	return r, v
}

func fromPyJSON(v any) (any, error) {
	m, ok := v.(map[string]any)
	if !ok || len(m) != 1 {
		return nil, fmt.Errorf("bad tagged value %v", v)
	}
	for tag, x := range m {
		switch tag {
		case "none":
			return nil, nil
		case "bool":
			return x.(bool), nil
		case "int":
			return strconv.ParseInt(x.(string), 10, 64)
		case "float":
			f, err := strconv.ParseFloat(x.(string), 64)
			if err != nil {
				return nil, err
			}
			return floatKey(f), nil
		case "str":
			return x.(string), nil
		case "list", "tuple":
			var out []any
			for _, y := range x.([]any) {
				c, err := fromPyJSON(y)
				if err != nil {
					return nil, err
				}
				out = append(out, c)
			}
			if tag == "tuple" {
				return append(tuple{}, out...), nil
			}
			return append(list{}, out...), nil
		case "dict":
			out := dict{}
			for _, y := range x.([]any) {
				p := y.([]any)
				k, err := fromPyJSON(p[0])
				if err != nil {
					return nil, err
				}
				ks, ok := k.(string)
				if !ok {
					return nil, fmt.Errorf("dict key %v is not a str", k)
				}
				c, err := fromPyJSON(p[1])
				if err != nil {
					return nil, err
				}
				out = append(out, kv{ks, c})
			}
			return out, nil
		}
	}
	return nil, fmt.Errorf("bad tag in %v", v)
}

// ---- Exact encodings ---------------------------------------------------------

// framed returns the complete pickle the encoder writes for one top-level
// value whose opcodes are body: PROTO 4, then body+STOP, in a FRAME when it
// is at least 4 bytes long (as CPython does).
func framed(body ...byte) []byte {
	out := []byte{opProto, 4}
	if len(body) >= frameTarget {
		// The frame is committed after the opcode that filled it; STOP
		// follows bare, being shorter than a frame header is worth.
		out = append(out, opFrame)
		out = binary.LittleEndian.AppendUint64(out, uint64(len(body)))
		return append(append(out, body...), opStop)
	}
	payload := append(append([]byte{}, body...), opStop)
	if len(payload) >= 4 {
		out = append(out, opFrame)
		out = binary.LittleEndian.AppendUint64(out, uint64(len(payload)))
	}
	return append(out, payload...)
}

func TestIntEncoding(t *testing.T) {
	tests := []struct {
		v    int64
		body []byte
	}{
		{0, []byte{'K', 0x00}},
		{1, []byte{'K', 0x01}},
		{255, []byte{'K', 0xff}},
		{256, []byte{'M', 0x00, 0x01}},
		{65535, []byte{'M', 0xff, 0xff}},
		{65536, []byte{'J', 0x00, 0x00, 0x01, 0x00}},
		{1<<31 - 1, []byte{'J', 0xff, 0xff, 0xff, 0x7f}},
		{1 << 31, []byte{0x8a, 5, 0x00, 0x00, 0x00, 0x80, 0x00}},
		{1<<32 - 1, []byte{0x8a, 5, 0xff, 0xff, 0xff, 0xff, 0x00}},
		{1 << 32, []byte{0x8a, 5, 0x00, 0x00, 0x00, 0x00, 0x01}},
		{1<<39 - 1, []byte{0x8a, 5, 0xff, 0xff, 0xff, 0xff, 0x7f}},
		{1 << 39, []byte{0x8a, 6, 0x00, 0x00, 0x00, 0x00, 0x80, 0x00}},
		{0x12C040000000, []byte{0x8a, 6, 0x00, 0x00, 0x00, 0x40, 0xc0, 0x12}},
		{1<<53 - 1, []byte{0x8a, 7, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f}},
		{1 << 53, []byte{0x8a, 7, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x20}},
		{-1, []byte{'J', 0xff, 0xff, 0xff, 0xff}},
		{-256, []byte{'J', 0x00, 0xff, 0xff, 0xff}},
		{-1 << 31, []byte{'J', 0x00, 0x00, 0x00, 0x80}},
		{-1<<31 - 1, []byte{0x8a, 5, 0xff, 0xff, 0xff, 0x7f, 0xff}},
		{-1 << 39, []byte{0x8a, 5, 0x00, 0x00, 0x00, 0x00, 0x80}},
		{-1<<39 - 1, []byte{0x8a, 6, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff}},
		{-1 << 53, []byte{0x8a, 7, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0}},
		{-1<<53 + 1, []byte{0x8a, 7, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0}},
	}
	var all list
	for _, tt := range tests {
		t.Run(strconv.FormatInt(tt.v, 10), func(t *testing.T) {
			got := pickleOf(t, tt.v)
			if want := framed(tt.body...); !bytes.Equal(got, want) {
				t.Errorf("Int(%d) =\n% x\nwant\n% x", tt.v, got, want)
			}
			if tt.v >= 0 {
				if got := pickleOf(t, uint64(tt.v)); !bytes.Equal(got, framed(tt.body...)) {
					t.Errorf("Uint(%d) = % x, want the same as Int", tt.v, got)
				}
			}
			if got := gopickleLoad(t, got); got != tt.v {
				t.Errorf("gopickle read %v, want %d", got, tt.v)
			}
		})
		all = append(all, tt.v)
	}
	// CPython reads every one of them back exactly.
	data := pickleOf(t, all)
	if _, got := pyInspect(t, data); !reflect.DeepEqual(got, canon(all)) {
		t.Errorf("python3 read %v, want %v", got, all)
	}
}

func TestIntRange(t *testing.T) {
	tests := []struct {
		name string
		put  func(e *output.Encoder)
	}{
		{"Int(2^53+1)", func(e *output.Encoder) { e.Int(1<<53 + 1) }},
		{"Int(-2^53-1)", func(e *output.Encoder) { e.Int(-1<<53 - 1) }},
		{"Int(MaxInt64)", func(e *output.Encoder) { e.Int(math.MaxInt64) }},
		{"Int(MinInt64)", func(e *output.Encoder) { e.Int(math.MinInt64) }},
		{"Uint(2^53+1)", func(e *output.Encoder) { e.Uint(1<<53 + 1) }},
		{"Uint(2^63)", func(e *output.Encoder) { e.Uint(1 << 63) }},
		{"Uint(MaxUint64)", func(e *output.Encoder) { e.Uint(math.MaxUint64) }},
		{"IntPair(0, 2^53+1)", func(e *output.Encoder) { e.IntPair(0, 1<<53+1) }},
		{"IntPair(-2^53-1, 0)", func(e *output.Encoder) { e.IntPair(-1<<53-1, 0) }},
		{"in a list", func(e *output.Encoder) {
			e.BeginList(2)
			e.Elem()
			e.Int(1)
			e.Elem()
			e.Uint(math.MaxUint64)
			e.EndList()
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			e := output.NewEncoder(&buf)
			tt.put(e)
			if !errors.Is(e.Err(), output.ErrIntRange) {
				t.Errorf("Err() = %v, want output.ErrIntRange", e.Err())
			}
			err := e.Close()
			if !errors.Is(err, output.ErrIntRange) {
				t.Errorf("Close() = %v, want output.ErrIntRange", err)
			}
			// Nothing loadable is written: only PROTO, no STOP.
			if got := buf.Bytes(); !bytes.Equal(got, []byte{opProto, 4}) {
				t.Errorf("wrote % x after the error, want only PROTO", got)
			}
		})
	}
}

func TestStringEncoding(t *testing.T) {
	tests := []struct {
		name  string
		s     string
		short bool
	}{
		{"empty", "", true},
		{"ascii", "segment_alloc", true},
		{"nul byte", "a\x00b", true},
		{"255 bytes", strings.Repeat("x", 255), true},
		{"256 bytes", strings.Repeat("x", 256), false},
		{"unicode", "héllo wörld ✓ 😀 中文", true},
		{"255 bytes in 85 runes", strings.Repeat("€", 85), true},
		{"260 bytes in 130 runes", strings.Repeat("é", 130), false},
		{"long", strings.Repeat("frame ", 20000), false},
	}
	var all list
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := pickleOf(t, tt.s)
			var body []byte
			if tt.short {
				body = append([]byte{opShortBinUnicode, byte(len(tt.s))}, tt.s...)
			} else {
				body = binary.LittleEndian.AppendUint32([]byte{opBinUnicode}, uint32(len(tt.s)))
				body = append(body, tt.s...)
			}
			body = append(body, opMemoize)
			if want := framed(body...); !bytes.Equal(got, want) {
				t.Errorf("String(%.20q…) = % x…, want % x…", tt.s, got[:min(len(got), 24)], want[:min(len(want), 24)])
			}
			if v := gopickleLoad(t, got); v != tt.s {
				t.Errorf("gopickle read %.40q, want %.40q", v, tt.s)
			}
		})
		all = append(all, tt.s)
	}
	data := pickleOf(t, all)
	if _, got := pyInspect(t, data); !reflect.DeepEqual(got, canon(all)) {
		t.Errorf("python3 read a different list of strings")
	}
}

// TestInvalidUTF8: strings from /proc or the environment may be any bytes;
// CPython refuses a pickle str that is not UTF-8, so the encoder writes
// U+FFFD in place of each invalid sequence.
func TestInvalidUTF8(t *testing.T) {
	tests := []struct{ in, want string }{
		{"a\xffb", "a\uFFFDb"},
		{"\xff\xfe", "\uFFFD"},
		{"py\xe4thon", "py\uFFFDthon"}, // Latin-1 ä
		{"\xed\xa0\x80", "\uFFFD"},     // a UTF-16 surrogate in CESU-8
		{"ok ✓", "ok ✓"},
		{strings.Repeat("\xff", 300), "\uFFFD"},
	}
	for _, tt := range tests {
		data := pickleOf(t, tt.in)
		if got := gopickleLoad(t, data); got != tt.want {
			t.Errorf("String(%q): gopickle read %q, want %q", tt.in, got, tt.want)
		}
	}
	// As keys and values, through CPython.
	v := dict{{"name\xff", "comm\xc3"}, {"ok", list{"\xff", "\xff"}}}
	want := dict{{"name\uFFFD", "comm\uFFFD"}, {"ok", list{"\uFFFD", "\uFFFD"}}}
	if _, got := pyInspect(t, pickleOf(t, v)); !reflect.DeepEqual(got, want) {
		t.Errorf("python3 read %#v, want %#v", got, want)
	}
}

func TestScalarEncoding(t *testing.T) {
	tests := []struct {
		name string
		v    any
		body []byte
	}{
		{"true", true, []byte{opNewTrue}},
		{"false", false, []byte{opNewFalse}},
		{"none", nil, []byte{opNone}},
		{"1.5", 1.5, []byte{'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}},
		{"-0.0", math.Copysign(0, -1), []byte{'G', 0x80, 0, 0, 0, 0, 0, 0, 0}},
		{"+inf", math.Inf(1), []byte{'G', 0x7f, 0xf0, 0, 0, 0, 0, 0, 0}},
		{"-inf", math.Inf(-1), []byte{'G', 0xff, 0xf0, 0, 0, 0, 0, 0, 0}},
		{"nan", math.NaN(), []byte{'G', 0x7f, 0xf8, 0, 0, 0, 0, 0, 0x01}},
		{"max", math.MaxFloat64, []byte{'G', 0x7f, 0xef, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
		{"smallest subnormal", math.SmallestNonzeroFloat64, []byte{'G', 0, 0, 0, 0, 0, 0, 0, 0x01}},
		{"0.1", 0.1, []byte{'G', 0x3f, 0xb9, 0x99, 0x99, 0x99, 0x99, 0x99, 0x9a}},
		{"empty list", list{}, []byte{opEmptyList}},
		{"empty dict", dict{}, []byte{opEmptyDict}},
		{"pair", pair{0, 0}, []byte{'K', 0, 'K', 0, opTuple2, opMemoize}},
		{"pair of large", pair{-1, 1 << 40}, []byte{'J', 0xff, 0xff, 0xff, 0xff, 0x8a, 6, 0, 0, 0, 0, 0, 1, opTuple2, opMemoize}},
	}
	var all list
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := pickleOf(t, tt.v)
			if want := framed(tt.body...); !bytes.Equal(got, want) {
				t.Errorf("encoding = % x, want % x", got, want)
			}
			if v := gopickleLoad(t, got); !reflect.DeepEqual(v, canon(tt.v)) {
				t.Errorf("gopickle read %#v, want %#v", v, canon(tt.v))
			}
		})
		all = append(all, tt.v)
	}
	if _, got := pyInspect(t, pickleOf(t, all)); !reflect.DeepEqual(got, canon(all)) {
		t.Errorf("python3 read %#v\nwant %#v", got, canon(all))
	}
}

func TestNestedRoundTrip(t *testing.T) {
	v := dict{
		{"segments", list{
			dict{{"device", 0}, {"address", uint64(0x12C040000000)}, {"blocks", list{
				dict{{"size", 4608}, {"state", "inactive"}, {"frames", list{}}},
				dict{{"size", 1536}, {"state", "active_allocated"}, {"frames", list{}}},
			}}, {"segment_pool_id", pair{0, 0}}},
		}},
		{"device_traces", list{list{}, list{dict{{"action", "oom"}, {"device_free", 0}}}, list{}}},
		{"deep", list{list{list{list{dict{{"x", list{dict{}}}}}}}}},
		{"mixed", list{nil, true, false, 1.25, -7, "", pair{1, 2}, pair{1, 2}, list{}, dict{}}},
		{"inactive", "inactive"},
	}
	data := pickleOf(t, v)
	want := canon(v)
	if got := gopickleLoad(t, data); !reflect.DeepEqual(got, want) {
		t.Errorf("gopickle read\n%#v\nwant\n%#v", got, want)
	}
	if _, got := pyInspect(t, data); !reflect.DeepEqual(got, want) {
		t.Errorf("python3 read\n%#v\nwant\n%#v", got, want)
	}
}

func intList(n int) list {
	l := make(list, n)
	for i := range l {
		l[i] = int64(i * 7)
	}
	return l
}

func intDict(n int) dict {
	d := make(dict, n)
	for i := range d {
		d[i] = kv{"k" + strconv.Itoa(i), int64(i)}
	}
	return d
}

// TestBatching checks that lists and dicts are filled in batches of 1000 as
// CPython does: MARK … APPENDS/SETITEMS for batches of two or more, a lone
// APPEND/SETITEM for a batch of one.
func TestBatching(t *testing.T) {
	tests := []struct {
		n        int
		multi    int // APPENDS / SETITEMS
		single   int // APPEND / SETITEM
		markSize []int
	}{
		{0, 0, 0, nil},
		{1, 0, 1, nil},
		{2, 1, 0, []int{2}},
		{999, 1, 0, []int{999}},
		{1000, 1, 0, []int{1000}},
		{1001, 1, 1, []int{1000}},
		{1002, 2, 0, []int{1000, 2}},
		{2000, 2, 0, []int{1000, 1000}},
		{2001, 2, 1, []int{1000, 1000}},
		{2500, 3, 0, []int{1000, 1000, 500}},
	}
	for _, tt := range tests {
		for _, kind := range []string{"list", "dict"} {
			t.Run(fmt.Sprintf("%s of %d", kind, tt.n), func(t *testing.T) {
				var v any = intList(tt.n)
				multiOp, singleOp := byte(opAppends), byte(opAppend)
				perItem := 1 // opcodes per item between MARK and its closer
				if kind == "dict" {
					v = intDict(tt.n)
					multiOp, singleOp = opSetItems, opSetItem
					perItem = 3 // key, MEMOIZE, value
				}
				data := pickleOf(t, v)
				ops := mustWalk(t, data)
				n := countOps(ops)
				if n[multiOp] != tt.multi || n[singleOp] != tt.single || n[opMark] != len(tt.markSize) {
					t.Errorf("multi %d single %d marks %d, want %d %d %d",
						n[multiOp], n[singleOp], n[opMark], tt.multi, tt.single, len(tt.markSize))
				}
				// Each MARK opens a batch of the expected size.
				var sizes []int
				for i, o := range ops {
					if o.code != opMark {
						continue
					}
					j := i + 1
					for ops[j].code != multiOp {
						j++
					}
					sizes = append(sizes, (j-i-1)/perItem)
				}
				if !reflect.DeepEqual(sizes, tt.markSize) {
					t.Errorf("batch sizes %v, want %v", sizes, tt.markSize)
				}
				if got := gopickleLoad(t, data); !reflect.DeepEqual(got, canon(v)) {
					t.Errorf("gopickle read a different %s", kind)
				}
			})
		}
	}
	// Nested batches: a list of 1001 lists, some of 1001 items, and a dict of
	// 2500 whose values are lists of up to 1000, checked against CPython once.
	outer := make(list, 1001)
	for i := range outer {
		outer[i] = intList(i % 3)
		if i%250 == 0 {
			outer[i] = intList(1001)
		}
	}
	d := make(dict, 2500)
	for i := range d {
		d[i] = kv{"k" + strconv.Itoa(i), intList(i % 3)}
		if i%500 == 0 {
			d[i].V = intList(1000)
		}
	}
	v := list{outer, d, intList(1), intDict(1), intList(2500), intDict(2500)}
	data := pickleOf(t, v)
	mustWalk(t, data)
	if got := gopickleLoad(t, data); !reflect.DeepEqual(got, canon(v)) {
		t.Errorf("gopickle read different nested batches")
	}
	if _, got := pyInspect(t, data); !reflect.DeepEqual(got, canon(v)) {
		t.Errorf("python3 read different nested batches")
	}
}

func TestMemo(t *testing.T) {
	t.Run("repeated strings and pairs", func(t *testing.T) {
		v := list{"alloc", "alloc", pair{0, 0}, "free", pair{0, 0}, pair{0, 1}, "alloc", pair{0, 1}, pair{1, 0}}
		data := pickleOf(t, v)
		want := framed(
			opEmptyList, opMark,
			opShortBinUnicode, 5, 'a', 'l', 'l', 'o', 'c', opMemoize, // memo 0
			opBinGet, 0,
			'K', 0, 'K', 0, opTuple2, opMemoize, // memo 1
			opShortBinUnicode, 4, 'f', 'r', 'e', 'e', opMemoize, // memo 2
			opBinGet, 1,
			'K', 0, 'K', 1, opTuple2, opMemoize, // memo 3
			opBinGet, 0,
			opBinGet, 3,
			'K', 1, 'K', 0, opTuple2, opMemoize, // memo 4
			opAppends,
		)
		if !bytes.Equal(data, want) {
			t.Errorf("encoding\n% x\nwant\n% x", data, want)
		}
		if got := gopickleLoad(t, data); !reflect.DeepEqual(got, canon(v)) {
			t.Errorf("gopickle read %#v", got)
		}
		if _, got := pyInspect(t, data); !reflect.DeepEqual(got, canon(v)) {
			t.Errorf("python3 read %#v", got)
		}
	})
	t.Run("a string and the same key share one memo slot", func(t *testing.T) {
		v := dict{{"state", "state"}}
		want := framed(opEmptyDict, opShortBinUnicode, 5, 's', 't', 'a', 't', 'e', opMemoize, opBinGet, 0, opSetItem)
		if got := pickleOf(t, v); !bytes.Equal(got, want) {
			t.Errorf("encoding % x, want % x", got, want)
		}
	})
	t.Run("LONG_BINGET beyond 255", func(t *testing.T) {
		var v list
		for i := 0; i < 300; i++ {
			v = append(v, "s"+strconv.Itoa(i))
		}
		for _, i := range []int{0, 255, 256, 299, 17} {
			v = append(v, "s"+strconv.Itoa(i))
		}
		v = append(v, pair{3, 4}, pair{3, 4}) // memo 300, then LONG_BINGET 300
		data := pickleOf(t, v)
		ops := mustWalk(t, data)
		var gets []string
		for _, o := range ops {
			switch o.code {
			case opBinGet:
				gets = append(gets, fmt.Sprintf("h%d", o.arg[0]))
			case opLongBinGet:
				gets = append(gets, fmt.Sprintf("j%d", binary.LittleEndian.Uint32(o.arg)))
			}
		}
		if want := []string{"h0", "h255", "j256", "j299", "h17", "j300"}; !reflect.DeepEqual(gets, want) {
			t.Errorf("back-references %v, want %v", gets, want)
		}
		if n := countOps(ops); n[opMemoize] != 301 || n[opShortBinUnicode] != 300 {
			t.Errorf("%d MEMOIZE, %d strings; want 301, 300", n[opMemoize], n[opShortBinUnicode])
		}
		if got := gopickleLoad(t, data); !reflect.DeepEqual(got, canon(v)) {
			t.Errorf("gopickle read a different list")
		}
		if _, got := pyInspect(t, data); !reflect.DeepEqual(got, canon(v)) {
			t.Errorf("python3 read a different list")
		}
	})
	t.Run("containers are never memoized", func(t *testing.T) {
		v := list{dict{}, dict{}, list{}, list{}, dict{{"a", list{}}}, dict{{"a", list{}}}}
		ops := mustWalk(t, pickleOf(t, v))
		if n := countOps(ops); n[opMemoize] != 1 || n[opBinGet] != 1 {
			t.Errorf("%d MEMOIZE and %d BINGET, want 1 and 1 (the string \"a\")", n[opMemoize], n[opBinGet])
		}
	})
	t.Run("memo is per encoder", func(t *testing.T) {
		a, b := pickleOf(t, "same"), pickleOf(t, "same")
		if !bytes.Equal(a, b) || !bytes.Contains(b, []byte("same")) {
			t.Errorf("second encoder wrote % x", b)
		}
	})
}

func TestEncoderMisuse(t *testing.T) {
	tests := []struct {
		name string
		use  func(e *output.Encoder)
		want string
	}{
		{"Elem outside a container", func(e *output.Encoder) { e.Elem(); e.Int(1) }, "item outside a container"},
		{"Key outside a container", func(e *output.Encoder) { e.Key("k"); e.Int(1) }, "item outside a container"},
		{"Key in a list", func(e *output.Encoder) { e.BeginList(1); e.Key("k"); e.Int(1); e.EndList() }, "dict key in a list"},
		{"Elem in a dict", func(e *output.Encoder) { e.BeginDict(1); e.Elem(); e.Int(1); e.EndDict() }, "list element in a dict"},
		{"too many list items", func(e *output.Encoder) {
			e.BeginList(2)
			for i := 0; i < 3; i++ {
				e.Elem()
				e.Int(1)
			}
			e.EndList()
		}, "container announced 2 items, got more"},
		{"too many dict items", func(e *output.Encoder) {
			e.BeginDict(0)
			e.Key("k")
			e.Int(1)
			e.EndDict()
		}, "container announced 0 items, got more"},
		{"too many items past a batch", func(e *output.Encoder) {
			e.BeginList(1000)
			for i := 0; i < 1001; i++ {
				e.Elem()
				e.Int(1)
			}
			e.EndList()
		}, "container announced 1000 items, got more"},
		{"too few list items", func(e *output.Encoder) {
			e.BeginList(2)
			e.Elem()
			e.Int(1)
			e.EndList()
		}, "container announced 2 items, got 1"},
		{"too few dict items", func(e *output.Encoder) {
			e.BeginDict(1)
			e.EndDict()
		}, "container announced 1 items, got 0"},
		{"EndList with nothing open", func(e *output.Encoder) { e.EndList() }, "unbalanced container end"},
		{"EndDict with nothing open", func(e *output.Encoder) { e.EndDict() }, "unbalanced container end"},
		{"EndDict closing a list", func(e *output.Encoder) { e.BeginList(0); e.EndDict() }, "unbalanced container end"},
		{"EndList closing a dict", func(e *output.Encoder) { e.BeginDict(0); e.EndList() }, "unbalanced container end"},
		{"inner end closes the outer kind", func(e *output.Encoder) {
			e.BeginDict(1)
			e.Key("k")
			e.BeginList(0)
			e.EndDict()
		}, "unbalanced container end"},
		{"Close with an open list", func(e *output.Encoder) { e.BeginList(0) }, "Close with open containers"},
		{"Close with an open dict", func(e *output.Encoder) {
			e.BeginList(1)
			e.Elem()
			e.BeginDict(0)
			e.EndDict()
		}, "Close with open containers"},
		{"first error wins", func(e *output.Encoder) {
			e.Int(1 << 60)
			e.EndList()
		}, output.ErrIntRange.Error()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			e := output.NewEncoder(&buf)
			tt.use(e)
			err := e.Close()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Close() = %v, want an error containing %q", err, tt.want)
			}
			if e.Err() != err {
				t.Errorf("Err() = %v, Close() = %v", e.Err(), err)
			}
			if bytes.HasSuffix(buf.Bytes(), []byte{opStop}) {
				t.Errorf("a failed pickle ends in STOP: % x", buf.Bytes())
			}
			if _, err := pickle.Loads(buf.String()); err == nil {
				t.Errorf("gopickle loads the output of a failed encoding")
			}
		})
	}
}

// failWriter fails once more than limit bytes were written.
type failWriter struct {
	limit, n int
}

var errDiskFull = errors.New("disk full")

func (w *failWriter) Write(p []byte) (int, error) {
	if w.n+len(p) > w.limit {
		n := w.limit - w.n
		w.n = w.limit
		return n, errDiskFull
	}
	w.n += len(p)
	return len(p), nil
}

func TestWriterError(t *testing.T) {
	for _, limit := range []int{0, 1, 2, 100, 70 << 10, 300 << 10} {
		e := output.NewEncoder(&failWriter{limit: limit})
		encode(e, intList(100000)) // ≈ 200 KB: several frames
		err := e.Close()
		if !errors.Is(err, errDiskFull) {
			t.Errorf("limit %d: Close() = %v, want the writer's error", limit, err)
		}
	}
	// A writer that accepts everything: no error.
	var buf bytes.Buffer
	e := output.NewEncoder(&buf)
	encode(e, intList(100000))
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
}

// bigMixed is a pickle of every kind of value, well over 200 KiB.
func bigMixed() list {
	var entries list
	for i := 0; i < 6000; i++ {
		entries = append(entries, dict{
			{"action", []string{"alloc", "free_requested", "free_completed", "segment_alloc", "oom"}[i%5]},
			{"addr", uint64(0x12C040000000 + i*512)},
			{"size", int64(i * 4096)},
			{"stream", uint64(0xAAAAD1E2F3A0)},
			{"time_us", int64(1767225600000000 + i)},
			{"pool_id", pair{0, int64(i % 3)}},
		})
	}
	return list{
		entries,
		dict{{"neg", list{-1, -1 << 31, -1<<31 - 1, -1 << 53}}, {"pos", list{255, 65535, 1<<31 - 1, 1 << 53}}},
		list{true, false, nil, 1.5, math.Inf(-1), "héllo ✓", strings.Repeat("long ", 100), ""},
		list{list{}, dict{}, intList(1), intDict(1), intList(1001)},
		strings.Repeat("a string longer than a frame ", 4000),
	}
}

// TestFrames: a large pickle is cut into frames of at least 64 KiB that end
// on opcode boundaries, and still reads back.
func TestFrames(t *testing.T) {
	v := bigMixed()
	data := pickleOf(t, v)
	if len(data) < 200<<10 {
		t.Fatalf("pickle is only %d bytes", len(data))
	}
	ops := mustWalk(t, data) // checks frames are exact and never straddled
	var frames []int
	var framedBytes int
	for _, o := range ops {
		if o.code == opFrame {
			n := int(binary.LittleEndian.Uint64(o.arg))
			frames = append(frames, n)
			framedBytes += 9 + n
		}
	}
	if len(frames) < 3 {
		t.Fatalf("%d frames, want several", len(frames))
	}
	// Everything after PROTO is framed except a tail shorter than 4 bytes.
	if tail := len(data) - 2 - framedBytes; tail < 0 || tail >= 4 {
		t.Errorf("%d bytes outside frames after PROTO", tail)
	}
	if ops[1].code != opFrame || ops[1].pos != 2 {
		t.Errorf("first frame at %d, want right after PROTO", ops[1].pos)
	}
	for i, n := range frames[:len(frames)-1] {
		if n < frameTarget {
			t.Errorf("frame %d is %d bytes, below the %d target", i, n, frameTarget)
		}
	}
	if got := gopickleLoad(t, data); !reflect.DeepEqual(got, canon(v)) {
		t.Errorf("gopickle read a different value")
	}
	r, got := pyInspect(t, data)
	if !reflect.DeepEqual(got, canon(v)) {
		t.Errorf("python3 read a different value")
	}
	if !reflect.DeepEqual(r.Frames, frames) {
		t.Errorf("pickletools frames %v, Go walker %v", r.Frames, frames)
	}
}

// TestOpcodeWhitelist walks a big mixed pickle with pickletools: only
// opcodes memory_viz understands (snapshot-format §9.1) and protocol 4.
func TestOpcodeWhitelist(t *testing.T) {
	allowed := map[string]bool{}
	for _, name := range strings.Fields(`PROTO FRAME MARK STOP EMPTY_DICT DICT SETITEM SETITEMS
		EMPTY_LIST LIST APPEND APPENDS EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 NONE NEWTRUE NEWFALSE
		BININT BININT1 BININT2 LONG1 BINFLOAT SHORT_BINUNICODE BINUNICODE MEMOIZE BINPUT
		LONG_BINPUT BINGET LONG_BINGET`) {
		allowed[name] = true
	}
	v := bigMixed()
	// Push the memo past 255 so LONG_BINGET appears.
	var strs list
	for i := 0; i < 800; i++ {
		strs = append(strs, "name"+strconv.Itoa(i%400))
	}
	v = append(v, strs)
	data := pickleOf(t, v)
	r, got := pyInspect(t, data)
	if r.Proto != 4 {
		t.Errorf("PROTO %d, want 4", r.Proto)
	}
	seen := map[string]int{}
	for _, name := range r.Ops {
		seen[name]++
		if !allowed[name] {
			t.Errorf("opcode %s is not in the viewer's whitelist", name)
		}
	}
	if seen["PROTO"] != 1 || r.Ops[0] != "PROTO" || r.Ops[len(r.Ops)-1] != "STOP" || seen["STOP"] != 1 {
		t.Errorf("PROTO ×%d first=%s, STOP ×%d last=%s", seen["PROTO"], r.Ops[0], seen["STOP"], r.Ops[len(r.Ops)-1])
	}
	// The big mixed pickle uses every opcode the encoder has.
	for _, name := range []string{"FRAME", "MARK", "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_LIST",
		"APPEND", "APPENDS", "TUPLE2", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2",
		"LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE", "BINGET", "LONG_BINGET"} {
		if seen[name] == 0 {
			t.Errorf("opcode %s never appears in the mixed pickle", name)
		}
	}
	if !reflect.DeepEqual(got, canon(v)) {
		t.Errorf("python3 read a different value")
	}
	if g := gopickleLoad(t, data); !reflect.DeepEqual(g, canon(v)) {
		t.Errorf("gopickle read a different value")
	}
}

// goldenValue is a small structure covering every kind of value; its pickle
// is kept byte for byte in testdata/golden_small.pickle.
var goldenValue = dict{
	{"name", "golden"},
	{"ints", list{0, 255, 256, 65535, 65536, -1, 1<<31 - 1, 1 << 31, -1 << 31, -1<<31 - 1, 1 << 53, -1 << 53}},
	{"addr", uint64(0x12C040000000)},
	{"flags", list{true, false, nil}},
	{"float", -2.5},
	{"pool", pair{0, 0}},
	{"pools", list{pair{0, 0}, pair{1, 2}}},
	{"again", list{"golden", "name", "inactive", "inactive"}},
	{"empty_list", list{}},
	{"empty_dict", dict{}},
	{"one", dict{{"k", "v"}}},
	{"unicode", "héllo ✓"},
}

const goldenPython = `{'name': 'golden',
 'ints': [0, 255, 256, 65535, 65536, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**53, -2**53],
 'addr': 0x12C040000000,
 'flags': [True, False, None],
 'float': -2.5,
 'pool': (0, 0),
 'pools': [(0, 0), (1, 2)],
 'again': ['golden', 'name', 'inactive', 'inactive'],
 'empty_list': [],
 'empty_dict': {},
 'one': {'k': 'v'},
 'unicode': 'h\u00e9llo \u2713'}`

func TestGolden(t *testing.T) {
	const path = "testdata/golden_small.pickle"
	data := pickleOf(t, goldenValue)
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s (%d bytes)", path, len(data))
	}
	golden, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run TestGolden -update to create it)", err)
	}
	if !bytes.Equal(data, golden) {
		t.Errorf("encoding differs from %s:\n got %s\nwant %s", path, hex.EncodeToString(data), hex.EncodeToString(golden))
	}
	if got := gopickleLoad(t, golden); !reflect.DeepEqual(got, canon(goldenValue)) {
		t.Errorf("gopickle read %#v", got)
	}
	script := pyStrictEq + `
import pickle, sys
got = pickle.loads(open(sys.argv[1], "rb").read())
want = ` + goldenPython + `
r = strict_eq(got, want)
if r: raise SystemExit(r)
if list(got) != list(want): raise SystemExit("key order %r" % list(got))
if got["again"][2] is not got["again"][3]: raise SystemExit("memoized strings are not shared")
print("ok")
`
	if out := runPython(t, script, path); string(out) != "ok\n" {
		t.Errorf("python3: %q", out)
	}
}
