//go:build ignore

// SPDX-License-Identifier: GPL-2.0
/*
 * npuprobe's kernel half: uprobes on the CANN runtime's device-memory API.
 *
 * Every program here does the least it can: filter by process, pair a call's
 * entry with its return, copy a few registers into one fixed-size record and
 * enqueue it. All interpretation (segments, devices, OOM bookkeeping, time
 * conversion) happens in user space, where it can be tested without a kernel.
 *
 * Invariants user space relies on:
 *  - Records from one CPU carry consecutive per-CPU sequence numbers; a record
 *    that could not be written still consumes its number, so a gap in one
 *    CPU's sequence marks where records were lost. The exact count of lost
 *    records is counters[NPU_CTR_RINGBUF_FULL] (see emit()).
 *  - The ring buffer delivers records in the order they were written across
 *    CPUs, which is the order the calls' effects became visible (frees are
 *    recorded at entry, before the memory can be handed out again;
 *    allocations at return, after the runtime chose the address).
 *  - ktime_ns is CLOCK_MONOTONIC (bpf_ktime_get_ns).
 *  - Only processes whose tgid is in traced_tgids produce records (with
 *    cfg_trace_all, every process reaching a probe is added to it).
 *  - The live map is updated whether or not the record could be written:
 *    it is what the agent resyncs from after losses.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "include/arch_regs.h"

char LICENSE[] SEC("license") = "GPL";

/* The functions we probe. Values are part of the record format. */
enum npu_fn {
	NPU_FN_MALLOC = 1,         /* aclrtMalloc(void **devPtr, size_t size, policy) */
	NPU_FN_MALLOC_ALIGN32 = 2, /* aclrtMallocAlign32(void **devPtr, size_t size, policy) */
	NPU_FN_MALLOC_CACHED = 3,  /* aclrtMallocCached(void **devPtr, size_t size, policy) */
	NPU_FN_FREE = 4,           /* aclrtFree(void *devPtr) */
	NPU_FN_SET_DEVICE = 5,     /* aclrtSetDevice(int32_t deviceId) */
	NPU_FN_GET_DEVICE = 6,     /* aclrtGetDevice(int32_t *deviceId) */
	NPU_FN_GET_MEM_INFO = 7,   /* aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total) */

	/* Virtual memory, used by expandable segments. */
	NPU_FN_RESERVE_MEM_ADDRESS = 8, /* aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr, uint64_t flags) */
	NPU_FN_RELEASE_MEM_ADDRESS = 9, /* aclrtReleaseMemAddress(void *virPtr) */
	NPU_FN_MALLOC_PHYSICAL = 10,    /* aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop, uint64_t flags) */
	NPU_FN_FREE_PHYSICAL = 11,      /* aclrtFreePhysical(aclrtDrvMemHandle handle) */
	NPU_FN_MAP_MEM = 12,            /* aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags) */
	NPU_FN_UNMAP_MEM = 13,          /* aclrtUnmapMem(void *virPtr) */

	/* torch_npu's caching allocator (c10_npu::NPUCachingAllocator), tensor level. */
	NPU_FN_TORCH_ALLOCATE = 16,          /* DataPtr NpuCachingAllocator::allocate(size_t) [sret] */
	NPU_FN_TORCH_LOCAL_RAW_DELETE = 17,  /* void local_raw_delete(void *ptr): every tensor's deleter */
	NPU_FN_TORCH_RAW_ALLOC = 18,         /* void *NpuCachingAllocator::raw_alloc(size_t) */
	NPU_FN_TORCH_RAW_ALLOC_STREAM = 19,  /* void *NpuCachingAllocator::raw_alloc_with_stream(size_t, aclrtStream) */
	NPU_FN_TORCH_RAW_DELETE = 20,        /* void NpuCachingAllocator::raw_delete(void *) */
	NPU_FN_TORCH_MALLOC = 21,            /* void NpuCachingAllocator::malloc(void **, int device, size_t, aclrtStream) */

	/* Processes and libraries appearing. */
	NPU_FN_DLOPEN = 32, /* dlopen(const char *filename, int flags) of a runtime or torch_npu library */
	NPU_FN_EXEC = 33,   /* sched_process_exec, --all only */
};

/* What a record reports about the call. */
enum npu_event_kind {
	NPU_EV_ENTRY = 1,   /* recorded at function entry (frees) */
	NPU_EV_RETURN = 2,  /* returned ACL_SUCCESS (or a torch call returned); outputs are valid */
	NPU_EV_FAILED = 3,  /* returned another error code (rc) */
	NPU_EV_OOM = 4,     /* an allocation returned ACL_ERROR_RT_MEMORY_ALLOCATION */
};

/* Flags in the record's flags field. */
enum npu_event_flag {
	/* ctx_* hold the torch_npu allocation this runtime call was made for:
	 * the calling thread was inside the caching allocator. */
	NPU_EVF_CTX = 1,
	/* ctx_stream holds a stream (the enclosing call carried one). */
	NPU_EVF_CTX_STREAM = 2,
	/* ctx_device holds a device. */
	NPU_EVF_CTX_DEVICE = 4,
	/* The process was stopped (SIGSTOP) so the agent can attach before it
	 * runs on: it must be continued (SIGCONT). */
	NPU_EVF_STOPPED = 8,
};

#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001

