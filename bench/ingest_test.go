package bench

import (
	"runtime"
	"sync"
	"testing"

	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
)

// streamEvents is the length of the benchmark streams: enough to wrap the
// default 1,000,000-entry trace ring at tensor level.
const streamEvents = 1_000_000

var (
	streamsOnce sync.Once
	segStream   *Stream
	tenStream   *Stream
)

// streams returns a segment-level and a tensor-level stream of
// 2 × streamEvents records: the first half fills the ring, the second is
// what the steady-state benchmark times.
func streams() (*Stream, *Stream) {
	streamsOnce.Do(func() {
		segStream = NewSegmentStream(2*streamEvents, 1)
		tenStream = NewTensorStream(2*streamEvents, 1)
	})
	return segStream, tenStream
}

// TestStreamsDecodeAndModelCleanly: every record decodes back to the event
// it was built from, and the model applies the streams without repairing
// anything (the allocation patterns follow torch_npu's rules).
func TestStreamsDecodeAndModelCleanly(t *testing.T) {
	for _, gen := range []struct {
		name  string
		level allocmodel.Level
		fn    func(int, uint64, func(*allocmodel.Event))
	}{{"segment", allocmodel.LevelSegment, SegmentEvents}, {"tensor", allocmodel.LevelTensor, TensorEvents}} {
		t.Run(gen.name, func(t *testing.T) {
			m := NewModel(gen.level)
			var buf []byte
			var got allocmodel.Event
			n := 0
			gen.fn(200_000, 7, func(ev *allocmodel.Event) {
				buf = AppendRecord(buf[:0], ev)
				if err := agent.DecodeRecord(buf, &got); err != nil {
					t.Fatal(err)
				}
				if got != *ev {
					t.Fatalf("event %d: decoded %+v, built %+v", n, got, *ev)
				}
				m.Apply(&got)
				n++
			})
			c := m.Counters()
			if n != 200_000 || c.Events != uint64(n) {
				t.Fatalf("%d events built, %d applied", n, c.Events)
			}
			c.Events = 0
			if c != (allocmodel.Counters{}) {
				t.Errorf("the model counted anomalies: %+v", c)
			}
			st := m.Stats()
			t.Logf("%s: %d live segments, %d MiB reserved, %d MiB allocated", gen.name, st.LiveSegments, st.ReservedBytes>>20, st.AllocatedBytes>>20)
		})
	}
}

// BenchmarkIngest measures decode → allocmodel → ring per event, on one
// core, for each stream level, in two states:
//   - steady: the model has already taken streamEvents events, so the
//     default 1,000,000-entry ring is full (segment level: nearly) and
//     every append overwrites, as in a long-running npuprobe; the next
//     streamEvents events are timed.
//   - cold: a fresh model takes the first streamEvents events (the ring
//     grows from empty).
func BenchmarkIngest(b *testing.B) {
	seg, ten := streams()
	for _, s := range []*Stream{seg, ten} {
		first, second := s.Half(0), s.Half(1)
		b.Run(s.Name+"/steady", func(b *testing.B) {
			b.SetBytes(int64(len(second.Records)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				m := NewModel(s.Level)
				if err := Ingest(m, first); err != nil {
					b.Fatal(err)
				}
				runtime.GC()
				b.StartTimer()
				if err := Ingest(m, second); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, second.Len())
		})
		b.Run(s.Name+"/cold", func(b *testing.B) {
			b.SetBytes(int64(len(first.Records)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				if err := Ingest(NewModel(s.Level), first); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, first.Len())
		})
	}
}

func reportRate(b *testing.B, events int) {
	b.ReportMetric(float64(events)*float64(b.N)/b.Elapsed().Seconds()/1e6, "Mevents/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(events)/float64(b.N), "ns/event")
}
