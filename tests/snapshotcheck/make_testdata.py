#!/usr/bin/env python3
"""Writes the hand-made snapshots in testdata/.

Run from anywhere: ``python3 make_testdata.py``.  Every builder returns a fresh
object tree, so no two files (and no two entries, unless a case wants it)
share objects.  All files use ``protocol=4`` except the protocol-2 and
protocol-5 cases, which exist to test exactly that.

valid_*   must pass check_snapshot.py (also with --expect-time)
invalid_* each breaks one rule; check_snapshot_test.py lists the expected code
"""

from __future__ import annotations

import os
import pickle

TESTDATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'testdata')

MiB = 1 << 20

# §13 worked example constants.
SEG = 0x12C040000000           # segment base (illustrative device VA, < 2**53)
STREAM = 0xAAAAD1E2F3A0        # aclrtStream pointer value as int
T0 = 1767225600000000          # 2026-01-01T00:00:00Z in µs


def trace_entry(action: str, addr: int, size: int, time_us: int,
                stream: int = STREAM) -> dict:
    return {'action': action, 'addr': addr, 'size': size,
            'stream': stream, 'pool_id': (0, 0), 'time_us': time_us}


def worked_example() -> dict:
    """The spec's §13 example: one small-pool 2 MiB segment, tensors of 4096 B
    (freed) and 1000 B (live)."""
    return {
        'segments': [{
            'device': 0,
            'address': SEG,
            'total_size': 2097152,
            'allocated_size': 1536,
            'active_size': 1536,
            'requested_size': 1000,
            'stream': STREAM,
            'segment_type': 'small',
            'segment_pool_id': (0, 0),
            'is_expandable': False,
            'frames': [],
            'blocks': [
                {'address': SEG, 'size': 4608, 'requested_size': 4096,
                 'state': 'inactive', 'frames': []},
                {'address': SEG + 0x1200, 'size': 1536, 'requested_size': 1000,
                 'state': 'active_allocated', 'frames': []},
                {'address': SEG + 0x1800, 'size': 2091008, 'requested_size': 0,
                 'state': 'inactive', 'frames': []},
            ],
        }],
        'device_traces': [[
            trace_entry('segment_alloc', SEG, 2097152, T0),
            trace_entry('alloc', SEG, 4096, T0 + 12),
            trace_entry('alloc', SEG + 0x1200, 1000, T0 + 40),
            trace_entry('free_requested', SEG, 4096, T0 + 95),
            trace_entry('free_completed', SEG, 4096, T0 + 95),
        ]],
    }


def expandable_two_devices() -> dict:
    """Device 0 has nothing (not offered); device 1 uses expandable segments:
    two segment_map steps growing one range, a block spanning the map boundary
    that is pending-free at the end (unmerged free_requested), a second range
    mapped, used and unmapped again, shared frames, and an oom and a snapshot
    entry."""
    E = 0x7F0000000000          # expandable reservation of device 1
    F = E + 64 * MiB            # a second mapped range, unmapped at the end
    S1 = 0x5555AAAA0000         # stream
    frames = [{'filename': 'train.py', 'line': 42, 'name': 'forward'},
              {'filename': 'torch_npu/csrc/core/npu/NPUCachingAllocator.cpp',
               'line': 1234, 'name': 'malloc'}]

    def entry(action, addr, size, dt, **extra):
        e = trace_entry(action, addr, size, T0 + dt, stream=S1)
        e['frames'] = frames          # frames may be shared (§9.2)
        e.update(extra)
        return e

    trace = [
        entry('segment_map', E, 2 * MiB, 0),
        entry('alloc', E, 1048064, 1),                 # block 1 MiB
        entry('segment_map', E + 2 * MiB, 2 * MiB, 2),
        entry('alloc', E + 1 * MiB, 2096640, 3),       # block 2 MiB across the boundary
        entry('free_requested', E, 1048064, 4),
        entry('free_completed', E, 1048064, 4),
        entry('segment_map', F, 2 * MiB, 5),
        entry('alloc', F, 4096, 6),
        entry('free_requested', F, 4096, 7),
        entry('free_completed', F, 4096, 7),
        entry('segment_unmap', F, 2 * MiB, 8),
        # Freed while a recorded stream still uses it: stays pending.
        entry('free_requested', E + 1 * MiB, 2096640, 9),
        {'action': 'oom', 'device_free': 12345, 'size': 64 * MiB,
         'stream': S1, 'time_us': T0 + 10},
        {'action': 'snapshot', 'addr': 0, 'size': 2 * MiB, 'stream': 0,
         'time_us': T0 + 11},
    ]
    segment = {
        'device': 1,
        'address': E,
        'total_size': 4 * MiB,
        'allocated_size': 0,
        'active_size': 2 * MiB,
        'requested_size': 2096640,
        'stream': S1,
        'segment_type': 'large',
        'segment_pool_id': (0, 0),
        'is_expandable': True,
        'frames': frames,
        'blocks': [
            {'address': E, 'size': 1 * MiB, 'requested_size': 1048064,
             'state': 'inactive', 'frames': frames},
            {'address': E + 1 * MiB, 'size': 2 * MiB, 'requested_size': 2096640,
             'state': 'active_pending_free', 'frames': frames},
            {'address': E + 3 * MiB, 'size': 1 * MiB, 'requested_size': 0,
             'state': 'inactive', 'frames': []},
        ],
    }
    return {
        'segments': [segment],
        'device_traces': [[], trace],
        'allocator_settings': {'trace_alloc_max_entries': 1000,
                               'trace_alloc_overflowed': False},
    }


