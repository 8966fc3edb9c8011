package clock

// CounterName names the CPU counter this build reads.
const CounterName = "x86 TSC (LFENCE; RDTSC)"

// readCounter reads the time-stamp counter. The LFENCE keeps the read from
// being executed ahead of the clock reads that bracket it.
func readCounter() uint64

func counterAvailable() bool { return true }
