#!/usr/bin/env python3
"""Strict, independent validator for PyTorch memory snapshots written by npuprobe.

A snapshot is the pickle that pytorch.org/memory_viz (MemoryViz.js +
process_alloc_data.js) and ``python -m torch.cuda._memory_viz`` read.  The rules
come from /work/shared/spec/snapshot-format.md ("the spec"); section numbers
below refer to it.  Standard library only: no PyTorch is needed.

Usage::

    python3 check_snapshot.py [--json-out FILE] [--expect-time]
                              [--allow-proto 2,3,4] [--require-should]
                              SNAPSHOT.pickle

Exit status: 0 = valid (one summary line on stdout), 1 = at least one problem
(one line per problem on stderr), 2 = usage error or unreadable file.

Rules enforced, with the problem code each one reports:

§9.1 pickle encoding (checked on the raw bytes, before loading)
  pickle.proto     first opcode is PROTO with a version in --allow-proto
                   (default 2,3,4; protocol 5 fails in the viewer)
  pickle.opcode    every opcode is in the viewer unpickler's whitelist
  pickle.trailing  nothing follows STOP (a torn or concatenated file)
  pickle.load      the bytes do not unpickle at all
§9.1 / §9.5 values (whole object tree)
  value.int_range  every int lies in [-2**53, 2**53] (JS Number precision)
  value.category   no dict anywhere has a ``category`` key
  value.key_type   every dict key is a str (the viewer uses JS property names)
  value.type       only dict/list/tuple/str/int/bool/float/None occur
§1-§5 schema (keys and types exactly as the spec tables)
  schema.top       top level is a dict (not the legacy bare list)
  schema.missing   a required (M) key is absent; with --require-should also S
  schema.unknown   a key the spec table does not list
  schema.type      wrong type: ints are int and not bool, bools are bool,
                   pairs are tuple (int, int), lists are lists
  schema.value     bad enum (action, state, segment_type), negative or zero
                   sizes, ``snapshot`` entry with addr != 0, ...
  schema.oom       ``oom`` has ``device_free`` and no ``addr``; other actions
                   have ``addr`` and no ``device_free``
§7 time_us
  trace.time_missing  with --expect-time every entry carries ``time_us``
  trace.time_range    ``time_us`` looks like epoch microseconds (2000..2100)
  trace.time_order    ``time_us`` never decreases within one device
§9.2 object identity (the viewer mutates these objects in place)
  identity.shared  no segment, block, trace entry or per-device trace list is
                   the same object as another one (pickle memo back-reference)
§1-§3 end state
  segment.device   0 <= seg.device < len(device_traces)
  segment.order    sorted by (device, address), no overlap within a device
  segment.tiling   blocks tile [address, address+total_size) exactly: each
                   block ``address`` equals the running sum, sum of sizes ==
                   total_size
  segment.sums     allocated_size / active_size / requested_size match the
                   block states
  block.requested  an active block's requested_size <= size
§9.3 device choice
  viewer.no_device  at least one device is offered (else the view crashes)
§9.4 "Allocator State History" backwards replay, for every offered device
  replay.rule1     every live block lies inside a live segment, in the end
                   state and after every segment event is undone
  replay.rule2     each alloc/free address lies in a segment live at that point
  replay.rule3     an unmerged free_requested finds a live block at its address
  replay.rule4     segment_alloc matches the base (and size) of a live segment
  replay.rule5     segment_map lies inside a reconstructible segment
  replay.consistency  stricter model checks the viewer does not make but a
                   correct allocator model always satisfies: an undone free
                   does not overlap a live block, an undone alloc finds its
                   block with the same requested size and not pending-free,
                   re-inserted segment ranges do not overlap live ones

Replay semantics follow MemoryViz.js (annotate_snapshot + MemoryView
simulate_memory/draw): a free_requested immediately followed by a
free_completed at the same address is merged into one ``free``; the state is
rebuilt from ``segments`` and the trace is undone newest to oldest, mirroring
the viewer's list operations (including its quirks) so later findings match
what the viewer would show.  Unlike the viewer, which never undoes entry 0, the
checker undoes every entry: a problem found only there is a model
inconsistency rather than a viewer crash.

Safety: the file is unpickled with an Unpickler whose find_class refuses every
global, so even a non-whitelisted pickle cannot run code; we still load it to
report every problem at once.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import io
import json
import pickle
import pickletools
import sys
from typing import Any, Callable, Iterable

# ---------------------------------------------------------------------------
# Constants from the spec
# ---------------------------------------------------------------------------

# §9.1: the opcodes the viewer's hand-written unpickler understands.
VIEWER_OPCODES = frozenset({
    'PROTO', 'FRAME', 'MARK', 'STOP',
    'EMPTY_DICT', 'DICT', 'SETITEM', 'SETITEMS',
    'EMPTY_LIST', 'LIST', 'APPEND', 'APPENDS',
    'EMPTY_TUPLE', 'TUPLE', 'TUPLE1', 'TUPLE2', 'TUPLE3',
    'NONE', 'NEWTRUE', 'NEWFALSE',
    'BININT', 'BININT1', 'BININT2', 'LONG1', 'BINFLOAT',
    'SHORT_BINUNICODE', 'BINUNICODE',
    'MEMOIZE', 'BINPUT', 'LONG_BINPUT', 'BINGET', 'LONG_BINGET',
})
DEFAULT_PROTOCOLS = (2, 3, 4)

# §9.1: JS Numbers are exact only up to 2**53.
JS_SAFE_INT = 2 ** 53

# §7: plausible epoch-microsecond window, 2000-01-01 .. 2100-01-01 UTC.  A value
# outside it is in the wrong unit (ns) or from the wrong clock (monotonic).
EPOCH_US_MIN = 946_684_800_000_000
EPOCH_US_MAX = 4_102_444_800_000_000

# §6
ACTIONS = frozenset({
    'alloc', 'free_requested', 'free_completed',
    'segment_alloc', 'segment_free', 'segment_map', 'segment_unmap',
    'snapshot', 'oom', 'workspace_snapshot',
})
# §3
BLOCK_STATES = frozenset({'active_allocated', 'active_pending_free', 'inactive'})
ACTIVE_STATES = frozenset({'active_allocated', 'active_pending_free'})
# §2
SEGMENT_TYPES = frozenset({'small', 'large'})

# Requirement levels of the spec tables.
MUST, SHOULD, OPTIONAL, NEVER = 'M', 'S', 'O', 'never'

# Field tables: key -> (requirement, kind).  Kinds are checked by KIND_CHECKS.
TOP_LEVEL_FIELDS = {                                  # §1
    'segments': (MUST, 'list'),
    'device_traces': (MUST, 'list'),
    'allocator_settings': (OPTIONAL, 'dict'),
    'external_annotations': (OPTIONAL, 'list'),
}
SEGMENT_FIELDS = {                                    # §2
    'device': (MUST, 'int'),
    'address': (MUST, 'int'),
    'total_size': (MUST, 'int'),
    'allocated_size': (SHOULD, 'int'),
    'active_size': (SHOULD, 'int'),
    'requested_size': (SHOULD, 'int'),
    'stream': (SHOULD, 'int'),
    'segment_type': (SHOULD, 'str'),
    'segment_pool_id': (SHOULD, 'pair'),
    'is_expandable': (SHOULD, 'bool'),
    'frames': (SHOULD, 'frames'),
    'blocks': (MUST, 'list'),
}
BLOCK_FIELDS = {                                      # §3
    'address': (SHOULD, 'int'),
    'size': (MUST, 'int'),
    'requested_size': (MUST, 'int'),
    'state': (MUST, 'str'),
    'frames': (SHOULD, 'frames'),
}
FRAME_FIELDS = {                                      # §4
    'filename': (MUST, 'str'),
    'name': (MUST, 'str'),
    'line': (SHOULD, 'int'),
    'fx_node_op': (OPTIONAL, 'str'),
    'fx_node_name': (OPTIONAL, 'str'),
    'fx_node_target': (OPTIONAL, 'str'),
    'fx_original_trace': (OPTIONAL, 'str'),
}
TRACE_ENTRY_FIELDS = {                                # §5
    'action': (MUST, 'str'),
    'addr': (MUST, 'int'),             # NEVER for oom, see entry_fields()
    'device_free': (NEVER, 'int'),     # MUST for oom, see entry_fields()
    'size': (MUST, 'int'),
    'stream': (SHOULD, 'int'),
    'time_us': (OPTIONAL, 'int'),      # S in the spec; governed by --expect-time
    'frames': (OPTIONAL, 'frames'),
    'pool_id': (OPTIONAL, 'pair'),
    'compile_context': (OPTIONAL, 'str'),
    'user_metadata': (OPTIONAL, 'str'),
    'forward_frames': (OPTIONAL, 'str_list'),
    # 'category' is reported by the value walk (value.category), not here.
}
EXTERNAL_ANNOTATION_FIELDS = {                        # §1
    'name': (MUST, 'str'),
    'stage': (MUST, 'str'),
    'device': (MUST, 'int'),
    'time_us': (MUST, 'int'),
}


def is_int(value: Any) -> bool:
    """A real Python int: pickle bools are ints too, the viewer's === is not."""
    return type(value) is int


