package main

// The snapshot tools: augment, merge, stats and plot. They read any memory
// snapshot pickle (package snapshot); a file that is not one gets one
// error line and exit status 1.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"

	"github.com/npuprobe/npuprobe/output"
	"github.com/npuprobe/npuprobe/snapshot"
)

// parseToolFlags parses a tool's flags and returns its positional
// arguments, printing help on --help and one line on error.
func parseToolFlags(fs *pflag.FlagSet, args []string, minArgs, maxArgs int, what string, stdout, stderr io.Writer) ([]string, int, bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			fmt.Fprintf(stdout, "Usage of npuprobe %s:\n%s", fs.Name(), fs.FlagUsages())
			return nil, exitOK, false
		}
		fmt.Fprintf(stderr, "npuprobe: %v (see npuprobe %s --help)\n", err, fs.Name())
		return nil, exitUsage, false
	}
	rest := fs.Args()
	if len(rest) < minArgs {
		fmt.Fprintf(stderr, "npuprobe %s: missing %s (see npuprobe %s --help)\n", fs.Name(), what, fs.Name())
		return nil, exitUsage, false
	}
	if maxArgs >= 0 && len(rest) > maxArgs {
		fmt.Fprintf(stderr, "npuprobe %s: unexpected argument %q (see npuprobe %s --help)\n", fs.Name(), rest[maxArgs], fs.Name())
		return nil, exitUsage, false
	}
	return rest, exitOK, true
}

func requireFlag(stderr io.Writer, cmd, flag, value string) bool {
	if value == "" || strings.HasSuffix(value, "/") {
		fmt.Fprintf(stderr, "npuprobe %s: --%s FILE is required (see npuprobe %s --help)\n", cmd, flag, cmd)
		return false
	}
	return true
}

func runAugment(args []string, stdout, stderr io.Writer) int {
	var torchFile, recFile, out string
	fs := newFlags("augment", stderr)
	fs.StringVar(&torchFile, "torch-snapshot", "", "snapshot written by torch_npu (_dump_snapshot, or its C++ OOM dump); no time_us")
	fs.StringVar(&recFile, "recording", "", "npuprobe snapshot of the same process covering that window")
	fs.StringVarP(&out, "out", "o", "", "file to write: the torch_npu snapshot with time_us on every entry (replaced if it exists)")
	if _, code, ok := parseToolFlags(fs, args, 0, 0, "", stdout, stderr); !ok {
		return code
	}
	if !requireFlag(stderr, "augment", "torch-snapshot", torchFile) || !requireFlag(stderr, "augment", "recording", recFile) ||
		!requireFlag(stderr, "augment", "out", out) {
		return exitUsage
	}
	torch, err := snapshot.ReadFile(torchFile)
	if err != nil {
		return fail(stderr, err)
	}
	rec, err := snapshot.ReadFile(recFile)
	if err != nil {
		return fail(stderr, err)
	}
	aug, report, err := snapshot.Augment(torch, rec, filepath.Base(recFile))
	if err != nil {
		return fail(stderr, fmt.Errorf("%s and %s: %w", torchFile, recFile, err))
	}
	if err := snapshot.WriteFile(out, aug); err != nil {
		return fail(stderr, err)
	}
	fmt.Fprintf(stdout, "augment: recording at %s level; %s\n", report.RecordingLevel, report.Summary())
	fmt.Fprintf(stdout, "unmatched entries: %s\n", snapshot.UnmatchedRule)
	fmt.Fprintf(stdout, "wrote %s\n", out)
	return exitOK
}

func runMerge(args []string, stdout, stderr io.Writer) int {
	var out string
	fs := newFlags("merge", stderr)
	fs.StringVarP(&out, "out", "o", "", "file to write: one snapshot with a device per rank (replaced if it exists)")
	files, code, ok := parseToolFlags(fs, args, 1, -1, "the snapshot files to merge", stdout, stderr)
	if !ok {
		return code
	}
	if !requireFlag(stderr, "merge", "out", out) {
		return exitUsage
	}
	var inputs []snapshot.MergeInput
	for _, f := range files {
		s, err := snapshot.ReadFile(f)
		if err != nil {
			return fail(stderr, err)
		}
		inputs = append(inputs, snapshot.MergeInput{Name: filepath.Base(f), Snap: s})
	}
	merged, report, err := snapshot.Merge(inputs)
	if err != nil {
		return fail(stderr, err)
	}
	if err := snapshot.WriteFile(out, merged); err != nil {
		return fail(stderr, err)
	}
	if report.Order == "rank" {
		fmt.Fprintf(stdout, "merge: %d files, devices in rank order\n", len(files))
	} else {
		fmt.Fprintf(stdout, "merge: %d files, devices in argument order (%s)\n", len(files), report.Why)
	}
	for _, d := range report.Devices {
		rank := "no rank"
		if d.Rank >= 0 {
			rank = fmt.Sprintf("rank %d", d.Rank)
		}
		fmt.Fprintf(stdout, "  device %d: %s, %s device %d\n", d.Device, rank, d.Source, d.SourceDevice)
	}
	fmt.Fprintf(stdout, "wrote %s\n", out)
	return exitOK
}

func runStats(args []string, stdout, stderr io.Writer) int {
	var asJSON bool
	fs := newFlags("stats", stderr)
	fs.BoolVar(&asJSON, "json", false, "print the numbers as JSON")
	files, code, ok := parseToolFlags(fs, args, 1, 1, "the snapshot file", stdout, stderr)
	if !ok {
		return code
	}
	s, err := snapshot.ReadFile(files[0])
	if err != nil {
		return fail(stderr, err)
	}
	st := snapshot.ComputeStats(s)
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(st); err != nil {
			return fail(stderr, err)
		}
		return exitOK
	}
	st.WriteText(stdout, files[0])
	return exitOK
}

func runPlot(args []string, stdout, stderr io.Writer) int {
	var out string
	fs := newFlags("plot", stderr)
	fs.StringVarP(&out, "out", "o", "", "HTML file to write (self-contained, replaced if it exists)")
	files, code, ok := parseToolFlags(fs, args, 1, 1, "the snapshot file", stdout, stderr)
	if !ok {
		return code
	}
	if !requireFlag(stderr, "plot", "out", out) {
		return exitUsage
	}
	s, err := snapshot.ReadFile(files[0])
	if err != nil {
		return fail(stderr, err)
	}
	dir, err := output.OpenDir(filepath.Dir(out))
	if err != nil {
		return fail(stderr, fmt.Errorf("cannot write %s: %w", out, err))
	}
	defer dir.Close()
	path, err := dir.ReplaceFile(filepath.Base(out), func(w io.Writer) error { return snapshot.Plot(w, s, filepath.Base(files[0])) })
	if err != nil {
		return fail(stderr, err)
	}
	fmt.Fprintf(stdout, "wrote %s\n", path)
	return exitOK
}
