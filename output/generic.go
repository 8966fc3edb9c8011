package output

// Methods for writing arbitrary pickled values (package snapshot writes
// snapshots it read back, whose allocator_settings may hold tuples and
// non-string keys). They keep the encoder's rules: the same opcodes,
// integers within ±2^53, and no memo entries but strings and int pairs.

// Item announces the next item of the open dict whose key the caller
// writes as any value (Key is the common case of a string key).
func (e *Encoder) Item() { e.beginItem(false) }

// BeginTuple starts a tuple of n values: follow with the n values and
// EndTuple(n). Tuples are not memoized.
func (e *Encoder) BeginTuple(n int) {
	e.start()
	switch {
	case n == 0:
		e.buf = append(e.buf, opEmptyTuple)
	case n > 3:
		e.buf = append(e.buf, opMark)
	}
	e.endOp()
}

// EndTuple closes a tuple of n values opened with BeginTuple(n).
func (e *Encoder) EndTuple(n int) {
	e.start()
	switch n {
	case 0:
		return
	case 1:
		e.buf = append(e.buf, opTuple1)
	case 2:
		e.buf = append(e.buf, opTuple2)
	case 3:
		e.buf = append(e.buf, opTuple3)
	default:
		e.buf = append(e.buf, opTuple)
	}
	e.endOp()
}

// Fail records err as the encoder's error (for a value the caller cannot
// encode); the first error is the one Close returns.
func (e *Encoder) Fail(err error) { e.fail(err) }