def is_pair(value: Any) -> bool:
    return type(value) is tuple and len(value) == 2 and all(is_int(v) for v in value)


KIND_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    'int': (is_int, 'int (not bool)'),
    'str': (lambda v: type(v) is str, 'str'),
    'bool': (lambda v: type(v) is bool, 'bool'),
    'list': (lambda v: type(v) is list, 'list'),
    'dict': (lambda v: type(v) is dict, 'dict'),
    'pair': (is_pair, 'tuple (int, int)'),
    'frames': (lambda v: type(v) is list, 'list of Frame dicts'),
    'str_list': (lambda v: type(v) is list and all(type(s) is str for s in v),
                 'list of str'),
}


def entry_fields(action: Any) -> dict[str, tuple[str, str]]:
    """§5: an ``oom`` entry carries ``device_free`` instead of ``addr``."""
    if action != 'oom':
        return TRACE_ENTRY_FIELDS
    fields = dict(TRACE_ENTRY_FIELDS)
    fields['addr'] = (NEVER, 'int')
    # Required, but its absence is reported as schema.oom by check_entry so the
    # oom rule has one code; here only its type is checked.
    fields['device_free'] = (OPTIONAL, 'int')
    return fields


# ---------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Problem:
    code: str                 # stable identifier, e.g. 'replay.rule3'
    ref: str                  # spec section, e.g. '§9.4 rule 3'
    message: str
    device: int | None = None
    index: int | None = None  # raw index into device_traces[device]
    entry: Any = None         # the offending trace entry, shown abbreviated

    def format(self) -> str:
        where = ''
        if self.device is not None:
            where = f'device {self.device} '
        if self.index is not None:
            where += f'entry {self.index} '
        text = f'{self.code} ({self.ref}): {where}{self.message}'
        if self.entry is not None:
            text += f'; entry={describe_entry(self.entry)}'
        return text


def describe_entry(entry: Any) -> str:
    """A compact repr: addresses in hex, frame lists summarised."""
    if type(entry) is not dict:
        return repr(entry)
    parts = []
    for key, value in entry.items():
        if key in ('frames', 'forward_frames') and type(value) is list:
            parts.append(f'{key}=<{len(value)} items>')
        elif key == 'addr' and is_int(value):
            parts.append(f'addr={value:#x}')
        else:
            parts.append(f'{key}={value!r}')
    return '{' + ', '.join(parts) + '}'


