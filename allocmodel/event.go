package allocmodel

// Call names the runtime function an Event reports. The values match the
// BPF programs' enum npu_fn; package agent translates between the two and a
// test keeps them in step.
type Call uint8

const (
	CallMalloc        Call = 1 // aclrtMalloc
	CallMallocAlign32 Call = 2 // aclrtMallocAlign32
	CallMallocCached  Call = 3 // aclrtMallocCached
	CallFree          Call = 4 // aclrtFree
	CallSetDevice     Call = 5 // aclrtSetDevice
	CallGetDevice     Call = 6 // aclrtGetDevice
	CallGetMemInfo    Call = 7 // aclrtGetMemInfo
)

var callNames = [...]string{
	CallMalloc:        "aclrtMalloc",
	CallMallocAlign32: "aclrtMallocAlign32",
	CallMallocCached:  "aclrtMallocCached",
	CallFree:          "aclrtFree",
	CallSetDevice:     "aclrtSetDevice",
	CallGetDevice:     "aclrtGetDevice",
	CallGetMemInfo:    "aclrtGetMemInfo",
}

func (c Call) String() string {
	if int(c) < len(callNames) && callNames[c] != "" {
		return callNames[c]
	}
	return "call?"
}

// IsMalloc reports whether c obtains device memory from the runtime.
func (c Call) IsMalloc() bool {
	return c == CallMalloc || c == CallMallocAlign32 || c == CallMallocCached
}

// Outcome says at which point of a call an Event was recorded and how the
// call ended.
type Outcome uint8

const (
	OutcomeEntry    Outcome = 1 // recorded at entry (frees): the call had not run yet
	OutcomeReturned Outcome = 2 // returned ACL_SUCCESS
	OutcomeFailed   Outcome = 3 // returned another error code
	OutcomeOOM      Outcome = 4 // an allocation returned ACL_ERROR_RT_MEMORY_ALLOCATION
)

// ACL error codes the model interprets.
const (
	ACLSuccess               = 0
	ACLErrorMemoryAllocation = 207001 // ACL_ERROR_RT_MEMORY_ALLOCATION: out of device memory
)

// Event is one observed runtime call, decoded from a BPF record. It is the
// model's only input.
//
// Field meaning per Call (others are zero):
//
//	mallocs:       Addr = returned device pointer (Outcome Returned only), Size = requested size, Arg = policy
//	CallFree:      Addr = pointer being freed
//	CallSetDevice: Arg = device
//	CallGetDevice: Arg = device
//	CallGetMemInfo: Arg = attr, Addr = free bytes, Size = total bytes
type Event struct {
	Seq     uint64 // per-CPU sequence number
	MonoNs  int64  // CLOCK_MONOTONIC when recorded
	Addr    uint64
	Size    uint64
	Arg     uint64
	Tgid    uint32
	Tid     uint32
	CPU     uint16
	Call    Call
	Outcome Outcome
	RC      int32
}
