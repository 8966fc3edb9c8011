package output_test

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// TestStringMemoUnderCache: the encoder's cache of recently written
// strings (keyed by where their bytes are) never changes what is written:
// each distinct text is written once and referred back to after, whether
// later uses are the same constant, an equal string built elsewhere, a
// substring, invalid UTF-8 replaced by U+FFFD, or the empty string; and
// more distinct strings than the cache holds evict without harm.
func TestStringMemoUnderCache(t *testing.T) {
	var in list
	var want list
	add := func(s, decoded string) {
		in = append(in, s)
		want = append(want, decoded)
	}
	for round := range 3 {
		for i := range 300 { // more than the cache's slots
			s := fmt.Sprintf("key-%d", i)
			add(s, s)
			add(strings.Clone(s), s)
		}
		add("action", "action")
		add(strings.Clone("action"), "action")
		add("xaction"[1:], "action")
		add("", "")
		add("bad\xffbyte", "bad\uFFFDbyte")
		add("bad\uFFFDbyte", "bad\uFFFDbyte")
		add(fmt.Sprintf("round-%d", round), fmt.Sprintf("round-%d", round))
	}
	data := pickleOf(t, in)
	if got := gopickleLoad(t, data); !reflect.DeepEqual(got, canon(want)) {
		t.Fatalf("decoded list differs from what was written")
	}
	for _, text := range []string{"key-0\x94", "key-299\x94", "action\x94", "bad\xef\xbf\xbdbyte\x94"} {
		if n := bytes.Count(data, []byte(text)); n != 1 {
			t.Errorf("%q written %d times, want once (then memo references)", strings.TrimSuffix(text, "\x94"), n)
		}
	}
}
