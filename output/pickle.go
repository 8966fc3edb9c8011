package output

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"unicode/utf8"
	"unsafe"
)

// Pickle opcodes, limited to those memory_viz's JavaScript unpickler
// understands (see snapshot-format §9.1). Anything else makes it fail with
// "UNKNOWN OPCODE", so the encoder has no way to emit other opcodes.
const (
	opMark            = '('
	opStop            = '.'
	opBinInt          = 'J'
	opBinInt1         = 'K'
	opBinInt2         = 'M'
	opNone            = 'N'
	opBinUnicode      = 'X'
	opAppend          = 'a'
	opAppends         = 'e'
	opBinGet          = 'h'
	opLongBinGet      = 'j'
	opEmptyList       = ']'
	opSetItem         = 's'
	opSetItems        = 'u'
	opEmptyDict       = '}'
	opEmptyTuple      = ')'
	opTuple           = 't'
	opBinFloat        = 'G'
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
)

// Protocol is the pickle protocol written. memory_viz rejects 5 (its
// unpickler stops at "Unhandled version 5"), and 4 is the newest it reads.
const Protocol = 4

const (
	// frameTarget is the size at which a frame is closed, as CPython does:
	// frames let a reader fetch 64 KiB at a time.
	frameTarget = 64 << 10
	frameMin    = 4
	// batchSize is how many items one SETITEMS/APPENDS carries, as CPython.
	batchSize = 1000
	// maxExactInt is the largest integer a JavaScript Number (the viewer's
	// representation) holds exactly.
	maxExactInt = 1 << 53
)

// ErrIntRange is returned for integers the viewer cannot represent exactly.
var ErrIntRange = errors.New("pickle: integer outside ±2^53 (memory_viz would lose precision)")

// Encoder writes a protocol-4 pickle as a stream, without building the
// object tree in memory: a snapshot of millions of trace entries is written
// straight from the model's copy.
//
// Why hand-written: gopickle (and every other Go pickle library we know)
// only reads pickles. Containers are written with their length known up
// front (Go slices), which lets the encoder batch SETITEMS/APPENDS exactly
// as CPython does.
//
// Strings are memoized and written once; later uses are back-references
// (BINGET). Dicts and lists are never memoized, so no two dicts can become
// the same object in the reader: the viewer mutates every trace entry and
// block it loads and must not see them shared.
type Encoder struct {
	out     io.Writer
	buf     []byte              // current frame
	memo    map[string]uint32   // memoized strings
	tuples  map[[2]int64]uint32 // memoized int pairs
	nextID  uint32
	stack   []container
	err     error
	started bool
	// strCache remembers the memo ids of recently written strings by the
	// address and length of their bytes: the keys and action and state
	// names a snapshot repeats millions of times are string constants,
	// so this finds them without hashing. An entry holds a pointer to the
	// bytes, which keeps them alive: the same address and length always
	// mean the same (immutable) text.
	strCache [strCacheSize]strCacheEntry
	// lastPair is the int pair written last and its memo id (pool ids
	// are nearly always the same pair).
	lastPair   [2]int64
	lastPairID uint32
	havePair   bool
}

// strCacheSize is a power of two; a string is looked for in strCacheWays
// consecutive slots from its hash.
const (
	strCacheSize = 128
	strCacheWays = 4
)

type strCacheEntry struct {
	p  *byte
	n  int
	id uint32
}

func strCacheHash(p *byte, n int) int {
	h := uint64(uintptr(unsafe.Pointer(p)))*0x9E3779B97F4A7C15 + uint64(n)
	return int(h >> 57) // 7 bits: strCacheSize
}

// lookupCached returns the memo id of the string at p of length n if it
// was cached.
func (e *Encoder) lookupCached(p *byte, n int) (uint32, bool) {
	h := strCacheHash(p, n)
	for i := range strCacheWays {
		c := &e.strCache[(h+i)&(strCacheSize-1)]
		if c.p == p && c.n == n {
			return c.id, true
		}
		if c.p == nil {
			break
		}
	}
	return 0, false
}

// cache remembers id for the string at p of length n: in the first free
// slot of its ways, else in place of the first.
func (e *Encoder) cache(p *byte, n int, id uint32) {
	h := strCacheHash(p, n)
	for i := range strCacheWays {
		c := &e.strCache[(h+i)&(strCacheSize-1)]
		if c.p == nil {
			*c = strCacheEntry{p: p, n: n, id: id}
			return
		}
	}
	e.strCache[h] = strCacheEntry{p: p, n: n, id: id}
}

type container struct {
	list      bool
	total     int // items announced
	started   int // items begun
	batchLeft int // items still to begin in the open batch
	batchLen  int // length of the open batch; 0 when none is open
}

