#!/usr/bin/env python3
"""The Python side of bench/'s snapshot-writing benchmark.

Builds, from the JSON that npubench wrote, the same dict npuprobe's
output.WriteSnapshot pickles (same keys in the same order; pool ids are
tuples; the action, state and segment-type strings interned and one
(0, 0) tuple shared, so that pickle memoizes them as npuprobe's encoder
does), then times only pickle.dump(d, f, protocol=4) into a file, in
process, REPS times. Prints one JSON line: median and all times, file size.

With --verify OURS.pickle it first checks that pickle.load of npuprobe's
file equals this dict, so both sides really write the same object.
"""
import argparse
import json
import os
import pickle
import statistics
import sys
import time


def build(path):
    with open(path) as f:
        d = json.load(f)
    pool = (0, 0)
    pools = {}

    def tup(v):
        t = tuple(v)
        if t == pool:
            return pool
        return pools.setdefault(t, t)

    for seg in d["segments"]:
        seg["segment_type"] = sys.intern(seg["segment_type"])
        seg["segment_pool_id"] = tup(seg["segment_pool_id"])
        for b in seg["blocks"]:
            b["state"] = sys.intern(b["state"])
    for trace in d["device_traces"]:
        for e in trace:
            e["action"] = sys.intern(e["action"])
            e["pool_id"] = tup(e["pool_id"])
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--verify")
    a = ap.parse_args()
    d = build(a.json)
    if a.verify:
        with open(a.verify, "rb") as f:
            ours = pickle.load(f)
        if ours != d:
            for k in d:
                if ours.get(k) != d[k]:
                    print(f"pickle_dump.py: npuprobe's file differs from the JSON dict at {k!r}", file=sys.stderr)
            sys.exit(1)
        del ours
    times = []
    for _ in range(a.reps):
        with open(a.out, "wb") as f:
            t0 = time.perf_counter()
            pickle.dump(d, f, protocol=4)
            t1 = time.perf_counter()
        times.append(t1 - t0)
    print(json.dumps({
        "python": sys.version.split()[0],
        "median_s": statistics.median(times),
        "times_s": times,
        "bytes": os.path.getsize(a.out),
    }))


if __name__ == "__main__":
    main()