class Report:
    """Collects problems in the order they are found."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, code: str, ref: str, message: str, **where: Any) -> None:
        self.problems.append(Problem(code, ref, message, **where))


# ---------------------------------------------------------------------------
# §9.1 raw pickle bytes
# ---------------------------------------------------------------------------

def check_encoding(data: bytes, allowed_protocols: Iterable[int], report: Report) -> bool:
    """Walk the opcodes without building objects.  Returns False if the byte
    stream is not even a well-formed pickle."""
    allowed = sorted(set(allowed_protocols))
    seen_disallowed: dict[str, int] = {}
    first = True
    stop_end = None
    try:
        for opcode, arg, pos in pickletools.genops(data):
            if first:
                first = False
                if opcode.name != 'PROTO':
                    report.add('pickle.proto', '§9.1',
                               'pickle does not start with PROTO (protocol 0/1); '
                               f'the viewer expects protocol {allowed}')
                elif arg not in allowed:
                    report.add('pickle.proto', '§9.1',
                               f'PROTO {arg} not in allowed protocols {allowed} '
                               f'(the viewer throws "Unhandled version {arg}" for >4)')
            elif opcode.name == 'PROTO':
                report.add('pickle.proto', '§9.1', f'extra PROTO opcode at byte {pos}')
            if opcode.name not in VIEWER_OPCODES and opcode.name not in seen_disallowed:
                seen_disallowed[opcode.name] = pos
            if opcode.name == 'STOP':
                stop_end = pos + 1
    except Exception as exc:  # genops raises ValueError on garbage
        report.add('pickle.load', '§9.1', f'not a well-formed pickle: {exc}')
        return False
    for name, pos in seen_disallowed.items():
        report.add('pickle.opcode', '§9.1',
                   f'opcode {name} (first at byte {pos}) is not understood by the '
                   'viewer ("UNKNOWN OPCODE")')
    if stop_end is not None and stop_end != len(data):
        report.add('pickle.trailing', '§9.1',
                   f'{len(data) - stop_end} bytes follow the STOP opcode')
    return True


class _NoGlobalsUnpickler(pickle.Unpickler):
    """The normal unpickler (so memo back-references yield shared objects, which
    the identity check needs) but unable to import anything."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f'global {module}.{name} refused')


def load_snapshot(data: bytes, report: Report) -> tuple[bool, Any]:
    try:
        return True, _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        report.add('pickle.load', '§9.1', f'pickle.load failed: {type(exc).__name__}: {exc}')
        return False, None


# ---------------------------------------------------------------------------
# §9.1 / §9.5 whole-tree value walk
# ---------------------------------------------------------------------------

_SCALAR_TYPES = (str, bool, float, type(None))
_CONTAINER_TYPES = (dict, list, tuple)


def _render_path(path: tuple | None) -> str:
    """Paths are linked (parent, key) pairs, rendered only for a problem."""
    keys = []
    while path is not None:
        path, key = path
        keys.append(f'[{key!r}]')
    return 'snapshot' + ''.join(reversed(keys))


def check_values(root: Any, report: Report) -> None:
    """Visit every container once (shared frames are common) and check the
    value domain the viewer can represent."""
    if type(root) not in _CONTAINER_TYPES:
        return  # the schema check reports a non-dict top level
    visited: set[int] = set()
    stack: list[tuple[Any, tuple | None]] = [(root, None)]
    while stack:
        container, path = stack.pop()
        if id(container) in visited:
            continue
        visited.add(id(container))
        is_dict = type(container) is dict
        for key, value in (container.items() if is_dict else enumerate(container)):
            if is_dict:
                if type(key) is not str:
                    report.add('value.key_type', '§9.1',
                               f'{_render_path(path)} has a non-str key {key!r}')
                elif key == 'category':
                    report.add('value.category', '§9.5',
                               f'{_render_path(path)} has a "category" key; the viewer '
                               'builds a legend and hits its "categores" typo')
            kind = type(value)
            if kind is int:
                if not -JS_SAFE_INT <= value <= JS_SAFE_INT:
                    report.add('value.int_range', '§9.1',
                               f'{_render_path((path, key))} = {value} is outside '
                               '[-2**53, 2**53]; the viewer loses precision (or gets a BigInt)')
            elif kind in _CONTAINER_TYPES:
                stack.append((value, (path, key)))
            elif kind not in _SCALAR_TYPES:
                report.add('value.type', '§9.1',
                           f'{_render_path((path, key))} has type {kind.__name__}, '
                           'which the viewer cannot read')


# ---------------------------------------------------------------------------
# §1-§5 schema
# ---------------------------------------------------------------------------

