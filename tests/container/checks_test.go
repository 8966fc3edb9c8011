package container

import "github.com/npuprobe/npuprobe/tests/checks"

// The snapshot checks of tests/e2e: a snapshot must pass the independent
// Python checker, read the same with gopickle, and match the workload's own
// record of its calls, call for call.
type Snapshot = checks.Snapshot

var (
	loadSnapshot         = checks.LoadSnapshot
	segmentExpectations  = checks.SegmentExpectations
	matchTrace           = checks.MatchTrace
	checkSegmentSnapshot = checks.CheckSegmentSnapshot
	allCallsExpected     = checks.AllCallsExpected
	checkLiveSegments    = checks.CheckLiveSegments
)