/*
 * One record, 80 bytes, the same layout on amd64 and arm64. Field meaning per
 * fn (all others zero):
 *   runtime mallocs:  addr = *devPtr (0 unless NPU_EV_RETURN), size, arg = policy
 *   aclrtFree:        addr = devPtr, size = the allocation's size if it was seen allocated
 *   set device:       arg = deviceId
 *   get device:       arg = *deviceId
 *   get mem info:     arg = attr, addr = *free, size = *total
 *   torch allocate:   addr = DataPtr data, size, arg = DataPtr device type << 8 | index
 *   torch raw_alloc*: addr = returned pointer, size
 *   torch deletes:    addr = pointer
 *   reserve:          addr = *virPtr, size, arg = flags
 *   release:         addr = virPtr
 *   unmap:            addr = virPtr, size = the mapping's size if it was seen mapped
 *   malloc physical:  addr = *handle, size, arg = prop->location.id | prop->memAttr << 32
 *   free physical:    addr = handle
 *   map:              addr = virPtr, size, arg = handle
 *   dlopen:           addr = the returned handle
 * Runtime mallocs, get mem info and torch allocations also carry ctx_* when
 * flags says so (see enum npu_event_flag); torch allocations take the
 * stream and device of the NpuCachingAllocator::malloc they made.
 */
struct npu_event {
	__u64 seq;      /* per-CPU sequence number, see above */
	__u64 ktime_ns; /* CLOCK_MONOTONIC at entry (NPU_EV_ENTRY) or return */
	__u64 addr;
	__u64 size;
	__u64 arg;
	__u64 ctx_stream;
	__u64 ctx_size;
	__u32 tgid;
	__u32 tid;
	__s32 rc;       /* aclError; 0 for NPU_EV_ENTRY */
	__s32 ctx_device;
	__u16 cpu;
	__u8 fn;        /* enum npu_fn */
	__u8 kind;      /* enum npu_event_kind */
	__u8 flags;     /* enum npu_event_flag */
	__u8 pad[3];
};
_Static_assert(sizeof(struct npu_event) == 80, "npu_event is part of the user-space ABI");

/*
 * Per-CPU counters. Kept per CPU so the hot path never contends on a shared
 * cache line; user space sums them.
 */
enum npu_counter {
	NPU_CTR_SEQ = 0,           /* next sequence number of this CPU */
	NPU_CTR_RINGBUF_FULL = 1,  /* records that could not be reserved */
	NPU_CTR_RETURN_UNPAIRED = 2, /* returns whose entry was not found (evicted, or attached mid-call) */
	NPU_CTR_PENDING_FULL = 3,  /* entries that could not be stored */
	NPU_CTR_READ_FAILED = 4,   /* output pointers that could not be read */
	NPU_CTR_LIVE_FULL = 5,     /* live allocations that could not be stored (resync is partial) */
	NPU_CTR_STOPPED = 6,       /* processes stopped at a runtime dlopen */
	NPU_CTR_MAX = 8,
};

/* The arguments of a call in flight, saved at entry for its return. */
struct pending_call {
	__u64 args[4];
};

/*
 * Each function whose entry is saved has a slot in its thread's
 * thread_calls, so calls of different probed functions may nest without
 * confusing the pairing.
 */
enum call_slot {
	SLOT_MALLOC,
	SLOT_MALLOC_ALIGN32,
	SLOT_MALLOC_CACHED,
	SLOT_SET_DEVICE,
	SLOT_GET_DEVICE,
	SLOT_GET_MEM_INFO,
	SLOT_RESERVE_MEM_ADDRESS,
	SLOT_MALLOC_PHYSICAL,
	SLOT_MAP_MEM,
	SLOT_TORCH_ALLOCATE,
	SLOT_TORCH_RAW_ALLOC,
	SLOT_TORCH_RAW_ALLOC_STREAM,
	SLOT_TORCH_MALLOC,
	SLOT_DLOPEN,
	NPU_CALL_SLOTS,
};

/* The slot of fn; fn is a constant wherever this is inlined, so the switch
 * folds away. */
static __always_inline int slot_of(__u8 fn)
{
	switch (fn) {
	case NPU_FN_MALLOC: return SLOT_MALLOC;
	case NPU_FN_MALLOC_ALIGN32: return SLOT_MALLOC_ALIGN32;
	case NPU_FN_MALLOC_CACHED: return SLOT_MALLOC_CACHED;
	case NPU_FN_SET_DEVICE: return SLOT_SET_DEVICE;
	case NPU_FN_GET_DEVICE: return SLOT_GET_DEVICE;
	case NPU_FN_GET_MEM_INFO: return SLOT_GET_MEM_INFO;
	case NPU_FN_RESERVE_MEM_ADDRESS: return SLOT_RESERVE_MEM_ADDRESS;
	case NPU_FN_MALLOC_PHYSICAL: return SLOT_MALLOC_PHYSICAL;
	case NPU_FN_MAP_MEM: return SLOT_MAP_MEM;
	case NPU_FN_TORCH_ALLOCATE: return SLOT_TORCH_ALLOCATE;
	case NPU_FN_TORCH_RAW_ALLOC: return SLOT_TORCH_RAW_ALLOC;
	case NPU_FN_TORCH_RAW_ALLOC_STREAM: return SLOT_TORCH_RAW_ALLOC_STREAM;
	case NPU_FN_TORCH_MALLOC: return SLOT_TORCH_MALLOC;
	case NPU_FN_DLOPEN: return SLOT_DLOPEN;
	}
	return -1;
}

/* A thread's calls in flight: bit s of valid says slots[s] holds one. */
struct thread_calls {
	__u32 valid;
	__u32 pad;
	struct pending_call slots[NPU_CALL_SLOTS];
};

/* Set by the agent before loading (constants the verifier folds away). */
/* --all: every process that reaches a probe is traced (added to traced_tgids). */
volatile const __u32 cfg_trace_all = 0;
/* Stop a watched process right after it dlopens the runtime or torch_npu. */
volatile const __u32 cfg_stop_on_load = 0;
/* Unread bytes past which every record wakes the reader (a quarter of the
 * ring buffer, set with its size). */