class SchemaChecker:
    def __init__(self, report: Report, *, expect_time: bool, require_should: bool) -> None:
        self.report = report
        self.expect_time = expect_time
        self.require_should = require_should
        # Frame lists are shared via the memo; validate each list object once.
        self._checked_frame_lists: set[int] = set()

    def check_fields(self, obj: dict, fields: dict, what: str, ref: str,
                     where: dict | None = None) -> bool:
        """Check required/forbidden/unknown keys and value kinds.  Returns True
        if every present key has the right kind and every MUST key exists."""
        where = where or {}
        ok = True
        for key, (requirement, kind) in fields.items():
            present = key in obj
            required = requirement == MUST or (requirement == SHOULD and self.require_should)
            if not present:
                if required:
                    self.report.add('schema.missing', ref,
                                    f'{what} lacks required key "{key}"', **where)
                    if requirement == MUST:
                        ok = False
                continue
            if requirement == NEVER:
                continue  # reported by the caller, which knows why
            check, expected = KIND_CHECKS[kind]
            value = obj[key]
            if not check(value):
                self.report.add('schema.type', ref,
                                f'{what}["{key}"] is {type(value).__name__} {value!r:.60}, '
                                f'expected {expected}', **where)
                ok = False
            elif kind == 'frames':
                self.check_frames(value, f'{what}["{key}"]', where)
        for key in obj:
            if key not in fields and key != 'category':
                self.report.add('schema.unknown', ref,
                                f'{what} has key "{key}" that the spec does not list', **where)
        return ok

    def check_frames(self, frames: list, what: str, where: dict) -> None:
        if id(frames) in self._checked_frame_lists:
            return
        self._checked_frame_lists.add(id(frames))
        for i, frame in enumerate(frames):
            if type(frame) is not dict:
                self.report.add('schema.type', '§4',
                                f'{what}[{i}] is {type(frame).__name__}, expected a Frame dict',
                                **where)
                continue
            self.check_fields(frame, FRAME_FIELDS, f'{what}[{i}]', '§4', where)

    def check(self, snapshot: Any) -> None:
        if type(snapshot) is not dict:
            self.report.add('schema.top', '§1',
                            f'top level is {type(snapshot).__name__}, expected a dict '
                            '(a bare list is the torch <= 1.13 legacy format)')
            return
        self.check_fields(snapshot, TOP_LEVEL_FIELDS, 'snapshot', '§1')
        segments = snapshot.get('segments')
        if type(segments) is list:
            for i, segment in enumerate(segments):
                self.check_segment(segment, i)
        traces = snapshot.get('device_traces')
        if type(traces) is list:
            for device, trace in enumerate(traces):
                if type(trace) is not list:
                    self.report.add('schema.type', '§1',
                                    f'device_traces[{device}] is {type(trace).__name__}, '
                                    'expected a list', device=device)
                    continue
                for index, entry in enumerate(trace):
                    self.check_entry(entry, device, index)
        settings = snapshot.get('allocator_settings')
        if type(settings) is dict:
            self.check_allocator_settings(settings)
        annotations = snapshot.get('external_annotations')
        if type(annotations) is list:
            for i, annotation in enumerate(annotations):
                what = f'external_annotations[{i}]'
                if type(annotation) is not dict:
                    self.report.add('schema.type', '§1', f'{what} is not a dict')
                    continue
                if self.check_fields(annotation, EXTERNAL_ANNOTATION_FIELDS, what, '§1'):
                    if annotation['stage'] not in ('START', 'END'):
                        self.report.add('schema.value', '§1',
                                        f'{what}["stage"] is {annotation["stage"]!r}, '
                                        "expected 'START' or 'END'")

    def check_allocator_settings(self, settings: dict) -> None:
        # §1: free-form, but the two 2026 keys have fixed types.
        if 'trace_alloc_max_entries' in settings:
            value = settings['trace_alloc_max_entries']
            if not is_int(value) or value < 1:
                self.report.add('schema.type', '§1',
                                'allocator_settings["trace_alloc_max_entries"] must be an '
                                f'int >= 1, got {value!r}')
        if 'trace_alloc_overflowed' in settings:
            value = settings['trace_alloc_overflowed']
            if type(value) is not bool:
                self.report.add('schema.type', '§1',
                                'allocator_settings["trace_alloc_overflowed"] must be a '
                                f'bool, got {value!r}')

    def check_segment(self, segment: Any, i: int) -> None:
        what = f'segments[{i}]'
        if type(segment) is not dict:
            self.report.add('schema.type', '§2', f'{what} is {type(segment).__name__}, expected dict')
            return
        self.check_fields(segment, SEGMENT_FIELDS, what, '§2')
        for key in ('device', 'address'):
            if is_int(segment.get(key)) and segment[key] < 0:
                self.report.add('schema.value', '§2', f'{what}["{key}"] is negative')
        for key in ('total_size', 'allocated_size', 'active_size', 'requested_size'):
            if is_int(segment.get(key)) and segment[key] < 0:
                self.report.add('schema.value', '§2', f'{what}["{key}"] is negative')
        if is_int(segment.get('total_size')) and segment['total_size'] == 0:
            self.report.add('schema.value', '§2', f'{what}["total_size"] is 0')
        if type(segment.get('segment_type')) is str and segment['segment_type'] not in SEGMENT_TYPES:
            self.report.add('schema.value', '§2',
                            f'{what}["segment_type"] is {segment["segment_type"]!r}, '
                            "expected 'small' or 'large'")
        blocks = segment.get('blocks')
        if type(blocks) is list:
            if not blocks:
                self.report.add('schema.value', '§2', f'{what} has no blocks')
            for j, block in enumerate(blocks):
                self.check_block(block, f'{what}["blocks"][{j}]')

    def check_block(self, block: Any, what: str) -> None:
        if type(block) is not dict:
            self.report.add('schema.type', '§3', f'{what} is {type(block).__name__}, expected dict')
            return
        if 'history' in block:
            self.report.add('schema.unknown', '§3',
                            f'{what} has legacy "history"; never write it in dict mode')
        self.check_fields({k: v for k, v in block.items() if k != 'history'},
                          BLOCK_FIELDS, what, '§3')
        if is_int(block.get('size')) and block['size'] <= 0:
            self.report.add('schema.value', '§3', f'{what}["size"] is {block["size"]}, expected > 0')
        if is_int(block.get('requested_size')) and block['requested_size'] < 0:
            self.report.add('schema.value', '§3', f'{what}["requested_size"] is negative')
        state = block.get('state')
        if type(state) is str and state not in BLOCK_STATES:
            hint = ' (spell it active_pending_free)' if state == 'active_awaiting_free' else ''
            self.report.add('schema.value', '§3', f'{what}["state"] is {state!r}{hint}')
        if (state in ACTIVE_STATES and is_int(block.get('size'))
                and is_int(block.get('requested_size'))
                and block['requested_size'] > block['size']):
            self.report.add('block.requested', '§3',
                            f'{what} is active but requested_size {block["requested_size"]} '
                            f'> size {block["size"]}')

    def check_entry(self, entry: Any, device: int, index: int) -> None:
        where = {'device': device, 'index': index}
        if type(entry) is not dict:
            self.report.add('schema.type', '§5', f'trace entry is {type(entry).__name__}, '
                            'expected dict', **where)
            return
        where['entry'] = entry
        action = entry.get('action')
        self.check_fields(entry, entry_fields(action), 'trace entry', '§5', where)
        if type(action) is str and action not in ACTIONS:
            self.report.add('schema.value', '§6', f'unknown action {action!r}', **where)
        if action == 'oom':
            if 'addr' in entry:
                self.report.add('schema.oom', '§5',
                                'oom entry has "addr"; it must carry "device_free" instead',
                                **where)
            if 'device_free' not in entry:
                self.report.add('schema.oom', '§5',
                                'oom entry lacks "device_free" (CLI trace KeyErrors)', **where)
        elif 'device_free' in entry:
            self.report.add('schema.oom', '§5',
                            f'"device_free" is only for oom entries, not {action!r}', **where)
        for key in ('addr', 'size', 'device_free'):
            if is_int(entry.get(key)) and entry[key] < 0:
                self.report.add('schema.value', '§5', f'"{key}" is negative', **where)
        if action == 'snapshot' and is_int(entry.get('addr')) and entry['addr'] != 0:
            self.report.add('schema.value', '§6', 'snapshot entry must have addr 0', **where)
        if 'time_us' not in entry:
            if self.expect_time:
                self.report.add('trace.time_missing', '§7',
                                'entry has no time_us (--expect-time)', **where)
        elif is_int(entry['time_us']) and not EPOCH_US_MIN <= entry['time_us'] <= EPOCH_US_MAX:
            self.report.add('trace.time_range', '§7',
                            f'time_us {entry["time_us"]} is not epoch microseconds between '
                            '2000 and 2100 (wrong unit or monotonic clock?)', **where)