// NewEncoder returns an encoder writing to w. Call Close to finish the pickle.
func NewEncoder(w io.Writer) *Encoder {
	return &Encoder{out: w, buf: make([]byte, 0, frameTarget+1024), memo: make(map[string]uint32), tuples: make(map[[2]int64]uint32)}
}

func (e *Encoder) fail(err error) {
	if e.err == nil {
		e.err = err
	}
}

// Err returns the first error met.
func (e *Encoder) Err() error { return e.err }

func (e *Encoder) start() {
	if e.started {
		return
	}
	e.started = true
	// PROTO sits outside the first frame, as CPython writes it.
	if _, err := e.out.Write([]byte{opProto, Protocol}); err != nil {
		e.fail(err)
	}
}

// endOp is called after every complete opcode: frames only ever end on an
// opcode boundary.
func (e *Encoder) endOp() {
	if len(e.buf) >= frameTarget {
		e.commitFrame()
	}
}

func (e *Encoder) commitFrame() {
	if len(e.buf) == 0 || e.err != nil {
		e.buf = e.buf[:0]
		return
	}
	if len(e.buf) < frameMin {
		// Like CPython, a frame too small to be worth its header is written bare.
		if _, err := e.out.Write(e.buf); err != nil {
			e.fail(err)
		}
		e.buf = e.buf[:0]
		return
	}
	var hdr [9]byte
	hdr[0] = opFrame
	binary.LittleEndian.PutUint64(hdr[1:], uint64(len(e.buf)))
	if _, err := e.out.Write(hdr[:]); err != nil {
		e.fail(err)
	} else if _, err := e.out.Write(e.buf); err != nil {
		e.fail(err)
	}
	e.buf = e.buf[:0]
}

// beginItem is called before each dict key or list element.
func (e *Encoder) beginItem(list bool) {
	e.start()
	if len(e.stack) == 0 {
		e.fail(errors.New("pickle: item outside a container"))
		return
	}
	c := &e.stack[len(e.stack)-1]
	if c.list != list {
		e.fail(errors.New("pickle: dict key in a list, or list element in a dict"))
		return
	}
	if c.batchLen > 0 && c.batchLeft == 0 {
		e.closeBatch(c)
	}
	if c.started == c.total {
		e.fail(fmt.Errorf("pickle: container announced %d items, got more", c.total))
		return
	}
	if c.batchLen == 0 {
		c.batchLen = min(c.total-c.started, batchSize)
		c.batchLeft = c.batchLen
		if c.batchLen > 1 {
			e.buf = append(e.buf, opMark)
		}
	}
	c.batchLeft--
	c.started++
}

func (e *Encoder) closeBatch(c *container) {
	switch {
	case c.list && c.batchLen > 1:
		e.buf = append(e.buf, opAppends)
	case c.list:
		e.buf = append(e.buf, opAppend)
	case c.batchLen > 1:
		e.buf = append(e.buf, opSetItems)
	default:
		e.buf = append(e.buf, opSetItem)
	}
	c.batchLen = 0
	e.endOp()
}

// BeginDict opens a dict of n items; follow with n Key+value pairs and EndDict.
func (e *Encoder) BeginDict(n int) {
	e.start()
	e.buf = append(e.buf, opEmptyDict)
	e.stack = append(e.stack, container{total: n})
	e.endOp()
}

// BeginList opens a list of n elements; follow with n Elem+value and EndList.
func (e *Encoder) BeginList(n int) {
	e.start()
	e.buf = append(e.buf, opEmptyList)
	e.stack = append(e.stack, container{list: true, total: n})
	e.endOp()
}

// Key writes a string key of the open dict; its value follows.
func (e *Encoder) Key(k string) {
	e.beginItem(false)
	e.String(k)
}

// Elem announces the next element of the open list.
func (e *Encoder) Elem() { e.beginItem(true) }

// EndDict closes the open dict.
func (e *Encoder) EndDict() { e.end(false) }

// EndList closes the open list.
func (e *Encoder) EndList() { e.end(true) }

func (e *Encoder) end(list bool) {
	if len(e.stack) == 0 || e.stack[len(e.stack)-1].list != list {
		e.fail(errors.New("pickle: unbalanced container end"))
		return
	}
	c := &e.stack[len(e.stack)-1]
	if c.started != c.total {
		e.fail(fmt.Errorf("pickle: container announced %d items, got %d", c.total, c.started))
	}
	if c.batchLen > 0 {
		e.closeBatch(c)
	}
	e.stack = e.stack[:len(e.stack)-1]
}

