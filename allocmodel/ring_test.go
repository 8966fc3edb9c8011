package allocmodel_test

import (
	"reflect"
	"testing"

	am "github.com/npuprobe/npuprobe/allocmodel"
)

// entry returns a trace entry identified by i (MonoNs and Addr both i), so a
// test can tell exactly which appended entry it is looking at.
func entry(i int) am.TraceEntry {
	return am.TraceEntry{MonoNs: int64(i), Addr: uint64(i), Size: uint64(i) * 10, Action: am.ActionSegmentAlloc}
}

// entries returns entry(from) … entry(to-1).
func entries(from, to int) []am.TraceEntry {
	out := []am.TraceEntry{}
	for i := from; i < to; i++ {
		out = append(out, entry(i))
	}
	return out
}

// checkRing asserts everything observable about r after appended entries
// 0…appended-1 went in, of which want (oldest first) must be held.
func checkRing(t *testing.T, r *am.Ring, appended int, want []am.TraceEntry) {
	t.Helper()
	if got := r.Len(); got != len(want) {
		t.Errorf("Len() = %d, want %d", got, len(want))
	}
	if got := r.Appended(); got != uint64(appended) {
		t.Errorf("Appended() = %d, want %d", got, appended)
	}
	if got, w := r.Overwritten(), uint64(appended-len(want)); got != w {
		t.Errorf("Overwritten() = %d, want %d", got, w)
	}
	if got := r.Entries(); !reflect.DeepEqual(got, want) {
		t.Errorf("Entries() = %v, want %v", monos(got), monos(want))
	}
	// AppendTo appends after what dst already holds and keeps it.
	prefix := []am.TraceEntry{{MonoNs: -7}}
	got := r.AppendTo(prefix)
	if wantTo := append([]am.TraceEntry{{MonoNs: -7}}, want...); !reflect.DeepEqual(got, wantTo) {
		t.Errorf("AppendTo(prefix) = %v, want %v", monos(got), monos(wantTo))
	}
	if got := r.AppendTo(nil); len(got) != len(want) || (len(want) > 0 && !reflect.DeepEqual(got, want)) {
		t.Errorf("AppendTo(nil) = %v, want %v", monos(got), monos(want))
	}
	// At: every held index resolves to its own entry, every lost or future
	// index to nil.
	first := appended - len(want)
	for abs := 0; abs < appended+3; abs++ {
		e := r.At(uint64(abs))
		switch {
		case abs < first || abs >= appended:
			if e != nil {
				t.Errorf("At(%d) = entry %d, want nil (first held %d, appended %d)", abs, e.MonoNs, first, appended)
			}
		case e == nil:
			t.Errorf("At(%d) = nil, want entry %d", abs, abs)
		case *e != entry(abs):
			t.Errorf("At(%d) = entry %d, want entry %d", abs, e.MonoNs, abs)
		}
	}
	if e := r.At(^uint64(0)); e != nil {
		t.Errorf("At(MaxUint64) = entry %d, want nil", e.MonoNs)
	}
}

func monos(es []am.TraceEntry) []int64 {
	out := make([]int64, len(es))
	for i, e := range es {
		out[i] = e.MonoNs
	}
	return out
}

func TestRingEmpty(t *testing.T) {
	for _, capacity := range []int{0, 1, 3} {
		r := am.NewRing(capacity)
		if r.Capacity() != capacity {
			t.Errorf("NewRing(%d).Capacity() = %d", capacity, r.Capacity())
		}
		checkRing(t, r, 0, []am.TraceEntry{})
		if got := r.Entries(); got == nil {
			t.Errorf("NewRing(%d).Entries() = nil, want an empty non-nil slice", capacity)
		}
	}
}

func TestRingNegativeCapacityIsUnbounded(t *testing.T) {
	r := am.NewRing(-5)
	if r.Capacity() != 0 {
		t.Fatalf("NewRing(-5).Capacity() = %d, want 0", r.Capacity())
	}
	for i := 0; i < 100; i++ {
		r.Append(entry(i))
	}
	checkRing(t, r, 100, entries(0, 100))
}

func TestRingUnbounded(t *testing.T) {
	r := am.NewRing(0)
	for i := 0; i < 5000; i++ {
		if abs := r.Append(entry(i)); abs != uint64(i) {
			t.Fatalf("Append #%d returned index %d", i, abs)
		}
	}
	checkRing(t, r, 5000, entries(0, 5000))
}

func TestRingBounded(t *testing.T) {
	const capacity = 4
	tests := []struct {
		name     string
		appended int
		want     []am.TraceEntry
	}{
		{"one", 1, entries(0, 1)},
		{"before wrap", 3, entries(0, 3)},
		{"exactly full", 4, entries(0, 4)},
		{"first overwrite", 5, entries(1, 5)},
		{"half way round", 6, entries(2, 6)},
		{"last slot overwritten", 7, entries(3, 7)},
		{"full wrap", 8, entries(4, 8)},
		{"second lap started", 9, entries(5, 9)},
		{"many wraps", 4*250 + 3, entries(4*250+3-4, 4*250+3)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := am.NewRing(capacity)
			for i := 0; i < tt.appended; i++ {
				if abs := r.Append(entry(i)); abs != uint64(i) {
					t.Fatalf("Append #%d returned index %d", i, abs)
				}
			}
			if r.Capacity() != capacity {
				t.Errorf("Capacity() = %d, want %d", r.Capacity(), capacity)
			}
			checkRing(t, r, tt.appended, tt.want)
		})
	}
}

func TestRingCapacityOne(t *testing.T) {
	r := am.NewRing(1)
	for i := 0; i < 10; i++ {
		r.Append(entry(i))
		checkRing(t, r, i+1, entries(i, i+1))
	}
}

// TestRingManyWraps checks the ring after every append through many laps, for
// capacities that do and do not divide the append count.
func TestRingManyWraps(t *testing.T) {
	for _, capacity := range []int{1, 2, 3, 7, 64} {
		r := am.NewRing(capacity)
		for i := 0; i < capacity*13+5; i++ {
			r.Append(entry(i))
			n := i + 1
			first := max(0, n-capacity)
			checkRing(t, r, n, entries(first, n))
			if t.Failed() {
				t.Fatalf("capacity %d, after %d appends", capacity, n)
			}
		}
	}
}

// TestRingAtIsWritable checks that the pointer At returns refers to the
// stored entry (the model patches OOM entries through it).
func TestRingAtIsWritable(t *testing.T) {
	r := am.NewRing(3)
	for i := 0; i < 5; i++ {
		r.Append(entry(i))
	}
	r.At(3).Addr = 999
	got := r.Entries()
	want := entries(2, 5)
	want[1].Addr = 999
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Entries() after patching At(3) = %+v, want %+v", got, want)
	}
}

// TestRingEntriesIsCopy checks that Entries does not alias the ring.
func TestRingEntriesIsCopy(t *testing.T) {
	for _, capacity := range []int{0, 3} {
		r := am.NewRing(capacity)
		for i := 0; i < 3; i++ {
			r.Append(entry(i))
		}
		got := r.Entries()
		got[0].Addr = 12345
		if r.At(0).Addr != 0 {
			t.Errorf("capacity %d: mutating Entries() changed the ring", capacity)
		}
	}
}
