#!/usr/bin/env python3
"""Writes memory snapshot pickles made by Python's own pickle for the tests
of package snapshot: ``python3 make_pickles.py OUTDIR``.

good_cuda_p2.pickle, good_cuda_p4.pickle
    a CUDA-style snapshot (two devices, frames shared between entries,
    time_us, allocator_settings, external_annotations, compile_context)
    pickled with protocol 2 and 4; it passes check_snapshot.py --expect-time
good_exotic_p2.pickle, good_exotic_p4.pickle
    a small snapshot whose allocator_settings hold every value kind
    (None, floats, negative and 64-bit ints, tuples of 1..5 items, an int
    dict key, nested lists and dicts), and an unknown top-level key
good_torchnpu_p4.pickle
    torch_npu's Python _dump_snapshot shape: no time_us, no
    allocator_settings, pool_id tuples, a workspace_snapshot triple
bad_*.pickle / bad_*.json
    one broken file per error class the reader must report (see
    snapshot/read_test.go for the expected messages)
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys

SEG = 0x12C040000000
STREAM = 0xAAAAD1E2F3A0
T0 = 1767225600000000
MiB = 1 << 20


def frames(*names):
    return [{'filename': f'/src/model_{n}.py', 'name': n, 'line': 10 + i}
            for i, n in enumerate(names)]


def cuda_snapshot():
    fr = frames('forward', 'linear')          # shared by several dicts, as torch does
    seg0 = {
        'device': 0, 'address': SEG, 'total_size': 2 * MiB,
        'allocated_size': 1536, 'active_size': 1536, 'requested_size': 1000,
        'stream': 0, 'segment_type': 'small', 'segment_pool_id': (0, 0),
        'is_expandable': False, 'frames': fr,
        'blocks': [
            {'address': SEG, 'size': 4608, 'requested_size': 4096, 'state': 'inactive', 'frames': []},
            {'address': SEG + 0x1200, 'size': 1536, 'requested_size': 1000,
             'state': 'active_allocated', 'frames': fr},
            {'address': SEG + 0x1800, 'size': 2 * MiB - 0x1800, 'requested_size': 0,
             'state': 'inactive', 'frames': []},
        ],
    }
    seg1 = {
        'device': 1, 'address': SEG + 64 * MiB, 'total_size': 20 * MiB,
        'allocated_size': 0, 'active_size': 0, 'requested_size': 0,
        'stream': 7, 'segment_type': 'large', 'segment_pool_id': (0, 0),
        'is_expandable': False, 'frames': [],
        'blocks': [{'address': SEG + 64 * MiB, 'size': 20 * MiB, 'requested_size': 0,
                    'state': 'inactive', 'frames': []}],
    }

    def e(action, addr, size, dt, stream=0, **kw):
        d = {'action': action, 'addr': addr, 'size': size, 'stream': stream,
             'time_us': T0 + dt, 'compile_context': 'N/A', 'user_metadata': ''}
        d.update(kw)
        return d

    dev0 = [
        e('segment_alloc', SEG, 2 * MiB, 0, frames=fr),
        e('alloc', SEG, 4096, 12, frames=fr),
        e('alloc', SEG + 0x1200, 1000, 40, frames=fr),
        e('free_requested', SEG, 4096, 95, frames=fr),
        e('free_completed', SEG, 4096, 95, frames=fr),
    ]
    oom = {'action': 'oom', 'device_free': 123 * MiB, 'size': 40 * MiB, 'stream': 7,
           'time_us': T0 + 300}
    dev1 = [
        e('segment_alloc', SEG + 64 * MiB, 20 * MiB, 100, stream=7),
        oom,
    ]
    return {
        'segments': [seg0, seg1],
        'device_traces': [dev0, dev1],
        'allocator_settings': {
            'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:False',
            'max_split_size': -1,
            'garbage_collection_threshold': 0.0,
            'expandable_segments': False,
            'release_lock_on_cudamalloc': False,
            'pinned_use_host_register': False,
            'roundup_power2_divisions': {'1': 4, '>': 8},
            'trace_alloc_max_entries': 1000000,
            'trace_alloc_overflowed': False,
        },
        'external_annotations': [
            {'name': 'forward', 'stage': 'START', 'device': 0, 'time_us': T0 + 1},
            {'name': 'forward', 'stage': 'END', 'device': 0, 'time_us': T0 + 90},
        ],
    }


def exotic_snapshot():
    s = {
        'segments': [],
        'device_traces': [[]],
        'allocator_settings': {
            'none': None, 'float': -2.5, 'neg': -7, 'big': 2 ** 52 + 3, 'minus_big': -(2 ** 40),
            'int32': -(2 ** 31), 'u16': 65535, 't1': (1,), 't3': (1, 'a', 2.5), 't5': (1, 2, 3, 4, 5),
            'empty_tuple': (), 'pair': (3, 4), 'mixed_pair': ('x', 1),
            'nested': {'list': [1, [2, [3]], {'k': 'v'}], 'dict': {}},
            7: 'int key', 'unicode': 'µs — ✓',
            'long': 'x' * 300,
        },
        'future_key': {'anything': [True, False]},
    }
    return s


def torchnpu_snapshot():
    ws = SEG + 512 * MiB

    def e(action, addr, size, stream=STREAM):
        return {'action': action, 'addr': addr, 'size': size, 'stream': stream, 'pool_id': (0, 0)}

    return {
        'segments': [
            {'device': 0, 'address': SEG, 'total_size': 2 * MiB, 'allocated_size': 1536,
             'active_size': 1536, 'requested_size': 1000, 'stream': STREAM, 'segment_type': 'small',
             'segment_pool_id': (0, 0), 'is_expandable': False, 'frames': [],
             'blocks': [
                 {'address': SEG, 'size': 1536, 'requested_size': 1000, 'state': 'active_allocated', 'frames': []},
                 {'address': SEG + 1536, 'size': 2 * MiB - 1536, 'requested_size': 0, 'state': 'inactive', 'frames': []},
             ]},
            {'device': 0, 'address': ws, 'total_size': 4 * MiB, 'allocated_size': 4 * MiB,
             'active_size': 4 * MiB, 'requested_size': 4 * MiB, 'stream': STREAM, 'segment_type': 'large',
             'segment_pool_id': (0, 0), 'is_expandable': False, 'frames': [],
             'blocks': [{'address': ws, 'size': 4 * MiB, 'requested_size': 4 * MiB,
                         'state': 'active_allocated', 'frames': []}]},
        ],
        'device_traces': [[
            e('workspace_snapshot', ws, 4 * MiB), e('segment_alloc', ws, 4 * MiB), e('alloc', ws, 4 * MiB),
            e('segment_alloc', SEG, 2 * MiB), e('alloc', SEG, 1000),
        ]],
    }


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)

    def write(name, data):
        with open(os.path.join(out, name), 'wb') as f:
            f.write(data)

    for proto in (2, 4):
        write(f'good_cuda_p{proto}.pickle', pickle.dumps(cuda_snapshot(), protocol=proto))
        write(f'good_exotic_p{proto}.pickle', pickle.dumps(exotic_snapshot(), protocol=proto))
    write('good_torchnpu_p4.pickle', pickle.dumps(torchnpu_snapshot(), protocol=4))

    good = pickle.dumps(cuda_snapshot(), protocol=4)
    write('bad_truncated.pickle', good[:len(good) // 2])
    write('bad_truncated_header.pickle', good[:1])
    write('bad_empty.pickle', b'')
    write('bad_proto5.pickle', pickle.dumps(cuda_snapshot(), protocol=5))
    write('bad_proto1.pickle', pickle.dumps(cuda_snapshot(), protocol=1))
    write('bad_garbage.pickle', bytes(range(7, 71)))
    write('bad_trailing.pickle', good + b'more')
    write('bad_json.json', json.dumps({'segments': [], 'device_traces': []}).encode())
    write('bad_class.pickle', pickle.dumps({'segments': [], 'device_traces': [],
                                            'when': datetime.date(2026, 1, 1)}, protocol=4))
    write('bad_bytes.pickle', pickle.dumps({'segments': [], 'device_traces': [], 'b': b'xy'}, protocol=4))
    write('bad_legacy_list.pickle', pickle.dumps(cuda_snapshot()['segments'], protocol=4))
    write('bad_not_dict.pickle', pickle.dumps('hello', protocol=4))
    write('bad_no_traces.pickle', pickle.dumps({'segments': []}, protocol=4))
    s = cuda_snapshot()
    s['device_traces'][0][1]['size'] = '4096'
    write('bad_size_str.pickle', pickle.dumps(s, protocol=4))
    s = cuda_snapshot()
    del s['segments'][1]['blocks'][0]['state']
    write('bad_no_state.pickle', pickle.dumps(s, protocol=4))
    s = cuda_snapshot()
    del s['device_traces'][1][1]['device_free']
    write('bad_oom_no_free.pickle', pickle.dumps(s, protocol=4))
    s = cuda_snapshot()
    s['device_traces'][0][0]['addr'] = 2 ** 70
    write('bad_huge_int.pickle', pickle.dumps(s, protocol=4))


if __name__ == '__main__':
    main()