# ---------------------------------------------------------------------------
# §9.2 object identity
# ---------------------------------------------------------------------------

def check_identity(snapshot: dict, report: Report) -> None:
    """The viewer edits segments, blocks and trace entries in place (stream
    renumbering, version, free_requested -> free, block addr).  A memo
    back-reference makes two of them one object, so one edit corrupts the
    other.  Frames, frame lists, strings and tuples may be shared."""
    owner_of: dict[int, str] = {}

    def claim(obj: Any, name: str, **where: Any) -> None:
        # An empty shared list (e.g. written as [[]] * n) has nothing to mutate.
        if type(obj) not in (dict, list) or not obj:
            return
        previous = owner_of.get(id(obj))
        if previous is None:
            owner_of[id(obj)] = name
        else:
            report.add('identity.shared', '§9.2',
                       f'{name} is the same object as {previous} (pickle memo '
                       'back-reference); the viewer mutates it in place', **where)

    segments = snapshot.get('segments')
    if type(segments) is list:
        for i, segment in enumerate(segments):
            claim(segment, f'segments[{i}]')
            if type(segment) is dict and type(segment.get('blocks')) is list:
                claim(segment['blocks'], f'segments[{i}]["blocks"]')
                for j, block in enumerate(segment['blocks']):
                    claim(block, f'segments[{i}]["blocks"][{j}]')
    traces = snapshot.get('device_traces')
    if type(traces) is list:
        for device, trace in enumerate(traces):
            claim(trace, f'device_traces[{device}]', device=device)
            if type(trace) is list:
                for index, entry in enumerate(trace):
                    claim(entry, f'device_traces[{device}][{index}]',
                          device=device, index=index)


# ---------------------------------------------------------------------------
# §1-§3 end state
# ---------------------------------------------------------------------------

def segment_is_well_formed(segment: Any) -> bool:
    """Enough structure for arithmetic: the schema check reports the rest."""
    if type(segment) is not dict:
        return False
    if not all(is_int(segment.get(k)) for k in ('device', 'address', 'total_size')):
        return False
    blocks = segment.get('blocks')
    if type(blocks) is not list:
        return False
    return all(type(b) is dict and is_int(b.get('size')) and b.get('size') > 0
               and is_int(b.get('requested_size')) and type(b.get('state')) is str
               for b in blocks)


def check_segments(snapshot: dict, report: Report) -> None:
    segments = snapshot.get('segments')
    traces = snapshot.get('device_traces')
    if type(segments) is not list:
        return
    trace_count = len(traces) if type(traces) is list else None
    previous = None  # (index, device, address, end) of the previous well-formed segment
    for i, segment in enumerate(segments):
        if not segment_is_well_formed(segment):
            continue
        what = f'segments[{i}]'
        device, address, total = segment['device'], segment['address'], segment['total_size']
        if trace_count is not None and not 0 <= device < trace_count:
            report.add('segment.device', '§1',
                       f'{what} is on device {device} but len(device_traces) is '
                       f'{trace_count}; it must exceed every segment device')
        if previous is not None:
            p_index, p_device, p_address, p_end = previous
            if (device, address) <= (p_device, p_address):
                report.add('segment.order', '§1',
                           f'{what} (device {device}, address {address:#x}) is not after '
                           f'segments[{p_index}] (device {p_device}, address {p_address:#x}); '
                           'sort by device, then address')
            elif device == p_device and address < p_end:
                report.add('segment.order', '§2',
                           f'{what} at {address:#x} overlaps segments[{p_index}] which ends '
                           f'at {p_end:#x}')
        previous = (i, device, address, address + total)

        # Tiling: the viewer recomputes each block address as the running sum.
        running = address
        allocated = active = requested = 0
        for j, block in enumerate(segment['blocks']):
            declared = block.get('address')
            if is_int(declared) and declared != running:
                report.add('segment.tiling', '§2',
                           f'{what}["blocks"][{j}]["address"] is {declared:#x} but the '
                           f'running sum of earlier block sizes gives {running:#x} '
                           f'({"gap" if declared > running else "overlap"} of '
                           f'{abs(declared - running)} bytes)')
            running += block['size']
            if block['state'] == 'active_allocated':
                allocated += block['size']
            if block['state'] in ACTIVE_STATES:
                active += block['size']
                requested += block['requested_size']
        if running - address != total:
            report.add('segment.tiling', '§2',
                       f'{what}: sum of block sizes {running - address} != total_size {total}')
        for key, expected in (('allocated_size', allocated), ('active_size', active),
                              ('requested_size', requested)):
            if is_int(segment.get(key)) and segment[key] != expected:
                report.add('segment.sums', '§2',
                           f'{what}["{key}"] is {segment[key]} but the blocks give {expected}')


# ---------------------------------------------------------------------------
# §7 per-device time order
# ---------------------------------------------------------------------------

def check_time_order(snapshot: dict, report: Report) -> None:
    traces = snapshot.get('device_traces')
    if type(traces) is not list:
        return
    for device, trace in enumerate(traces):
        if type(trace) is not list:
            continue
        last_time, last_index = None, None
        for index, entry in enumerate(trace):
            if type(entry) is not dict or not is_int(entry.get('time_us')):
                continue
            if last_time is not None and entry['time_us'] < last_time:
                report.add('trace.time_order', '§7',
                           f'time_us {entry["time_us"]} is before entry {last_index}\'s '
                           f'{last_time}; it must not decrease within a device',
                           device=device, index=index, entry=entry)
            last_time, last_index = entry['time_us'], index


# ---------------------------------------------------------------------------
# §9.3 device choice
# ---------------------------------------------------------------------------

def offered_devices(snapshot: dict) -> list[int]:
    """Devices in the viewer's drop-down: a non-empty trace, or a segment on
    that device, for indices that exist in device_traces."""
    traces = snapshot.get('device_traces')
    if type(traces) is not list:
        return []
    segment_devices = {s.get('device') for s in snapshot.get('segments') or []
                       if type(s) is dict and is_int(s.get('device'))}
    return [i for i, trace in enumerate(traces)
            if (type(trace) is list and len(trace) > 0) or i in segment_devices]