volatile const __u64 cfg_wakeup_bytes = 2 << 20;

/*
 * Set by the agent (before it attaches them) once any torch_npu probe is
 * attached. Until then no thread can be inside a caching-allocator call we
 * see, so runtime returns skip fill_ctx's four map lookups: at segment level
 * (torch_npu stripped, the common case) those were a sixth of the cost of a
 * traced aclrtMalloc. A global rather than a per-process flag: --all finds
 * processes in BPF before the agent has looked at their libraries.
 */
volatile __u32 torch_probes_attached = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	/* Resized by user space before loading (--ring-size); a power of two. */
	__uint(max_entries, 8 << 20);
} events SEC(".maps");

/*
 * Calls in flight, one element per thread (key: pid_tgid) written in place.
 * A call's entry then costs one inlined lookup and its return another, where
 * an element per call cost an update at entry and a lookup and a delete at
 * return: together a fifth of a traced aclrtMalloc (bench/bpf-profile).
 * A slot left valid by a frame that never returned (a C++ exception or
 * longjmp skips the uretprobe; the kernel caps return probes per task) is
 * overwritten by the thread's next call of that function. LRU, so exited
 * threads age out rather than fill the map. Task-local storage would free
 * them exactly, but needs Linux 5.11 and kernel BTF; npuprobe runs on 5.8.
 *
 * max_entries bounds the threads with probed calls at one time, across
 * every traced process: a training rank has a few hundred threads. Beyond
 * it the least recently used thread's element is evicted, its call in
 * flight counted unpaired at return (NPU_CTR_RETURN_UNPAIRED).
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u64);
	__type(value, struct thread_calls);
} thread_calls SEC(".maps");

/* The initial value of a thread's element: nothing in flight. */
static const struct thread_calls no_calls;

/*
 * Processes being traced (key: tgid in the root PID namespace, value unused).
 * Filtering here rather than in user space means untraced processes that
 * share the library cost one hash lookup and never touch the ring buffer.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
} traced_tgids SEC(".maps");

/*
 * The last NpuCachingAllocator::malloc each thread completed: its stream and
 * device, for the allocate/raw_alloc that made it, which carries neither.
 * LRU for the same reason as thread_calls.
 */
struct last_malloc {
	__u64 ptr;
	__u64 stream;
	__s32 device;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct last_malloc);
} last_mallocs SEC(".maps");

/*
 * What each traced process holds right now, kept in the kernel where no
 * record can be lost: if the ring buffer overflows, the agent rebuilds
 * segments and blocks from this map (resync). Keyed by process, kind and
 * address. Not preallocated: most processes hold far fewer than
 * max_entries, and a failed insert is counted (NPU_CTR_LIVE_FULL).
 */
enum live_kind {
	LIVE_SEGMENT = 1,     /* runtime allocation (aclrtMalloc*) */
	LIVE_BLOCK = 2,       /* caching-allocator block handed out (tensor level) */
	LIVE_MAPPING = 3,     /* mapped page range (aclrtMapMem) */
	LIVE_RESERVATION = 4, /* reserved VA range (aclrtReserveMemAddress) */
};

struct live_key {
	__u32 tgid;
	__u32 kind;
	__u64 addr;
};

struct live_val {
	__u64 size;
	__u64 stream;  /* ctx stream, 0 if unknown; the handle for mappings */
	__s32 device;  /* -1 if unknown */
	__u32 flags;   /* NPU_EVF_CTX* of the record that created it */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 20);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct live_key);
	__type(value, struct live_val);
} live SEC(".maps");

/*
 * Processes whose dlopen calls are watched because the runtime is not (or
 * not yet fully) loaded in them: value unused.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
} watched_tgids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NPU_CTR_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/*
 * Ring buffers carry untyped bytes, so nothing else puts struct npu_event into
 * the object's BTF; this reference does, letting bpf2go emit its Go type.
 */
const struct npu_event *npu_event_btf_anchor __attribute__((unused));

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &which);
	/*
	 * Atomic even though per-CPU: on preemptible kernels uprobe programs
	 * run with only migration disabled, so two threads' programs can
	 * interleave on one CPU. An add whose result is unused is a plain
	 * BPF_ATOMIC add, which every kernel with ring buffers accepts.
	 */
	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline int traced(__u64 pid_tgid)
{
	__u32 tgid = pid_tgid >> 32;
	if (bpf_map_lookup_elem(&traced_tgids, &tgid))
		return 1;
	if (!cfg_trace_all)
		return 0;
	/* --all: the first probe a process reaches makes it traced. */
	__u32 found_by_all = 2;
	bpf_map_update_elem(&traced_tgids, &tgid, &found_by_all, BPF_NOEXIST);
	return 1;
}

/*
 * Starts a record on the stack: takes this CPU's next sequence number (also
 * consumed if the record is then lost, which is what makes losses visible as
 * gaps) and the time.
 */
static __always_inline void init_event(struct npu_event *e, __u64 pid_tgid, __u8 fn, __u8 kind, __s32 rc)
{
	__builtin_memset(e, 0, sizeof(*e));
	__u32 key = NPU_CTR_SEQ;
	__u64 *seq = bpf_map_lookup_elem(&counters, &key);
	if (seq) {
		/*
		 * Not atomic: a fetching atomic would need Linux 5.12. On a
		 * preemptible kernel two programs interleaving on one CPU may
		 * then share a number; that can hide, never invent, a gap. The
		 * exact loss count is the atomic counter in emit().
		 */
		e->seq = *seq;
		*seq = e->seq + 1;
	}
	e->ktime_ns = bpf_ktime_get_ns();
	e->tgid = pid_tgid >> 32;
	e->tid = (__u32)pid_tgid;
	e->rc = rc;
	e->cpu = (__u16)bpf_get_smp_processor_id();
	e->fn = fn;
	e->kind = kind;
}

