package output

import (
	"github.com/npuprobe/npuprobe/allocmodel"
	"github.com/npuprobe/npuprobe/clock"
)

// ViewSource is a model View as a Source: each trace entry gets its unix
// time from conv as it is written (never decreasing within a device's
// trace, as clock.Stamper guarantees), so writing a snapshot needs no copy
// of the rings. The model must not change until the write returns.
func ViewSource(v *allocmodel.View, conv *clock.Converter) Source {
	sv := &stampedView{View: v}
	for range v.Devices() {
		sv.stampers = append(sv.stampers, conv.NewStamper())
	}
	return sv
}

type stampedView struct {
	*allocmodel.View
	stampers []*clock.Stamper
}

func (v *stampedView) SnapshotSegments() []allocmodel.Segment { return v.Segments }
func (v *stampedView) SnapshotPools() []allocmodel.PoolID     { return v.Pools }

func (v *stampedView) TraceEntry(dev, i int) allocmodel.TraceEntry {
	e := v.View.TraceEntry(dev, i)
	e.TimeUs = v.stampers[dev].Stamp(e.MonoNs)
	return e
}
