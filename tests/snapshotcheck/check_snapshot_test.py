"""Tests for check_snapshot.py: it accepts the valid snapshots and rejects each
invalid one for the right reason (exactly the expected problem codes, nothing
else).  Run: ``cd tests/snapshotcheck && python3 -m unittest -v``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import check_snapshot  # noqa: E402
import make_testdata  # noqa: E402
from make_testdata import MiB, SEG, STREAM, T0, trace_entry, worked_example  # noqa: E402

TESTDATA = os.path.join(HERE, 'testdata')
CHECKER = os.path.join(HERE, 'check_snapshot.py')


def check(snapshot, protocol=4, **options):
    return check_snapshot.check_bytes(pickle.dumps(snapshot, protocol=protocol), **options)


def run_cli(*args):
    return subprocess.run([sys.executable, CHECKER, *args],
                          capture_output=True, text=True, timeout=60)


class TestdataInSyncTest(unittest.TestCase):
    """The committed files are what make_testdata.py builds."""

    def test_files_match_generator(self):
        for name, (build, protocol) in {**make_testdata.VALID, **make_testdata.INVALID}.items():
            with self.subTest(name=name):
                with open(os.path.join(TESTDATA, name), 'rb') as f:
                    data = f.read()
                self.assertEqual(data[:2], bytes([0x80, protocol]), 'PROTO opcode')
                self.assertEqual(pickle.loads(data), build(),
                                 'stale file: rerun python3 make_testdata.py')


class ValidFilesTest(unittest.TestCase):

    def test_valid_files_have_no_problems(self):
        for name in make_testdata.VALID:
            with self.subTest(name=name):
                result = check_snapshot.check_file(os.path.join(TESTDATA, name),
                                                   expect_time=True, require_should=True)
                self.assertEqual([p.format() for p in result.problems], [])

    def test_cli_accepts_worked_example(self):
        proc = run_cli('--expect-time', os.path.join(TESTDATA, 'valid_worked_example.pickle'))
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), 'ok: 1 segments, 5 trace entries on 1 devices')
        self.assertEqual(proc.stderr, '')

    def test_json_out_matches_snapshot_with_tuples_as_lists(self):
        for name, (build, _) in make_testdata.VALID.items():
            with self.subTest(name=name), tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, 'snap.json')
                proc = run_cli('--json-out', out, os.path.join(TESTDATA, name))
                self.assertEqual(proc.returncode, 0, proc.stderr)
                with open(out, encoding='utf-8') as f:
                    written = json.load(f)
                expected = json.loads(json.dumps(build()))  # tuples -> lists
                self.assertEqual(written, expected)
                self.assertEqual(written['segments'][0]['segment_pool_id'], [0, 0])

    def test_pending_free_and_interleaved_frees_are_valid(self):
        """Two blocks freed with interleaved free_requested/free_completed: no
        pair is adjacent, so nothing merges, and every unmerged
        free_requested finds the block its later free_completed re-created."""
        snap = worked_example()
        blocks = snap['segments'][0]['blocks']
        blocks[1]['state'] = 'inactive'
        snap['segments'][0].update(allocated_size=0, active_size=0, requested_size=0)
        snap['device_traces'][0] += [
            trace_entry('free_requested', SEG + 0x1200, 1000, T0 + 100),
            trace_entry('snapshot', 0, 0, T0 + 101, stream=0),
            trace_entry('free_completed', SEG + 0x1200, 1000, T0 + 102),
        ]
        self.assertEqual(check(snap, expect_time=True).problems, [])


class InvalidFilesTest(unittest.TestCase):
    # file -> (exact set of problem codes, (device, entry index) of the first
    # problem or None when it is not about one entry)
    EXPECTED = {
        'invalid_tiling_gap.pickle': ({'segment.tiling'}, None),
        'invalid_shared_entry.pickle': ({'identity.shared'}, (0, 6)),
        'invalid_proto5.pickle': ({'pickle.proto'}, None),
        'invalid_oom_with_addr.pickle': ({'schema.oom'}, (0, 5)),
        'invalid_standalone_free_requested.pickle': ({'replay.rule3'}, (0, 5)),
        'invalid_alloc_outside_segment.pickle': ({'replay.rule2'}, (0, 6)),
        'invalid_decreasing_time.pickle': ({'trace.time_order'}, (0, 2)),
        'invalid_category.pickle': ({'value.category'}, None),
        'invalid_segment_alloc_wrong_base.pickle': ({'replay.rule4'}, (0, 0)),
        'invalid_segment_map_outside.pickle': ({'replay.rule5'}, (0, 5)),
        'invalid_too_few_device_traces.pickle': ({'segment.device', 'viewer.no_device'}, None),
    }

    def test_every_invalid_file_has_an_expectation(self):
        self.assertEqual(set(self.EXPECTED), set(make_testdata.INVALID))

    def test_invalid_files_fail_for_the_right_reason(self):
        for name, (codes, location) in self.EXPECTED.items():
            with self.subTest(name=name):
                result = check_snapshot.check_file(os.path.join(TESTDATA, name))
                self.assertEqual(result.codes, codes, [p.format() for p in result.problems])
                if location is not None:
                    first = result.problems[0]
                    self.assertEqual((first.device, first.index), location)

    def test_cli_exits_1_with_one_line_per_problem(self):
        for name, (codes, _) in self.EXPECTED.items():
            with self.subTest(name=name):
                path = os.path.join(TESTDATA, name)
                proc = run_cli(path)
                self.assertEqual(proc.returncode, 1)
                self.assertEqual(proc.stdout, '')
                lines = proc.stderr.splitlines()
                self.assertTrue(lines)
                for line in lines:
                    self.assertTrue(line.startswith(f'{path}: '), line)
                    self.assertIn(line[len(path) + 2:].split(' ')[0], codes)

    def test_allow_proto_option(self):
        proto5 = os.path.join(TESTDATA, 'invalid_proto5.pickle')
        self.assertEqual(run_cli('--allow-proto', '2,3,4,5', proto5).returncode, 0)
        proto2 = os.path.join(TESTDATA, 'valid_worked_example_proto2.pickle')
        proc = run_cli('--allow-proto', '4', proto2)
        self.assertEqual(proc.returncode, 1)
        self.assertIn('pickle.proto', proc.stderr)

    def test_cli_usage_errors_exit_2(self):
        self.assertEqual(run_cli(os.path.join(TESTDATA, 'no-such-file.pickle')).returncode, 2)
        self.assertEqual(run_cli('--allow-proto', 'x', 'f').returncode, 2)


class EncodingTest(unittest.TestCase):
    """§9.1 checks on the raw bytes."""

    def test_bytes_value_uses_a_non_whitelisted_opcode(self):
        snap = worked_example()
        snap['allocator_settings'] = {'blob': b'\x00\x01'}
        result = check(snap)
        self.assertIn('pickle.opcode', result.codes)
        self.assertIn('BINBYTES', ' '.join(p.message for p in result.problems))

    def test_set_value_uses_a_non_whitelisted_opcode(self):
        snap = worked_example()
        snap['allocator_settings'] = {'pools': {1, 2}}
        self.assertIn('pickle.opcode', check(snap).codes)

    def test_globals_are_reported_and_never_imported(self):
        snap = worked_example()
        snap['allocator_settings'] = {'f': os.getcwd}
        result = check(snap)
        self.assertIn('pickle.opcode', result.codes)
        self.assertIn('pickle.load', result.codes)  # find_class refused it

    def test_trailing_bytes(self):
        data = pickle.dumps(worked_example(), protocol=4) + b'\x00\x00'
        self.assertEqual(check_snapshot.check_bytes(data).codes, {'pickle.trailing'})

    def test_protocol_1_has_no_proto_opcode(self):
        self.assertIn('pickle.proto', check(worked_example(), protocol=1).codes)

    def test_garbage_is_reported_not_raised(self):
        for data in (b'', b'not a pickle', b'\x80\x04\x95'):
            with self.subTest(data=data):
                result = check_snapshot.check_bytes(data)
                self.assertFalse(result.loaded)
                self.assertIn('pickle.load', result.codes)


class ValueAndSchemaTest(unittest.TestCase):

    def test_int_beyond_2_pow_53(self):
        snap = worked_example()
        snap['segments'][0]['stream'] = 2 ** 60
        self.assertEqual(check(snap).codes, {'value.int_range'})

    def test_bool_device_is_not_an_int(self):
        snap = worked_example()
        snap['segments'][0]['device'] = False
        result = check(snap)
        self.assertIn('schema.type', result.codes)
        # The viewer's === hides the segment from device 0, so its replay fails too.
        self.assertIn('replay.rule4', result.codes)

    def test_pool_id_must_be_a_tuple(self):
        snap = worked_example()
        snap['segments'][0]['segment_pool_id'] = [0, 0]
        self.assertEqual(check(snap).codes, {'schema.type'})

    def test_legacy_list_top_level(self):
        self.assertEqual(check([]).codes, {'schema.top'})

    def test_missing_device_traces(self):
        snap = worked_example()
        del snap['device_traces']
        self.assertEqual(check(snap).codes, {'schema.missing'})

    def test_unknown_key(self):
        snap = worked_example()
        snap['segments'][0]['blocks'][0]['requested'] = 1
        self.assertEqual(check(snap).codes, {'schema.unknown'})

    def test_legacy_history_on_block(self):
        snap = worked_example()
        snap['segments'][0]['blocks'][1]['history'] = [{'addr': SEG, 'real_size': 1000,
                                                        'frames': []}]
        self.assertEqual(check(snap).codes, {'schema.unknown'})

    def test_awaiting_free_spelling(self):
        snap = worked_example()
        snap['segments'][0]['blocks'][1]['state'] = 'active_awaiting_free'
        result = check(snap)
        self.assertIn('schema.value', result.codes)

    def test_unknown_action(self):
        snap = worked_example()
        snap['device_traces'][0].append(trace_entry('user_annotation', 0, 0, T0 + 100))
        self.assertEqual(check(snap).codes, {'schema.value'})

    def test_frame_needs_filename_and_name(self):
        snap = worked_example()
        snap['device_traces'][0][1]['frames'] = [{'filename': 'a.py', 'line': 1}]
        self.assertEqual(check(snap).codes, {'schema.missing'})

    def test_should_keys_required_only_on_request(self):
        snap = worked_example()
        del snap['segments'][0]['stream']
        self.assertEqual(check(snap).problems, [])
        self.assertEqual(check(snap, require_should=True).codes, {'schema.missing'})

    def test_expect_time(self):
        snap = worked_example()
        del snap['device_traces'][0][3]['time_us']
        self.assertEqual(check(snap).problems, [])
        result = check(snap, expect_time=True)
        self.assertEqual(result.codes, {'trace.time_missing'})
        self.assertEqual(result.problems[0].index, 3)

    def test_time_from_monotonic_clock(self):
        snap = worked_example()
        for i, entry in enumerate(snap['device_traces'][0]):
            entry['time_us'] = 1000 + i
        self.assertEqual(check(snap).codes, {'trace.time_range'})

    def test_snapshot_entry_addr_must_be_0(self):
        snap = worked_example()
        snap['device_traces'][0].append(trace_entry('snapshot', 16, 1536, T0 + 100, stream=0))
        self.assertEqual(check(snap).codes, {'schema.value'})


class IdentityTest(unittest.TestCase):

    def test_shared_block_object(self):
        snap = worked_example()
        blocks = snap['segments'][0]['blocks']
        blocks[2] = blocks[0]  # also breaks tiling; identity must be among the reasons
        self.assertIn('identity.shared', check(snap).codes)

    def test_shared_frames_are_fine(self):
        snap = worked_example()
        frames = [{'filename': 'a.py', 'line': 1, 'name': 'f'}]
        for entry in snap['device_traces'][0]:
            entry['frames'] = frames
        for block in snap['segments'][0]['blocks']:
            block['frames'] = frames
        self.assertEqual(check(snap).problems, [])


class EndStateTest(unittest.TestCase):

    def test_sums_must_match_block_states(self):
        snap = worked_example()
        snap['segments'][0]['allocated_size'] = 4608 + 1536
        self.assertEqual(check(snap).codes, {'segment.sums'})

    def test_segments_sorted_by_device_then_address(self):
        snap = worked_example()
        second = worked_example()['segments'][0]
        second['address'] = SEG - 4 * MiB
        for block in second['blocks']:
            block['address'] -= 4 * MiB
        snap['segments'].append(second)
        self.assertEqual(check(snap).codes, {'segment.order'})

    def test_active_block_request_larger_than_block(self):
        snap = worked_example()
        snap['segments'][0]['blocks'][1]['requested_size'] = 2000
        snap['segments'][0]['requested_size'] = 2000
        self.assertIn('block.requested', check(snap).codes)

    def test_no_device_offered(self):
        self.assertEqual(check({'segments': [], 'device_traces': [[]]}).codes,
                         {'viewer.no_device'})


class ReplayTest(unittest.TestCase):
    """§9.4 beyond the files in testdata/."""

    def test_alloc_before_its_segment_alloc_orphans_the_block(self):
        snap = worked_example()
        trace = snap['device_traces'][0]
        trace[0], trace[1] = trace[1], trace[0]
        trace[0]['time_us'], trace[1]['time_us'] = T0, T0 + 12
        result = check(snap)
        self.assertEqual(result.codes, {'replay.rule1'})
        self.assertEqual(result.problems[0].index, 1)  # the segment_alloc that orphans it

    def test_trace_on_a_device_without_its_segment(self):
        """The segment is on device 0 but its trace sits on device 1: device 1
        is offered, and its replay re-creates the freed block outside any
        segment."""
        snap = worked_example()
        snap['device_traces'] = [[], snap['device_traces'][0]]
        result = check(snap)
        self.assertIn('replay.rule2', result.codes)
        self.assertEqual({p.device for p in result.problems}, {1})

    def test_alloc_without_block_is_a_consistency_problem(self):
        snap = worked_example()
        snap['device_traces'][0].append(trace_entry('alloc', SEG + 0x1800, 100, T0 + 100))
        self.assertEqual(check(snap).codes, {'replay.consistency'})

    def test_alloc_size_must_match_the_freed_size(self):
        snap = worked_example()
        snap['device_traces'][0][1]['size'] = 4000
        self.assertEqual(check(snap).codes, {'replay.consistency'})

    def test_segment_alloc_size_mismatch(self):
        snap = worked_example()
        snap['device_traces'][0][0]['size'] = 4 * MiB
        self.assertEqual(check(snap).codes, {'replay.rule4'})

    def test_segment_free_then_realloc_is_valid(self):
        """A segment freed and a new one allocated at the same base: undoing
        segment_free re-inserts the old range, undoing segment_alloc removes it."""
        snap = worked_example()
        trace = snap['device_traces'][0]
        first = [trace_entry('segment_alloc', SEG, 2097152, T0 - 50),
                 trace_entry('alloc', SEG, 512, T0 - 40),
                 trace_entry('free_requested', SEG, 512, T0 - 30),
                 trace_entry('free_completed', SEG, 512, T0 - 30),
                 trace_entry('segment_free', SEG, 2097152, T0 - 20)]
        snap['device_traces'][0] = first + trace
        self.assertEqual(check(snap, expect_time=True).problems, [])

    def test_segment_free_overlapping_a_live_segment(self):
        snap = worked_example()
        snap['device_traces'][0].append(trace_entry('segment_free', SEG + MiB, 2097152, T0 + 100))
        self.assertIn('replay.consistency', check(snap).codes)

    def test_merge_needs_the_same_address(self):
        """free_requested A then free_completed B do not merge: the
        free_requested at A then needs a live block, and there is none."""
        snap = worked_example()
        snap['device_traces'][0][4]['addr'] = SEG + 0x1200
        self.assertIn('replay.rule3', check(snap).codes)


if __name__ == '__main__':
    unittest.main()