/*
 * Copies the record into the ring buffer, or counts it lost.
 *
 * Most records do not wake the reader: a wakeup per record costs more than
 * the rest of the program (on a VM, an exit per record), and the reader
 * polls every 100 ms anyway. Records someone waits for wake it at once (an
 * OOM, whose snapshot is due now; a process stopped at a dlopen; an exec),
 * and so does any record once the unread data passes cfg_wakeup_bytes, so
 * the buffer is drained long before it fills.
 */
static __always_inline void emit(struct npu_event *e)
{
	__u64 flags = BPF_RB_NO_WAKEUP;
	if (e->kind == NPU_EV_OOM || e->fn == NPU_FN_DLOPEN || e->fn == NPU_FN_EXEC ||
	    bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= cfg_wakeup_bytes)
		flags = BPF_RB_FORCE_WAKEUP;
	if (bpf_ringbuf_output(&events, e, sizeof(*e), flags))
		count(NPU_CTR_RINGBUF_FULL);
}

/* The calling thread's element, created on its first saved call. */
static __always_inline struct thread_calls *calls_of(__u64 pid_tgid)
{
	struct thread_calls *c = bpf_map_lookup_elem(&thread_calls, &pid_tgid);
	if (c)
		return c;
	/* The thread's first saved call: an element with no slot valid. Only
	 * this thread creates its element, so none can have appeared since
	 * the lookup; BPF_NOEXIST would keep it if one had. */
	bpf_map_update_elem(&thread_calls, &pid_tgid, &no_calls, BPF_NOEXIST);
	return bpf_map_lookup_elem(&thread_calls, &pid_tgid);
}

/*
 * Saves a call's arguments for its return. Only the calling thread writes
 * its element, so no lock is needed; the one hazard is an element evicted
 * (more threads than max_entries) and handed to another thread between the
 * lookup and the writes, which then sees a call it did not make.
 */
static __always_inline void save_call(__u64 pid_tgid, __u8 fn, __u64 a0, __u64 a1, __u64 a2, __u64 a3)
{
	int s = slot_of(fn);
	if (s < 0 || s >= NPU_CALL_SLOTS)
		return;
	struct thread_calls *c = calls_of(pid_tgid);
	if (!c) {
		count(NPU_CTR_PENDING_FULL);
		return;
	}
	struct pending_call *slot = &c->slots[s];
	slot->args[0] = a0;
	slot->args[1] = a1;
	slot->args[2] = a2;
	slot->args[3] = a3;
	c->valid |= 1u << s;
}

static __always_inline int save_entry(__u8 fn, __u64 a0, __u64 a1, __u64 a2, __u64 a3)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid))
		return 0;
	save_call(pid_tgid, fn, a0, a1, a2, a3);
	return 0;
}

/* Copies out and clears the entry of the call of fn now returning. */
static __always_inline int take_call(__u64 pid_tgid, __u8 fn, struct pending_call *out)
{
	int s = slot_of(fn);
	if (s < 0 || s >= NPU_CALL_SLOTS)
		return -1;
	struct thread_calls *c = bpf_map_lookup_elem(&thread_calls, &pid_tgid);
	if (!c || !(c->valid & (1u << s)))
		return -1;
	*out = c->slots[s];
	c->valid &= ~(1u << s);
	return 0;
}

/*
 * take_call for the runtime and torch return probes. An entry is saved only
 * for traced processes, so finding one is the process filter too: the return
 * skips traced()'s lookup, an eighth of a malloc return. Only a miss asks
 * whether the process is traced, to count the miss.
 */
static __always_inline int take_entry(__u64 pid_tgid, __u8 fn, struct pending_call *out)
{
	if (take_call(pid_tgid, fn, out)) {
		if (traced(pid_tgid))
			count(NPU_CTR_RETURN_UNPAIRED);
		return -1;
	}
	return 0;
}

static __always_inline __u64 read_user_u64(__u64 uptr)
{
	__u64 v = 0;
	if (bpf_probe_read_user(&v, sizeof(v), (const void *)uptr))
		count(NPU_CTR_READ_FAILED);
	return v;
}

static __always_inline __u32 read_user_u32(__u64 uptr)
{
	__u32 v = 0;
	if (bpf_probe_read_user(&v, sizeof(v), (const void *)uptr))
		count(NPU_CTR_READ_FAILED);
	return v;
}

static __always_inline void live_put(__u64 pid_tgid, __u32 kind, __u64 addr, __u64 size, __u64 stream, __s32 device, __u32 flags)
{
	struct live_key k = {.tgid = pid_tgid >> 32, .kind = kind, .addr = addr};
	struct live_val v = {.size = size, .stream = stream, .device = device, .flags = flags};
	if (bpf_map_update_elem(&live, &k, &v, BPF_ANY))
		count(NPU_CTR_LIVE_FULL);
}

static __always_inline void live_del(__u64 pid_tgid, __u32 kind, __u64 addr)
{
	struct live_key k = {.tgid = pid_tgid >> 32, .kind = kind, .addr = addr};
	bpf_map_delete_elem(&live, &k);
}

/*
 * Fills ctx_* from the torch_npu allocation the thread is inside, if any:
 * the runtime call is then the caching allocator getting memory (or, for
 * aclrtGetMemInfo, its out-of-memory path). The innermost entry point that
 * carries the most is preferred.
 */
