package e2e

import "github.com/npuprobe/npuprobe/tests/checks"

// The snapshot checks, shared with tests/container.
type (
	Snapshot   = checks.Snapshot
	Segment    = checks.Segment
	Block      = checks.Block
	TraceEntry = checks.TraceEntry
	expected   = checks.Expected
)

var (
	loadSnapshot          = checks.LoadSnapshot
	segmentExpectations   = checks.SegmentExpectations
	allocationSizesAtFree = checks.AllocationSizesAtFree
	matchTrace            = checks.MatchTrace
	checkWorkloadShape    = checks.CheckWorkloadShape
	checkSegmentSnapshot  = checks.CheckSegmentSnapshot
	allCallsExpected      = checks.AllCallsExpected
	checkLiveSegments     = checks.CheckLiveSegments
)