# ---------------------------------------------------------------------------
# §9.4 Allocator State History replay
# ---------------------------------------------------------------------------

# Appended where a misplaced live block makes draw() dereference a null segment.
DRAW_CRASH = ' (the viewer throws TypeError when it draws this state)'

REPLAYED_ACTIONS = frozenset({
    'alloc', 'free_requested', 'free_completed',
    'segment_alloc', 'segment_free', 'segment_map', 'segment_unmap',
})


@dataclasses.dataclass
class ReplayEvent:
    """One line of the viewer's event list (after the free merge)."""
    index: int                 # raw index of the (first) entry
    action: str                # 'free' for a merged pair
    entry: dict
    merged_index: int | None = None   # raw index of the merged free_completed

    @property
    def addr(self) -> int:
        return self.entry['addr']

    @property
    def size(self) -> int:
        return self.entry['size']


@dataclasses.dataclass
class LiveSegment:
    addr: int
    size: int
    stream: Any

    @property
    def end(self) -> int:
        return self.addr + self.size


@dataclasses.dataclass(eq=False)
class LiveBlock:
    addr: int
    size: int             # what the viewer draws: block size, or event size
    requested: int        # request size, compared with the alloc event's size
    pending: bool         # freed but waiting on stream events
    origin: str           # where it came from, for messages

    @property
    def end(self) -> int:
        return self.addr + self.size


def merge_free_pairs(trace: list) -> list[ReplayEvent]:
    """annotate_snapshot: a free_completed whose immediate predecessor in the
    event list is a free_requested at the same address turns that predecessor
    into 'free' and disappears."""
    events: list[ReplayEvent] = []
    for index, entry in enumerate(trace):
        action = entry['action']
        if action == 'free_completed' and events:
            previous = events[-1]
            if previous.action == 'free_requested' and previous.addr == entry['addr']:
                previous.action = 'free'
                previous.merged_index = index
                continue
        events.append(ReplayEvent(index, action, entry))
    return events


def entry_is_replayable(entry: Any) -> bool:
    if type(entry) is not dict or type(entry.get('action')) is not str:
        return False
    if entry['action'] in REPLAYED_ACTIONS:
        return is_int(entry.get('addr')) and is_int(entry.get('size'))
    return True


class LiveBlocks:
    """The viewer's l_block_map (keyed by address) plus a sorted address index
    for overlap queries."""

    def __init__(self) -> None:
        self.by_addr: dict[int, LiveBlock] = {}
        self.addrs: list[int] = []

    def get(self, addr: int) -> LiveBlock | None:
        return self.by_addr.get(addr)

    def put(self, block: LiveBlock) -> None:
        if block.addr not in self.by_addr:
            bisect.insort(self.addrs, block.addr)
        self.by_addr[block.addr] = block

    def remove(self, addr: int) -> None:
        if addr in self.by_addr:
            del self.by_addr[addr]
            del self.addrs[bisect.bisect_left(self.addrs, addr)]

    def overlapping(self, addr: int, size: int) -> list[LiveBlock]:
        """Live blocks that intersect [addr, addr+size), or start at addr."""
        found = []
        pos = bisect.bisect_left(self.addrs, addr)
        if pos > 0:
            before = self.by_addr[self.addrs[pos - 1]]
            if before.end > addr:
                found.append(before)
        while pos < len(self.addrs) and (self.addrs[pos] < addr + size or self.addrs[pos] == addr):
            found.append(self.by_addr[self.addrs[pos]])
            pos += 1
        return found

    def __iter__(self):
        return iter(self.by_addr.values())