static __always_inline void fill_ctx(struct npu_event *e, __u64 pid_tgid)
{
	if (!torch_probes_attached)
		return;
	struct thread_calls *c = bpf_map_lookup_elem(&thread_calls, &pid_tgid);
	if (!c)
		return;
	if (c->valid & (1u << SLOT_TORCH_MALLOC)) { /* devPtr, device, size, stream */
		struct pending_call *m = &c->slots[SLOT_TORCH_MALLOC];
		e->ctx_device = (__s32)m->args[1];
		e->ctx_size = m->args[2];
		e->ctx_stream = m->args[3];
		e->flags |= NPU_EVF_CTX | NPU_EVF_CTX_STREAM | NPU_EVF_CTX_DEVICE;
		return;
	}
	if (c->valid & (1u << SLOT_TORCH_RAW_ALLOC_STREAM)) { /* size, stream */
		e->ctx_size = c->slots[SLOT_TORCH_RAW_ALLOC_STREAM].args[0];
		e->ctx_stream = c->slots[SLOT_TORCH_RAW_ALLOC_STREAM].args[1];
		e->flags |= NPU_EVF_CTX | NPU_EVF_CTX_STREAM;
		return;
	}
	if (c->valid & (1u << SLOT_TORCH_ALLOCATE)) { /* sret, size */
		e->ctx_size = c->slots[SLOT_TORCH_ALLOCATE].args[1];
		e->flags |= NPU_EVF_CTX;
		return;
	}
	if (c->valid & (1u << SLOT_TORCH_RAW_ALLOC)) { /* size */
		e->ctx_size = c->slots[SLOT_TORCH_RAW_ALLOC].args[0];
		e->flags |= NPU_EVF_CTX;
	}
}

static __always_inline __s32 ctx_device_or_unknown(struct npu_event *e)
{
	return (e->flags & NPU_EVF_CTX_DEVICE) ? e->ctx_device : -1;
}

static __always_inline __u8 outcome(__s32 rc)
{
	if (rc == 0)
		return NPU_EV_RETURN;
	return rc == ACL_ERROR_RT_MEMORY_ALLOCATION ? NPU_EV_OOM : NPU_EV_FAILED;
}

/* Records a call at its entry with its first argument as the address. */
static __always_inline int record_entry(__u8 fn, __u64 addr)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid))
		return 0;
	struct npu_event e;
	init_event(&e, pid_tgid, fn, NPU_EV_ENTRY, 0);
	e.addr = addr;
	switch (fn) {
	case NPU_FN_FREE: {
		/* The size, known if the allocation was seen (even if its own
		 * record was lost). */
		struct live_key k = {.tgid = pid_tgid >> 32, .kind = LIVE_SEGMENT, .addr = addr};
		struct live_val *v = bpf_map_lookup_elem(&live, &k);
		if (v)
			e.size = v->size;
		bpf_map_delete_elem(&live, &k);
		break;
	}
	case NPU_FN_RELEASE_MEM_ADDRESS:
		live_del(pid_tgid, LIVE_RESERVATION, addr);
		break;
	case NPU_FN_UNMAP_MEM: {
		/* The call carries no size: the mapping's, from the live map. */
		struct live_key k = {.tgid = pid_tgid >> 32, .kind = LIVE_MAPPING, .addr = addr};
		struct live_val *v = bpf_map_lookup_elem(&live, &k);
		if (v)
			e.size = v->size;
		bpf_map_delete_elem(&live, &k);
		break;
	}
	case NPU_FN_TORCH_LOCAL_RAW_DELETE:
	case NPU_FN_TORCH_RAW_DELETE:
		live_del(pid_tgid, LIVE_BLOCK, addr);
		break;
	}
	emit(&e);
	return 0;
}

/* --- device-memory allocation: aclrtMalloc, aclrtMallocAlign32, aclrtMallocCached --- */

static __always_inline int malloc_entry(struct npu_regs *ctx, __u8 fn)
{
	/* devPtr, size, policy (a 32-bit enum: only the low half is defined). */
	return save_entry(fn, NPU_ARG0(ctx), NPU_ARG1(ctx), (__u32)NPU_ARG2(ctx), 0);
}

static __always_inline int malloc_return(struct npu_regs *ctx, __u8 fn)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, fn, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx); /* aclError is an int: upper half undefined */
	struct npu_event e;
	init_event(&e, pid_tgid, fn, outcome(rc), rc);
	e.size = call.args[1];
	e.arg = call.args[2];
	fill_ctx(&e, pid_tgid);
	/* *devPtr is defined only on success. */
	if (rc == 0) {
		e.addr = read_user_u64(call.args[0]);
		live_put(pid_tgid, LIVE_SEGMENT, e.addr, e.size, e.ctx_stream, ctx_device_or_unknown(&e), e.flags);
	}
	emit(&e);
	return 0;
}

SEC("uprobe/aclrtMalloc")
int uprobe_aclrt_malloc(struct npu_regs *ctx) { return malloc_entry(ctx, NPU_FN_MALLOC); }

SEC("uretprobe/aclrtMalloc")
int uretprobe_aclrt_malloc(struct npu_regs *ctx) { return malloc_return(ctx, NPU_FN_MALLOC); }

SEC("uprobe/aclrtMallocAlign32")
int uprobe_aclrt_malloc_align32(struct npu_regs *ctx) { return malloc_entry(ctx, NPU_FN_MALLOC_ALIGN32); }

SEC("uretprobe/aclrtMallocAlign32")
int uretprobe_aclrt_malloc_align32(struct npu_regs *ctx) { return malloc_return(ctx, NPU_FN_MALLOC_ALIGN32); }

SEC("uprobe/aclrtMallocCached")
int uprobe_aclrt_malloc_cached(struct npu_regs *ctx) { return malloc_entry(ctx, NPU_FN_MALLOC_CACHED); }

