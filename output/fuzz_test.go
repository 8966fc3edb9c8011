package output_test

import (
	"bytes"
	"math/big"
	"testing"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"

	"github.com/npuprobe/npuprobe/output"
)

// FuzzPickleRoundTrip: whatever strings and integers are written, gopickle
// reads back exactly those values (integers within ±2^53; strings as valid
// UTF-8, invalid bytes replaced as Encoder.String documents).
func FuzzPickleRoundTrip(f *testing.F) {
	f.Add("segment_alloc", int64(0), int64(1<<53), 3)
	f.Add("\xff\xfe", int64(-1), int64(-(1 << 31)), 1200)
	f.Add("", int64(255), int64(65536), 0)
	f.Fuzz(func(t *testing.T, s string, a, b int64, n int) {
		n = (n%3000 + 3000) % 3000
		a %= 1 << 53
		b %= 1 << 53
		var buf bytes.Buffer
		e := output.NewEncoder(&buf)
		e.BeginList(n + 2)
		for i := 0; i < n; i++ {
			e.Elem()
			e.BeginDict(2)
			e.Key(s)
			e.Int(a)
			e.Key("b")
			e.IntPair(b, a)
			e.EndDict()
		}
		e.Elem()
		e.String(s)
		e.Elem()
		e.Int(b)
		e.EndList()
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		v, err := pickle.Loads(buf.String())
		if err != nil {
			t.Fatalf("gopickle cannot read the encoder's output: %v", err)
		}
		l, ok := v.(*types.List)
		if !ok || l.Len() != n+2 {
			t.Fatalf("got %T of length %d", v, l.Len())
		}
		want := string(bytes.ToValidUTF8([]byte(s), []byte("\uFFFD")))
		if got := l.Get(n); got != want {
			t.Fatalf("string %q read back as %q", want, got)
		}
		if !intEquals(l.Get(n+1), b) {
			t.Fatalf("int %d read back as %v", b, l.Get(n+1))
		}
		if n > 0 {
			d := l.Get(n - 1).(*types.Dict)
			if got, _ := d.Get(want); !intEquals(got, a) {
				t.Fatalf("dict value %d read back as %v", a, got)
			}
		}
	})
}

func intEquals(v any, want int64) bool {
	switch v := v.(type) {
	case int:
		return int64(v) == want
	case *big.Int:
		return v.IsInt64() && v.Int64() == want
	}
	return false
}
