package e2e

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/npuprobe/npuprobe/snapshot"
	"github.com/npuprobe/npuprobe/tests/fixture"
)

// TestAugmentTorchSnapshot: npuprobe traces tensor_workload; at the same
// point the workload writes torch_npu's own pickle (no time_us) and
// npuprobe its snapshot; `npuprobe augment` fills time_us into the torch_npu
// pickle. Every entry npuprobe recorded gets exactly the recording's
// time_us (the correspondence is known independently: the recording equals
// the ground truth restricted to what a tracer attached at that moment can
// see), the others follow the unmatched rule, and the output passes the
// checker with --expect-time and loads in python3 and gopickle alike.
func TestAugmentTorchSnapshot(t *testing.T) {
	cases := []struct {
		name        string
		agentArgs   []string
		args        []string
		allRecorded bool // attached before the first allocation, at tensor level
	}{
		{"tensor level from the start", nil, []string{"--pattern", "transformer", "--steps", "6", "--streams", "2", "--pre-attach-steps", "0"}, true},
		{"tensor level mid-run", nil, []string{"--pattern", "transformer", "--steps", "8", "--pre-attach-steps", "3"}, false},
		{"tensor level mid-run churn with oom", nil, []string{"--pattern", "churn", "--steps", "2000", "--seed", "5", "--pre-attach-steps", "600"}, false},
		{"segment level mid-run churn with oom", []string{"--level", "segment"}, []string{"--pattern", "churn", "--steps", "2000", "--seed", "9", "--pre-attach-steps", "600"}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := startProgram(t, fixtures.TensorWorkload, fixtures.TorchEnv(fixtures.TorchSymtabDir), "", c.args...)
			pre := dumpTorchGroundTruth(t, w)
			a := startAgent(t, append([]string{"--pid", fmt.Sprint(w.pid), "--out", t.TempDir(), "--status-interval", "100ms"}, c.agentArgs...)...)
			w.send("go")
			w.expectLine("done", 5*time.Minute)
			recPath := a.snapshot()
			torchPath := filepath.Join(t.TempDir(), "torch_npu.pickle")
			w.send("dumppickle " + torchPath)
			w.expectLine("dumped", time.Minute)
			final := dumpTorchGroundTruth(t, w)

			outPath := filepath.Join(t.TempDir(), "augmented.pickle")
			cmd := exec.Command(npuprobe, "augment", "--torch-snapshot", torchPath, "--recording", recPath, "-o", outPath)
			msg, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("npuprobe augment: %v\n%s", err, msg)
			}
			t.Logf("npuprobe augment:\n%s", msg)

			torch, err := snapshot.ReadFile(torchPath)
			if err != nil {
				t.Fatal(err)
			}
			rec, err := snapshot.ReadFile(recPath)
			if err != nil {
				t.Fatal(err)
			}
			out, err := snapshot.ReadFile(outPath)
			if err != nil {
				t.Fatal(err)
			}
			segmentLevel := len(c.agentArgs) > 0
			checkLevelOf(t, rec, map[bool]string{true: "segment", false: "tensor"}[segmentLevel])
			if len(torch.DeviceTraces[0]) != len(final.DeviceTraces[0]) {
				t.Fatalf("torch_npu pickle has %d entries, the ground truth %d", len(torch.DeviceTraces[0]), len(final.DeviceTraces[0]))
			}

			// The recording's counterpart of each torch_npu entry. At
			// segment level npuprobe records an oom per failed runtime
			// allocation, torch_npu one after its last retry (the retries
			// follow releasing cached segments): of recorded ooms separated
			// only by segment frees, the last is the counterpart.
			recorded := recordedEntries(t, pre, final, segmentLevel)
			recTr := rec.DeviceTraces[0]
			var recIdx []int
			for k := range recTr {
				if recTr[k].Action == "oom" {
					next := k + 1
					for next < len(recTr) && recTr[next].Action == "segment_free" {
						next++
					}
					if next < len(recTr) && recTr[next].Action == "oom" {
						continue
					}
				}
				recIdx = append(recIdx, k)
			}
			if len(recorded) != len(recIdx) {
				var b strings.Builder
				for _, e := range recTr {
					fmt.Fprintf(&b, "\n  rec %s %#x %d", e.Action, e.AddrOrFree(), e.Size)
				}
				for _, i := range recorded {
					g := final.DeviceTraces[0][i]
					fmt.Fprintf(&b, "\n  gt[%d] %s %#x/%d %d", i, g.Action, g.Addr, g.DeviceFree, g.Size)
				}
				t.Log(b.String())
				t.Fatalf("the recording has %d entries (%d without repeated ooms), the ground truth says %d are visible to it",
					len(recTr), len(recIdx), len(recorded))
			}
			partner := map[int]int{}
			for n, i := range recorded {
				k := recIdx[n]
				g := final.DeviceTraces[0][i]
				if recTr[k].Action != g.Action || (g.Action != "oom" && recTr[k].Addr.V != int64(g.Addr)) {
					t.Fatalf("recording entry %d is %s %#x, ground truth entry %d is %s %#x", k, recTr[k].Action, recTr[k].Addr.V, i, g.Action, g.Addr)
				}
				partner[i] = k
			}

			outTr := out.DeviceTraces[0]
			matched, unmatched := 0, 0
			prevMatched := int64(-1)
			var pending []int // unmatched entries since the last matched one
			for i, e := range outTr {
				if !e.TimeUs.Set {
					t.Fatalf("entry %d has no time_us", i)
				}
				if i > 0 && e.TimeUs.V < outTr[i-1].TimeUs.V {
					t.Fatalf("time_us decreases at entry %d", i)
				}
				k, ok := partner[i]
				if !ok {
					unmatched++
					pending = append(pending, i)
					continue
				}
				matched++
				if e.TimeUs.V != recTr[k].TimeUs.V {
					t.Fatalf("entry %d (%s %#x size %d) has time_us %d, its recording entry %d has %d",
						i, e.Action, e.AddrOrFree(), e.Size, e.TimeUs.V, k, recTr[k].TimeUs.V)
				}
				// The unmatched rule: those since the previous match lie
				// between the two matched times (at the first match: equal to it).
				for _, u := range pending {
					lo := prevMatched
					if lo < 0 {
						lo = e.TimeUs.V
					}
					if outTr[u].TimeUs.V < lo || outTr[u].TimeUs.V > e.TimeUs.V {
						t.Fatalf("unmatched entry %d has %d, outside [%d, %d]", u, outTr[u].TimeUs.V, lo, e.TimeUs.V)
					}
				}
				pending, prevMatched = pending[:0], e.TimeUs.V
			}
			for _, u := range pending {
				if outTr[u].TimeUs.V != prevMatched {
					t.Fatalf("entry %d after the last match has %d, want the last match's %d", u, outTr[u].TimeUs.V, prevMatched)
				}
			}
			t.Logf("%d entries: %d recorded by npuprobe and given its time_us, %d unmatched", len(outTr), matched, unmatched)
			if matched == 0 || (c.allRecorded && unmatched != 0) {
				t.Errorf("%d matched, %d unmatched", matched, unmatched)
			}

			// What augment reports equals this count.
			var report struct {
				Matched        int64 `json:"matched"`
				MatchedRelaxed int64 `json:"matched_relaxed"`
				Interpolated   int64 `json:"interpolated"`
				Extrapolated   int64 `json:"extrapolated"`
			}
			snap := loadSnapshot(t, outPath) // check_snapshot --expect-time, python3 pickle, gopickle
			snap.Setting(t, "npuprobe_augment", &report)
			if int(report.Matched+report.MatchedRelaxed) != matched || int(report.Interpolated+report.Extrapolated) != unmatched {
				t.Errorf("augment reports %+v; %d entries were recorded, %d not", report, matched, unmatched)
			}
			if !strings.Contains(string(msg), fmt.Sprintf("%d trace entries: %d matched exactly, %d matched on action and address",
				len(outTr), report.Matched, report.MatchedRelaxed)) {
				t.Errorf("augment's summary does not give the counts:\n%s", msg)
			}
		})
	}
}

func checkLevelOf(t *testing.T, s *snapshot.Snapshot, want string) {
	t.Helper()
	if v, _ := s.Setting("npuprobe_level"); v != want {
		t.Fatalf("recording at level %v, want %s", v, want)
	}
}

// recordedEntries returns, in order, the indices of the final ground
// truth's device-0 entries that npuprobe, attached when pre was dumped,
// records: at tensor level, restrictToPostAttach's entries (those of
// segments created after attach, and ooms); at segment level, every
// segment entry and oom after attach.
func recordedEntries(t *testing.T, pre, final *fixture.TorchGroundTruth, segmentLevel bool) []int {
	t.Helper()
	preLen := 0
	if len(pre.DeviceTraces) > 0 {
		preLen = len(pre.DeviceTraces[0])
	}
	trace := final.DeviceTraces[0]
	var out []int
	if segmentLevel {
		for i := preLen; i < len(trace); i++ {
			switch trace[i].Action {
			case "segment_alloc", "segment_free", "oom":
				out = append(out, i)
			}
		}
		return out
	}
	out, _ = postAttachEntries(trace, preLen, make(map[uint64]*gtSegment))
	return out
}