SEC("uretprobe/aclrtMallocCached")
int uretprobe_aclrt_malloc_cached(struct npu_regs *ctx) { return malloc_return(ctx, NPU_FN_MALLOC_CACHED); }

/*
 * Frees are recorded at entry, not return: the runtime may hand the same
 * address to another thread the moment it is freed, and that thread's
 * allocation record must come after this one in the ring.
 */
SEC("uprobe/aclrtFree")
int uprobe_aclrt_free(struct npu_regs *ctx) { return record_entry(NPU_FN_FREE, NPU_ARG0(ctx)); }

/* --- the calling thread's device --- */

SEC("uprobe/aclrtSetDevice")
int uprobe_aclrt_set_device(struct npu_regs *ctx)
{
	return save_entry(NPU_FN_SET_DEVICE, (__u32)NPU_ARG0(ctx), 0, 0, 0);
}

SEC("uretprobe/aclrtSetDevice")
int uretprobe_aclrt_set_device(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_SET_DEVICE, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx);
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_SET_DEVICE, rc ? NPU_EV_FAILED : NPU_EV_RETURN, rc);
	e.arg = call.args[0];
	emit(&e);
	return 0;
}

SEC("uprobe/aclrtGetDevice")
int uprobe_aclrt_get_device(struct npu_regs *ctx)
{
	return save_entry(NPU_FN_GET_DEVICE, NPU_ARG0(ctx), 0, 0, 0);
}

SEC("uretprobe/aclrtGetDevice")
int uretprobe_aclrt_get_device(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_GET_DEVICE, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx);
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_GET_DEVICE, rc ? NPU_EV_FAILED : NPU_EV_RETURN, rc);
	if (!rc)
		e.arg = read_user_u32(call.args[0]);
	emit(&e);
	return 0;
}

/* --- aclrtGetMemInfo: the free-bytes figure of an OOM --- */

SEC("uprobe/aclrtGetMemInfo")
int uprobe_aclrt_get_mem_info(struct npu_regs *ctx)
{
	return save_entry(NPU_FN_GET_MEM_INFO, (__u32)NPU_ARG0(ctx), NPU_ARG1(ctx), NPU_ARG2(ctx), 0);
}

SEC("uretprobe/aclrtGetMemInfo")
int uretprobe_aclrt_get_mem_info(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_GET_MEM_INFO, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx);
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_GET_MEM_INFO, rc ? NPU_EV_FAILED : NPU_EV_RETURN, rc);
	e.arg = call.args[0];
	if (!rc) {
		e.addr = read_user_u64(call.args[1]);
		e.size = read_user_u64(call.args[2]);
	}
	fill_ctx(&e, pid_tgid);
	emit(&e);
	return 0;
}

/* --- virtual memory: expandable segments --- */

SEC("uprobe/aclrtReserveMemAddress")
int uprobe_aclrt_reserve_mem_address(struct npu_regs *ctx)
{
	/* virPtr, size, alignment, expectPtr, flags */
	return save_entry(NPU_FN_RESERVE_MEM_ADDRESS, NPU_ARG0(ctx), NPU_ARG1(ctx), NPU_ARG4(ctx), 0);
}

SEC("uretprobe/aclrtReserveMemAddress")
int uretprobe_aclrt_reserve_mem_address(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_RESERVE_MEM_ADDRESS, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx);
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_RESERVE_MEM_ADDRESS, outcome(rc), rc);
	e.size = call.args[1];
	e.arg = call.args[2];
	fill_ctx(&e, pid_tgid);
	if (!rc) {
		e.addr = read_user_u64(call.args[0]);
		live_put(pid_tgid, LIVE_RESERVATION, e.addr, e.size, e.ctx_stream, ctx_device_or_unknown(&e), e.flags);
	}
	emit(&e);
	return 0;
}

SEC("uprobe/aclrtReleaseMemAddress")
int uprobe_aclrt_release_mem_address(struct npu_regs *ctx) { return record_entry(NPU_FN_RELEASE_MEM_ADDRESS, NPU_ARG0(ctx)); }

SEC("uprobe/aclrtMallocPhysical")
int uprobe_aclrt_malloc_physical(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid))
		return 0;
	/* The device is prop->location.id (+12), the memory kind prop->memAttr
	 * (+8): read them now, the caller may reuse prop afterwards. */
	__u64 prop = NPU_ARG2(ctx);
	__u64 dev = read_user_u32(prop + 12);
	__u64 attr = read_user_u32(prop + 8);
	return save_entry(NPU_FN_MALLOC_PHYSICAL, NPU_ARG0(ctx), NPU_ARG1(ctx), dev | (attr << 32), 0);
}

SEC("uretprobe/aclrtMallocPhysical")
int uretprobe_aclrt_malloc_physical(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_MALLOC_PHYSICAL, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx);
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_MALLOC_PHYSICAL, outcome(rc), rc);
	e.size = call.args[1];
	e.arg = call.args[2];
	fill_ctx(&e, pid_tgid);
	if (!rc)
		e.addr = read_user_u64(call.args[0]);
	emit(&e);
	return 0;
}

SEC("uprobe/aclrtFreePhysical")
int uprobe_aclrt_free_physical(struct npu_regs *ctx) { return record_entry(NPU_FN_FREE_PHYSICAL, NPU_ARG0(ctx)); }

SEC("uprobe/aclrtMapMem")
int uprobe_aclrt_map_mem(struct npu_regs *ctx)
{
	/* virPtr, size, offset, handle, flags */
	return save_entry(NPU_FN_MAP_MEM, NPU_ARG0(ctx), NPU_ARG1(ctx), NPU_ARG3(ctx), 0);
}

