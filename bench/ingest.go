package bench

import (
	"github.com/npuprobe/npuprobe/agent"
	"github.com/npuprobe/npuprobe/allocmodel"
)

// DefaultMaxEntries is npuprobe's --max-entries default: the trace ring of
// each device.
const DefaultMaxEntries = 1_000_000

// Ingest runs what npuprobe's event loop does with each ring-buffer
// record, decode and apply, over a whole stream, into m.
func Ingest(m *allocmodel.Model, s *Stream) error {
	var ev allocmodel.Event
	recs := s.Records
	for off := 0; off+RecordSize <= len(recs); off += RecordSize {
		if err := agent.DecodeRecord(recs[off:off+RecordSize], &ev); err != nil {
			return err
		}
		m.Apply(&ev)
	}
	return nil
}

// NewModel is the model npuprobe builds for a traced process, with the
// default ring size.
func NewModel(level allocmodel.Level) *allocmodel.Model {
	return allocmodel.New(allocmodel.Config{Level: level, MaxEntries: DefaultMaxEntries})
}

// Half returns the first (i = 0) or second (i = 1) half of s's records.
func (s *Stream) Half(i int) *Stream {
	mid := s.Len() / 2 * RecordSize
	h := *s
	if i == 0 {
		h.Records = s.Records[:mid]
	} else {
		h.Records = s.Records[mid:]
	}
	return &h
}