# --- invalid cases: each changes the worked example in one way --------------

def tiling_gap() -> dict:
    """Block 1 starts 512 B after block 0 ends; the last block shrinks so the
    segment still ends where it did."""
    snap = worked_example()
    blocks = snap['segments'][0]['blocks']
    blocks[1]['address'] = SEG + 0x1400
    blocks[2]['address'] = SEG + 0x1A00
    blocks[2]['size'] -= 512
    return snap


def shared_entry_via_memo() -> dict:
    """The same `snapshot` entry object appended twice: the pickle memo turns
    the second into a back-reference."""
    snap = worked_example()
    marker = {'action': 'snapshot', 'addr': 0, 'size': 1536, 'stream': 0,
              'time_us': T0 + 100}
    snap['device_traces'][0] += [marker, marker]
    return snap


def oom_with_addr() -> dict:
    snap = worked_example()
    snap['device_traces'][0].append(
        {'action': 'oom', 'addr': 0, 'size': 4 * MiB, 'stream': STREAM,
         'time_us': T0 + 100})
    return snap


def standalone_free_requested() -> dict:
    """A second free_requested of the already freed block: no free_completed
    follows, and no active block is at that address in segments."""
    snap = worked_example()
    snap['device_traces'][0].append(trace_entry('free_requested', SEG, 4096, T0 + 100))
    return snap


def alloc_outside_segment() -> dict:
    """An alloc/free pair 4 MiB past the only segment."""
    snap = worked_example()
    outside = SEG + 4 * MiB
    snap['device_traces'][0] += [
        trace_entry('alloc', outside, 512, T0 + 100),
        trace_entry('free_requested', outside, 512, T0 + 101),
        trace_entry('free_completed', outside, 512, T0 + 101),
    ]
    return snap


def decreasing_time() -> dict:
    snap = worked_example()
    snap['device_traces'][0][2]['time_us'] = T0 + 5     # before entry 1 (T0 + 12)
    return snap


def category_key() -> dict:
    snap = worked_example()
    snap['device_traces'][0][1]['category'] = 'activation'
    return snap


def segment_alloc_wrong_base() -> dict:
    """The trace's segment_alloc names a base 0x200 above the real one."""
    snap = worked_example()
    snap['device_traces'][0][0]['addr'] = SEG + 0x200
    return snap


def segment_map_outside() -> dict:
    """A segment_map for a range no end-state segment covers (and no later
    segment_unmap re-creates)."""
    snap = worked_example()
    snap['device_traces'][0].append(
        trace_entry('segment_map', SEG + 8 * MiB, 2 * MiB, T0 + 100))
    return snap


def too_few_device_traces() -> dict:
    """The segment is on device 1 but device_traces has a single list."""
    snap = worked_example()
    snap['segments'][0]['device'] = 1
    snap['device_traces'] = [[]]
    return snap


VALID = {
    'valid_worked_example.pickle': (worked_example, 4),
    'valid_worked_example_proto2.pickle': (worked_example, 2),
    'valid_expandable_two_devices.pickle': (expandable_two_devices, 4),
}
INVALID = {
    'invalid_tiling_gap.pickle': (tiling_gap, 4),
    'invalid_shared_entry.pickle': (shared_entry_via_memo, 4),
    'invalid_proto5.pickle': (worked_example, 5),
    'invalid_oom_with_addr.pickle': (oom_with_addr, 4),
    'invalid_standalone_free_requested.pickle': (standalone_free_requested, 4),
    'invalid_alloc_outside_segment.pickle': (alloc_outside_segment, 4),
    'invalid_decreasing_time.pickle': (decreasing_time, 4),
    'invalid_category.pickle': (category_key, 4),
    'invalid_segment_alloc_wrong_base.pickle': (segment_alloc_wrong_base, 4),
    'invalid_segment_map_outside.pickle': (segment_map_outside, 4),
    'invalid_too_few_device_traces.pickle': (too_few_device_traces, 4),
}


def main() -> None:
    os.makedirs(TESTDATA_DIR, exist_ok=True)
    for name, (build, protocol) in {**VALID, **INVALID}.items():
        data = pickle.dumps(build(), protocol=protocol)
        with open(os.path.join(TESTDATA_DIR, name), 'wb') as f:
            f.write(data)
        print(f'wrote testdata/{name} ({len(data)} bytes, protocol {protocol})')


if __name__ == '__main__':
    main()