/* Recorded at return: a mapping exists once the call succeeded. */
SEC("uretprobe/aclrtMapMem")
int uretprobe_aclrt_map_mem(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_MAP_MEM, &call))
		return 0;
	__s32 rc = (__s32)NPU_RET(ctx);
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_MAP_MEM, outcome(rc), rc);
	e.addr = call.args[0];
	e.size = call.args[1];
	e.arg = call.args[2];
	fill_ctx(&e, pid_tgid);
	if (!rc)
		live_put(pid_tgid, LIVE_MAPPING, e.addr, e.size, e.arg, ctx_device_or_unknown(&e), e.flags);
	emit(&e);
	return 0;
}

/* At entry, like frees: the range can be mapped again as soon as it is unmapped. */
SEC("uprobe/aclrtUnmapMem")
int uprobe_aclrt_unmap_mem(struct npu_regs *ctx) { return record_entry(NPU_FN_UNMAP_MEM, NPU_ARG0(ctx)); }

/* --- torch_npu's caching allocator: tensor level ---
 *
 * No uretprobes here. A uretprobe replaces the return address on the stack
 * with a trampoline that has no unwind information, so a C++ exception
 * thrown through the probed frame (allocate throws OutOfMemoryError) makes
 * the unwinder give up and std::terminate the process. The *_return
 * programs are instead plain uprobes that the agent attaches at every
 * return instruction of the function; at that point the return value is in
 * its register and an exception never passes through them.
 */

/*
 * A new allocation on this thread means any earlier one is over, even if
 * it ended by a C++ exception (the OOM path throws) that skipped its return
 * site: drop its stale malloc entry so it cannot lend its context to later
 * runtime calls.
 */
static __always_inline void forget_torch_malloc(__u64 pid_tgid)
{
	struct thread_calls *c = bpf_map_lookup_elem(&thread_calls, &pid_tgid);
	if (c)
		c->valid &= ~(1u << SLOT_TORCH_MALLOC);
}

/* Copies stream and device of the malloc that produced ptr on this thread. */
static __always_inline void fill_from_last_malloc(struct npu_event *e, __u64 pid_tgid, __u64 ptr)
{
	struct last_malloc *m = bpf_map_lookup_elem(&last_mallocs, &pid_tgid);
	if (!m || m->ptr != ptr)
		return;
	e->ctx_stream = m->stream;
	e->ctx_device = m->device;
	e->flags |= NPU_EVF_CTX_STREAM | NPU_EVF_CTX_DEVICE;
	bpf_map_delete_elem(&last_mallocs, &pid_tgid);
}

/* Device index of a tensor allocation: the DataPtr's, else its malloc's. */
static __always_inline __s32 block_device(struct npu_event *e)
{
	if ((e->arg >> 8) == 20) /* c10::DeviceType::PrivateUse1 */
		return (__s32)(e->arg & 0xff);
	return ctx_device_or_unknown(e);
}

/*
 * NpuCachingAllocator::allocate(size_t) is virtual and returns a c10::DataPtr
 * (non-trivial destructor) through a hidden result pointer. libtorch reaches
 * it through the c10::Allocator vtable, so no caller can have it inlined.
 */
SEC("uprobe/torch_allocate")
int uprobe_torch_allocate(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid))
		return 0;
	forget_torch_malloc(pid_tgid);
	return save_entry(NPU_FN_TORCH_ALLOCATE, NPU_SRET(ctx), NPU_SRET_ARG(ctx, 1), 0, 0);
}

SEC("uprobe/torch_allocate_return")
int uprobe_torch_allocate_return(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_TORCH_ALLOCATE, &call))
		return 0;
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_TORCH_ALLOCATE, NPU_EV_RETURN, 0);
	/* DataPtr: data pointer at 0, device {int8 type, int8 index} at 24. */
	__u64 sret = call.args[0];
	e.addr = read_user_u64(sret);
	__u8 dev[2] = {0, 0};
	if (bpf_probe_read_user(dev, sizeof(dev), (const void *)(sret + 24)))
		count(NPU_CTR_READ_FAILED);
	e.arg = ((__u64)dev[0] << 8) | dev[1];
	e.size = call.args[1];
	fill_from_last_malloc(&e, pid_tgid, e.addr);
	if (e.addr)
		live_put(pid_tgid, LIVE_BLOCK, e.addr, e.size, e.ctx_stream, block_device(&e), e.flags);
	emit(&e);
	return 0;
}

/* Every tensor's DataPtr calls it through a stored function pointer. */
SEC("uprobe/torch_local_raw_delete")
int uprobe_torch_local_raw_delete(struct npu_regs *ctx) { return record_entry(NPU_FN_TORCH_LOCAL_RAW_DELETE, NPU_ARG0(ctx)); }

static __always_inline int raw_alloc_entry(struct npu_regs *ctx, __u8 fn)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!traced(pid_tgid))
		return 0;
	forget_torch_malloc(pid_tgid);
	/* this, size[, stream] */
	return save_entry(fn, NPU_ARG1(ctx), NPU_ARG2(ctx), 0, 0);
}

static __always_inline int raw_alloc_return(struct npu_regs *ctx, __u8 fn)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, fn, &call))
		return 0;
	struct npu_event e;
	init_event(&e, pid_tgid, fn, NPU_EV_RETURN, 0);
	e.addr = NPU_RET(ctx);
	e.size = call.args[0];
	if (fn == NPU_FN_TORCH_RAW_ALLOC_STREAM) {
		e.ctx_stream = call.args[1];
		e.flags |= NPU_EVF_CTX_STREAM;
	}
	fill_from_last_malloc(&e, pid_tgid, e.addr);
	if (e.addr)
		live_put(pid_tgid, LIVE_BLOCK, e.addr, e.size, e.ctx_stream, block_device(&e), e.flags);
	emit(&e);
	return 0;
}