class DeviceReplay:
    """Replays one device's trace backwards from the end state."""

    def __init__(self, device: int, device_segments: list[dict], trace: list[dict],
                 report: Report) -> None:
        self.device = device
        self.report = report
        self.events = merge_free_pairs(trace)
        # The viewer's l_segments, in its list order (which matters for the
        # merge in map_segment); lookups go through a sorted copy like draw().
        self.segments: list[LiveSegment] = []
        self._sorted_segments: list[LiveSegment] | None = None
        self.blocks = LiveBlocks()
        # Blocks already reported as misplaced, so one bad block is reported once.
        self._reported_blocks: set[int] = set()

        for segment in device_segments:
            self.segments.append(LiveSegment(segment['address'], segment['total_size'],
                                             segment.get('stream')))
            # Only active blocks are live; addresses are the running sum.
            addr = segment['address']
            for block in segment['blocks']:
                if block['state'] in ACTIVE_STATES:
                    self.blocks.put(LiveBlock(
                        addr, block['size'], block['requested_size'],
                        block['state'] == 'active_pending_free',
                        f'end-state block at {addr:#x} ({block["state"]})'))
                addr += block['size']
        self.segments.sort(key=lambda s: s.addr)  # JS sort is stable too

    # -- reporting ---------------------------------------------------------

    def problem(self, code: str, rule: str, message: str, event: ReplayEvent | None = None) -> None:
        where: dict[str, Any] = {'device': self.device}
        if event is not None:
            where['index'] = event.index
            where['entry'] = event.entry
            if event.merged_index is not None:
                message += f' (merged with free_completed at entry {event.merged_index})'
        self.report.add(code, rule, message, **where)

    # -- segment lookups -----------------------------------------------------

    def segments_changed(self) -> None:
        self._sorted_segments = None

    def find_segment(self, addr: int) -> LiveSegment | None:
        """draw()'s find_segment: binary search over segments sorted by addr."""
        if self._sorted_segments is None:
            self._sorted_segments = sorted(self.segments, key=lambda s: s.addr)
        ordered = self._sorted_segments
        left, right = 0, len(ordered) - 1
        while left <= right:
            mid = (left + right) // 2
            if addr < ordered[mid].addr:
                right = mid - 1
            elif addr >= ordered[mid].end:
                left = mid + 1
            else:
                return ordered[mid]
        return None

    def placement_error(self, addr: int, size: int) -> str | None:
        segment = self.find_segment(addr)
        if segment is None:
            return 'lies outside every live segment'
        if addr + size > segment.end:
            return (f'extends {addr + size - segment.end} bytes past the end of its segment '
                    f'[{segment.addr:#x}, {segment.end:#x})')
        return None

    def check_blocks(self, blocks: Iterable[LiveBlock], when: str,
                     event: ReplayEvent | None) -> None:
        for block in blocks:
            if id(block) in self._reported_blocks:
                continue
            error = self.placement_error(block.addr, block.size)
            if error:
                self._reported_blocks.add(id(block))
                self.problem('replay.rule1', '§9.4 rule 1',
                             f'{when}: live block [{block.addr:#x}, +{block.size}) from '
                             f'{block.origin} {error}{DRAW_CRASH}', event)

    # -- the viewer's segment list operations --------------------------------

    def map_segment(self, merge: bool, segment: LiveSegment) -> None:
        """Undo of segment_free (merge=False) or segment_unmap (merge=True)."""
        idx = next((i for i, s in enumerate(self.segments) if s.addr > segment.addr), -1)
        if not merge:
            # JS splice(-1, 0, x) inserts before the last element, not at the end.
            position = idx if idx >= 0 else max(len(self.segments) - 1, 0)
            self.segments.insert(position, segment)
            return
        if idx == -1:
            idx = len(self.segments)
        self.segments.insert(idx, segment)
        if idx + 1 < len(self.segments):
            following = self.segments[idx + 1]
            if segment.end == following.addr and segment.stream == following.stream:
                segment.size += following.size
                del self.segments[idx + 1]
        if idx > 0:
            preceding = self.segments[idx - 1]
            if preceding.end == segment.addr and preceding.stream == segment.stream:
                preceding.size += segment.size
                del self.segments[idx]

    def unmap_segment_range(self, event: ReplayEvent) -> bool:
        """Undo of segment_map: carve the range out of the segment holding it.
        Returns False where the viewer would throw."""
        start, end = event.addr, event.addr + event.size
        idx = next((i for i, s in enumerate(self.segments)
                    if s.addr <= start and end <= s.end), -1)
        if idx == -1:
            return False
        existing = self.segments[idx]
        existing_end = existing.end
        if existing.addr == start:
            existing.addr += event.size
            existing.size -= event.size
            if existing.size == 0:
                del self.segments[idx]
        elif existing_end == end:
            existing.size -= event.size
        else:
            existing.size = start - existing.addr
            self.segments.insert(idx + 1, LiveSegment(end, existing_end - end,
                                                      event.entry.get('stream')))
        return True

    # -- the replay ------------------------------------------------------------

    def run(self) -> None:
        # The initial selection is the last event: the end state is drawn as is.
        self.check_blocks(self.blocks, 'in the end state', None)
        for event in reversed(self.events):
            self.undo(event)

    def undo(self, event: ReplayEvent) -> None:
        action = event.action
        if action in ('free', 'free_completed'):
            self.undo_free(event)
        elif action == 'free_requested':
            block = self.blocks.get(event.addr)
            if block is None:
                self.problem('replay.rule3', '§9.4 rule 3',
                             f'free_requested at {event.addr:#x} is not followed by its '
                             'free_completed and no live block is at this address (no later '
                             'free_completed, no active_pending_free/active_allocated block '
                             'in segments); the viewer throws TypeError', event)
                return
            block.pending = False
        elif action == 'alloc':
            self.undo_alloc(event)
        elif action in ('segment_free', 'segment_unmap'):
            self.undo_segment_release(event)
        elif action == 'segment_alloc':
            self.undo_segment_alloc(event)
        elif action == 'segment_map':
            self.undo_segment_map(event)
        # snapshot, oom, workspace_snapshot: the viewer ignores them.

    def undo_free(self, event: ReplayEvent) -> None:
        error = self.placement_error(event.addr, event.size)
        if error:
            self.problem('replay.rule2', '§9.4 rule 2',
                         f'{event.action} at {event.addr:#x} (size {event.size}) {error}'
                         f'{DRAW_CRASH}', event)
        for other in self.blocks.overlapping(event.addr, event.size):
            self.problem('replay.consistency', '§9.4 rule 6',
                         f'undoing this {event.action} re-creates [{event.addr:#x}, '
                         f'+{event.size}) but it overlaps the live block [{other.addr:#x}, '
                         f'+{other.size}) from {other.origin}', event)
        block = LiveBlock(event.addr, event.size, event.size,
                          pending=(event.action == 'free_completed'),
                          origin=f'entry {event.index} ({event.action})')
        if error:
            self._reported_blocks.add(id(block))
        self.blocks.put(block)

    def undo_alloc(self, event: ReplayEvent) -> None:
        block = self.blocks.get(event.addr)
        error = self.placement_error(event.addr, event.size)
        # A block already reported (by its free, or as orphaned) is not reported
        # again for its alloc.
        if error and (block is None or id(block) not in self._reported_blocks):
            self.problem('replay.rule2', '§9.4 rule 2',
                         f'alloc at {event.addr:#x} (size {event.size}) {error}', event)
        if block is None:
            self.problem('replay.consistency', '§9.4 rule 6',
                         f'alloc at {event.addr:#x} has no live block when undone: its free is '
                         'missing from the trace, or segments lack the active block', event)
            return
        if block.pending:
            self.problem('replay.consistency', '§9.4 rule 6',
                         f'block at {event.addr:#x} from {block.origin} is still pending-free '
                         'when its alloc is undone: a free_requested is missing', event)
        if block.requested != event.size:
            self.problem('replay.consistency', '§6',
                         f'alloc size {event.size} differs from the requested size '
                         f'{block.requested} of the block from {block.origin}', event)
        self.blocks.remove(event.addr)

    def undo_segment_release(self, event: ReplayEvent) -> None:
        start, end = event.addr, event.addr + event.size
        for segment in self.segments:
            if segment.addr < end and start < segment.end:
                self.problem('replay.consistency', '§9.4 rule 5',
                             f'undoing this {event.action} re-inserts [{start:#x}, {end:#x}) '
                             f'but it overlaps the live segment [{segment.addr:#x}, '
                             f'{segment.end:#x})', event)
        self.map_segment(event.action == 'segment_unmap',
                         LiveSegment(start, event.size, event.entry.get('stream')))
        self.segments_changed()

    def undo_segment_alloc(self, event: ReplayEvent) -> None:
        idx = next((i for i, s in enumerate(self.segments) if s.addr == event.addr), -1)
        if idx == -1:
            self.problem('replay.rule4', '§9.4 rule 4',
                         f'segment_alloc at {event.addr:#x} matches no live segment base; '
                         'the viewer silently removes its last segment instead', event)
            if not self.segments:
                return
            idx = len(self.segments) - 1  # what the viewer's splice(-1, 1) removes
        elif self.segments[idx].size != event.size:
            self.problem('replay.rule4', '§9.4 rule 4',
                         f'segment_alloc size {event.size} differs from the live segment '
                         f'at {event.addr:#x} of size {self.segments[idx].size}', event)
        removed = self.segments.pop(idx)
        self.segments_changed()
        # Only blocks in the removed range can have lost their segment.
        self.check_blocks(self.blocks.overlapping(removed.addr, removed.size),
                          'after undoing this segment_alloc', event)

    def undo_segment_map(self, event: ReplayEvent) -> None:
        if not self.unmap_segment_range(event):
            self.problem('replay.rule5', '§9.4 rule 5',
                         f'segment_map [{event.addr:#x}, +{event.size}) lies inside no '
                         'segment reconstructible at this point; the viewer throws TypeError',
                         event)
            return
        self.segments_changed()
        self.check_blocks(self.blocks.overlapping(event.addr, event.size),
                          'after undoing this segment_map', event)