// Int writes an integer with the smallest opcode CPython would use.
func (e *Encoder) Int(v int64) {
	e.start()
	switch {
	case v > maxExactInt || v < -maxExactInt:
		e.fail(fmt.Errorf("%w: %d", ErrIntRange, v))
		return
	case v >= 0 && v <= 0xff:
		e.buf = append(e.buf, opBinInt1, byte(v))
	case v >= 0 && v <= 0xffff:
		e.buf = append(e.buf, opBinInt2, byte(v), byte(v>>8))
	case v >= math.MinInt32 && v <= math.MaxInt32:
		e.buf = binary.LittleEndian.AppendUint32(append(e.buf, opBinInt), uint32(int32(v)))
	default:
		// LONG1: minimal two's-complement little-endian bytes.
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], uint64(v))
		n := 8
		for n > 1 {
			top, next := b[n-1], b[n-2]
			if (top == 0 && next&0x80 == 0) || (top == 0xff && next&0x80 != 0) {
				n--
				continue
			}
			break
		}
		e.buf = append(append(e.buf, opLong1, byte(n)), b[:n]...)
	}
	e.endOp()
}

// Uint writes an unsigned integer (addresses, sizes).
func (e *Encoder) Uint(v uint64) {
	if v > maxExactInt {
		e.fail(fmt.Errorf("%w: %d", ErrIntRange, v))
		return
	}
	e.Int(int64(v))
}

// Bool writes True or False.
func (e *Encoder) Bool(v bool) {
	e.start()
	if v {
		e.buf = append(e.buf, opNewTrue)
	} else {
		e.buf = append(e.buf, opNewFalse)
	}
	e.endOp()
}

// None writes None.
func (e *Encoder) None() {
	e.start()
	e.buf = append(e.buf, opNone)
	e.endOp()
}

// Float writes a float (BINFLOAT is big-endian).
func (e *Encoder) Float(v float64) {
	e.start()
	e.buf = binary.BigEndian.AppendUint64(append(e.buf, opBinFloat), math.Float64bits(v))
	e.endOp()
}

// String writes a str, once: later writes of the same string refer back to
// the first. Invalid UTF-8 (process names and environment values are
// arbitrary bytes) is written with U+FFFD in its place: pickle strings are
// UTF-8 and CPython refuses to load anything else.
func (e *Encoder) String(s string) {
	e.start()
	p, n := unsafe.StringData(s), len(s)
	if p != nil {
		if id, ok := e.lookupCached(p, n); ok {
			e.get(id)
			return
		}
	}
	// The memo holds only valid UTF-8, so a hit needs no validation.
	if id, ok := e.memo[s]; ok {
		if p != nil {
			e.cache(p, n, id)
		}
		e.get(id)
		return
	}
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
		if id, ok := e.memo[s]; ok {
			e.get(id)
			return
		}
	}
	if len(s) < 256 {
		e.buf = append(e.buf, opShortBinUnicode, byte(len(s)))
	} else {
		e.buf = binary.LittleEndian.AppendUint32(append(e.buf, opBinUnicode), uint32(len(s)))
	}
	e.buf = append(e.buf, s...)
	id := e.memoize()
	e.memo[s] = id
	if p != nil && unsafe.StringData(s) == p {
		e.cache(p, n, id)
	}
	e.endOp()
}

// IntPair writes a 2-tuple of ints, memoized so that repeated identical
// tuples (pool ids) cost one back-reference each. Tuples are immutable in
// Python and the viewer never edits them, so sharing them is safe.
func (e *Encoder) IntPair(a, b int64) {
	e.start()
	key := [2]int64{a, b}
	if e.havePair && key == e.lastPair {
		e.get(e.lastPairID)
		return
	}
	if id, ok := e.tuples[key]; ok {
		e.lastPair, e.lastPairID, e.havePair = key, id, true
		e.get(id)
		return
	}
	e.Int(a)
	e.Int(b)
	e.buf = append(e.buf, opTuple2)
	id := e.memoize()
	e.tuples[key] = id
	e.lastPair, e.lastPairID, e.havePair = key, id, true
	e.endOp()
}

func (e *Encoder) memoize() uint32 {
	e.buf = append(e.buf, opMemoize)
	e.nextID++
	return e.nextID - 1
}

func (e *Encoder) get(id uint32) {
	if id < 256 {
		e.buf = append(e.buf, opBinGet, byte(id))
	} else {
		e.buf = binary.LittleEndian.AppendUint32(append(e.buf, opLongBinGet), id)
	}
	e.endOp()
}

// Close writes STOP, flushes the last frame and reports the first error.
func (e *Encoder) Close() error {
	if len(e.stack) != 0 {
		e.fail(errors.New("pickle: Close with open containers"))
	}
	e.start()
	e.buf = append(e.buf, opStop)
	e.commitFrame()
	return e.err
}
