//go:build !amd64 && !arm64

package clock

// CounterName is empty: this architecture has no counter reader, and
// calibrations carry no counter reading.
const CounterName = ""

func readCounter() uint64 { return 0 }

func counterAvailable() bool { return false }