def check_replay(snapshot: dict, report: Report) -> list[int]:
    """Runs the replay for every offered device; returns the offered devices."""
    devices = offered_devices(snapshot)
    if type(snapshot.get('device_traces')) is list and not devices:
        report.add('viewer.no_device', '§9.3',
                   'no device is offered (every trace is empty and no segment is on a '
                   'listed device); the viewer crashes')
    segments = snapshot.get('segments')
    if type(segments) is not list:
        return devices
    for device in devices:
        # The viewer compares seg.device === device: a bool never matches.
        device_segments = [s for s in segments
                           if type(s) is dict and is_int(s.get('device')) and s['device'] == device]
        trace = snapshot['device_traces'][device]
        # Malformed input was reported by the schema check; replaying it would
        # only produce follow-on noise.
        if not all(segment_is_well_formed(s) for s in device_segments):
            continue
        if not all(entry_is_replayable(e) for e in trace):
            continue
        DeviceReplay(device, device_segments, trace, report).run()
    return devices


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class CheckResult:
    loaded: bool
    snapshot: Any
    problems: list[Problem]

    @property
    def codes(self) -> set[str]:
        return {p.code for p in self.problems}

    def summary(self) -> str:
        snapshot = self.snapshot
        segments = snapshot.get('segments', []) if type(snapshot) is dict else []
        traces = snapshot.get('device_traces', []) if type(snapshot) is dict else []
        entries = sum(len(t) for t in traces if type(t) is list)
        return f'ok: {len(segments)} segments, {entries} trace entries on {len(traces)} devices'


def check_bytes(data: bytes, *, expect_time: bool = False,
                allowed_protocols: Iterable[int] = DEFAULT_PROTOCOLS,
                require_should: bool = False) -> CheckResult:
    report = Report()
    if not check_encoding(data, allowed_protocols, report):
        return CheckResult(False, None, report.problems)
    loaded, snapshot = load_snapshot(data, report)
    if not loaded:
        return CheckResult(False, None, report.problems)
    check_values(snapshot, report)
    SchemaChecker(report, expect_time=expect_time, require_should=require_should).check(snapshot)
    if type(snapshot) is dict:
        check_identity(snapshot, report)
        check_segments(snapshot, report)
        check_time_order(snapshot, report)
        check_replay(snapshot, report)
    return CheckResult(True, snapshot, report.problems)


def check_file(path: str, **options: Any) -> CheckResult:
    with open(path, 'rb') as f:
        return check_bytes(f.read(), **options)


def write_json(snapshot: Any, path: str) -> None:
    """Tuples become lists (json does that); key order is kept."""
    text = json.dumps(snapshot, allow_nan=False, separators=(',', ':'))
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text)
        f.write('\n')


def parse_protocols(text: str) -> tuple[int, ...]:
    try:
        protocols = tuple(int(p) for p in text.split(',') if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f'not a comma-separated list of ints: {text!r}')
    if not protocols:
        raise argparse.ArgumentTypeError('no protocol given')
    return protocols


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description='Validate a PyTorch memory snapshot pickle against the npuprobe spec.')
    parser.add_argument('snapshot', metavar='SNAPSHOT.pickle')
    parser.add_argument('--json-out', metavar='FILE',
                        help='also write the loaded snapshot as JSON (tuples as lists)')
    parser.add_argument('--expect-time', action='store_true',
                        help='require time_us on every trace entry')
    parser.add_argument('--allow-proto', type=parse_protocols, default=DEFAULT_PROTOCOLS,
                        metavar='2,3,4', help='accepted pickle protocols (default 2,3,4)')
    parser.add_argument('--require-should', action='store_true',
                        help="also require every 'S' (should) key of the spec tables "
                             '(time_us stays governed by --expect-time)')
    args = parser.parse_args(argv)

    try:
        result = check_file(args.snapshot, expect_time=args.expect_time,
                            allowed_protocols=args.allow_proto,
                            require_should=args.require_should)
    except OSError as exc:
        print(f'check_snapshot: cannot read {args.snapshot}: {exc}', file=sys.stderr)
        return 2

    problems = list(result.problems)
    if args.json_out and result.loaded:
        try:
            write_json(result.snapshot, args.json_out)
        except (TypeError, ValueError) as exc:
            problems.append(Problem('json.encode', '--json-out',
                                    f'cannot write JSON: {exc}'))
        except OSError as exc:
            print(f'check_snapshot: cannot write {args.json_out}: {exc}', file=sys.stderr)
            return 2

    for problem in problems:
        print(f'{args.snapshot}: {problem.format()}', file=sys.stderr)
    if problems:
        return 1
    print(result.summary())
    return 0


if __name__ == '__main__':
    sys.exit(main())
