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

	// Virtual memory (expandable segments).
	CallReserveMemAddress Call = 8  // aclrtReserveMemAddress
	CallReleaseMemAddress Call = 9  // aclrtReleaseMemAddress
	CallMallocPhysical    Call = 10 // aclrtMallocPhysical
	CallFreePhysical      Call = 11 // aclrtFreePhysical
	CallMapMem            Call = 12 // aclrtMapMem
	CallUnmapMem          Call = 13 // aclrtUnmapMem

	// torch_npu's caching allocator (tensor level).
	CallTorchAllocate           Call = 16 // NpuCachingAllocator::allocate
	CallTorchLocalRawDelete     Call = 17 // local_raw_delete, every tensor's deleter
	CallTorchRawAlloc           Call = 18 // NpuCachingAllocator::raw_alloc
	CallTorchRawAllocWithStream Call = 19 // NpuCachingAllocator::raw_alloc_with_stream
	CallTorchRawDelete          Call = 20 // NpuCachingAllocator::raw_delete

	// Not allocator calls: the agent acts on them, the model ignores them.
	CallDlopen Call = 32 // dlopen of a runtime or torch_npu library
	CallExec   Call = 33 // a process image was replaced (--all)
)

var callNames = [...]string{
	CallMalloc:                  "aclrtMalloc",
	CallMallocAlign32:           "aclrtMallocAlign32",
	CallMallocCached:            "aclrtMallocCached",
	CallFree:                    "aclrtFree",
	CallSetDevice:               "aclrtSetDevice",
	CallGetDevice:               "aclrtGetDevice",
	CallGetMemInfo:              "aclrtGetMemInfo",
	CallReserveMemAddress:       "aclrtReserveMemAddress",
	CallReleaseMemAddress:       "aclrtReleaseMemAddress",
	CallMallocPhysical:          "aclrtMallocPhysical",
	CallFreePhysical:            "aclrtFreePhysical",
	CallMapMem:                  "aclrtMapMem",
	CallUnmapMem:                "aclrtUnmapMem",
	CallTorchAllocate:           "NpuCachingAllocator::allocate",
	CallTorchLocalRawDelete:     "local_raw_delete",
	CallTorchRawAlloc:           "NpuCachingAllocator::raw_alloc",
	CallTorchRawAllocWithStream: "NpuCachingAllocator::raw_alloc_with_stream",
	CallTorchRawDelete:          "NpuCachingAllocator::raw_delete",
	CallDlopen:                  "dlopen",
	CallExec:                    "exec",
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

// IsVMM reports whether c is one of the virtual-memory calls of expandable
// segments.
func (c Call) IsVMM() bool { return c >= CallReserveMemAddress && c <= CallUnmapMem }

// IsTensorAlloc reports whether c hands a block of the caching allocator
// to its caller.
func (c Call) IsTensorAlloc() bool {
	return c == CallTorchAllocate || c == CallTorchRawAlloc || c == CallTorchRawAllocWithStream
}

// IsTensorFree reports whether c returns a block to the caching allocator.
func (c Call) IsTensorFree() bool {
	return c == CallTorchLocalRawDelete || c == CallTorchRawDelete
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
//	runtime mallocs:   Addr = returned device pointer (Outcome Returned only), Size = requested size, Arg = policy
//	CallFree:          Addr = pointer being freed
//	CallSetDevice:     Arg = device
//	CallGetDevice:     Arg = device
//	CallGetMemInfo:    Arg = attr, Addr = free bytes, Size = total bytes
//	torch allocations: Addr = block pointer (0 for a zero-size request), Size = requested size,
//	                   Arg = DataPtr device (type<<8 | index; allocate only)
//	torch frees:       Addr = block pointer
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
	// Stopped: the process was stopped at this event (a runtime dlopen)
	// and waits for the agent to continue it.
	Stopped bool
	// Ctx describes the torch_npu allocation a runtime call was made for,
	// or, on a torch allocation, the stream and device it used.
	Ctx Context
}

// Context is what the BPF side knew about the caching-allocator call
// enclosing an event.
type Context struct {
	Valid     bool   // the event happened inside a torch_npu allocation
	Size      uint64 // that allocation's requested size
	HasStream bool
	Stream    uint64
	HasDevice bool
	Device    int
}

// LiveAllocation is one allocation the kernel saw made and not yet freed.
type LiveAllocation struct {
	Addr, Size uint64
	Stream     uint64 // 0 if unknown; for mappings, the physical handle
	Device     int    // -1 if unknown
	// ByAllocator: made inside torch_npu's caching allocator.
	ByAllocator bool
}

// LiveState is what a process holds according to the kernel's live map,
// which is complete even when records were lost.
type LiveState struct {
	Segments     []LiveAllocation // runtime allocations
	Blocks       []LiveAllocation // caching-allocator blocks handed out; Size is the request
	Mappings     []LiveAllocation // mapped page ranges
	Reservations []LiveAllocation // reserved virtual address ranges
}