SEC("uprobe/torch_raw_alloc")
int uprobe_torch_raw_alloc(struct npu_regs *ctx) { return raw_alloc_entry(ctx, NPU_FN_TORCH_RAW_ALLOC); }

SEC("uprobe/torch_raw_alloc_return")
int uprobe_torch_raw_alloc_return(struct npu_regs *ctx) { return raw_alloc_return(ctx, NPU_FN_TORCH_RAW_ALLOC); }

SEC("uprobe/torch_raw_alloc_with_stream")
int uprobe_torch_raw_alloc_with_stream(struct npu_regs *ctx) { return raw_alloc_entry(ctx, NPU_FN_TORCH_RAW_ALLOC_STREAM); }

SEC("uprobe/torch_raw_alloc_with_stream_return")
int uprobe_torch_raw_alloc_with_stream_return(struct npu_regs *ctx) { return raw_alloc_return(ctx, NPU_FN_TORCH_RAW_ALLOC_STREAM); }

SEC("uprobe/torch_raw_delete")
int uprobe_torch_raw_delete(struct npu_regs *ctx) { return record_entry(NPU_FN_TORCH_RAW_DELETE, NPU_ARG1(ctx)); /* this, ptr */ }

/*
 * NpuCachingAllocator::malloc is called directly and may be inlined into
 * some callers, so it is never the source of an allocation record: it only
 * supplies the stream and device its callers do not carry. Records nothing.
 */
SEC("uprobe/torch_malloc")
int uprobe_torch_malloc(struct npu_regs *ctx)
{
	/* this, devPtr, device, size, stream */
	return save_entry(NPU_FN_TORCH_MALLOC, NPU_ARG1(ctx), (__u64)(__s64)(__s32)NPU_ARG2(ctx), NPU_ARG3(ctx), NPU_ARG4(ctx));
}

SEC("uprobe/torch_malloc_return")
int uprobe_torch_malloc_return(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct pending_call call;
	if (take_entry(pid_tgid, NPU_FN_TORCH_MALLOC, &call))
		return 0;
	struct last_malloc m = {
		.ptr = read_user_u64(call.args[0]),
		.stream = call.args[3],
		.device = (__s32)call.args[1],
	};
	bpf_map_update_elem(&last_mallocs, &pid_tgid, &m, BPF_ANY);
	return 0;
}

/* --- libraries loaded late: dlopen of the runtime or torch_npu --- */

#define NAME_BUF 256
#define NAME_SCAN (NAME_BUF - 16)

static __always_inline int match_at(const char *s, int i, const char *pat, int n)
{
	for (int k = 0; k < n; k++)
		if (s[i + k] != pat[k])
			return 0;
	return 1;
}

/* Whether a dlopen()ed name is one whose loading npuprobe must act on. */
static __always_inline int names_npu_library(const char *name)
{
	for (int i = 0; i < NAME_SCAN; i++) {
		char c = name[i];
		if (c == 0)
			return 0;
		if (c == 'a' && (match_at(name, i, "ascendcl", 8) || match_at(name, i, "acl_rt", 6)))
			return 1;
		if (c == 't' && match_at(name, i, "torch_npu", 9))
			return 1;
	}
	return 0;
}

static __always_inline int watched(__u64 pid_tgid)
{
	__u32 tgid = pid_tgid >> 32;
	return cfg_trace_all || bpf_map_lookup_elem(&watched_tgids, &tgid) != 0;
}

SEC("uprobe/dlopen")
int uprobe_dlopen(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!watched(pid_tgid))
		return 0;
	save_call(pid_tgid, NPU_FN_DLOPEN, NPU_ARG0(ctx), 0, 0, 0);
	return 0;
}

/*
 * dlopen has returned: the library and its dependencies are mapped and
 * initialised, and the process is about to call into them. With
 * cfg_stop_on_load the process is stopped here, so that the agent can
 * attach before its first call, and continued by the agent.
 */
SEC("uretprobe/dlopen")
int uretprobe_dlopen(struct npu_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!watched(pid_tgid))
		return 0;
	struct pending_call call;
	if (take_call(pid_tgid, NPU_FN_DLOPEN, &call))
		return 0;
	__u64 name_ptr = call.args[0];
	__u64 handle = NPU_RET(ctx);
	if (!handle || !name_ptr)
		return 0;
	char name[NAME_BUF];
	if (bpf_probe_read_user_str(name, sizeof(name), (const void *)name_ptr) <= 0)
		return 0;
	if (!names_npu_library(name))
		return 0;
	struct npu_event e;
	init_event(&e, pid_tgid, NPU_FN_DLOPEN, NPU_EV_RETURN, 0);
	e.addr = handle;
	if (cfg_stop_on_load && bpf_send_signal(19 /* SIGSTOP */) == 0) {
		e.flags |= NPU_EVF_STOPPED;
		count(NPU_CTR_STOPPED);
	}
	emit(&e);
	return 0;
}

/* --all: a process image was replaced; the agent looks at its libraries. */
SEC("tracepoint/sched/sched_process_exec")
int tracepoint_sched_process_exec(void *ctx)
{
	if (!cfg_trace_all)
		return 0;
	struct npu_event e;
	init_event(&e, bpf_get_current_pid_tgid(), NPU_FN_EXEC, NPU_EV_ENTRY, 0);
	emit(&e);
	return 0;
}

/* The benchmark's floor: attached where npuprobe attaches, does nothing. */
SEC("uprobe/noop")
int uprobe_noop(void *ctx) { return 0; }
