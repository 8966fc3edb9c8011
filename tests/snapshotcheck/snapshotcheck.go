// Package snapshotcheck runs check_snapshot.py, the standard-library Python
// validator for PyTorch memory snapshot pickles, from Go tests.
//
// The rules live in check_snapshot.py (see its module docstring and
// /work/shared/spec/snapshot-format.md); this package only locates the script,
// runs it with python3 and collects its verdict, so Go code can validate
// pickles and read their content as JSON without a pickle library.
package snapshotcheck

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
)

// Options mirror the checker's command-line flags.
type Options struct {
	ExpectTime    bool  // --expect-time: every trace entry must carry time_us
	RequireShould bool  // --require-should: every 'S' key of the spec tables is required
	AllowProto    []int // --allow-proto; nil means the checker's default 2,3,4
	WantJSON      bool  // --json-out: return the loaded snapshot as JSON
}

// Result is the checker's verdict on one snapshot.
type Result struct {
	OK       bool     // exit status 0
	Summary  string   // "ok: N segments, M trace entries on K devices" when OK
	Problems []string // one line per problem when not OK
	JSON     []byte   // the snapshot as JSON (tuples as lists) if WantJSON and it loaded
}

// ScriptPath returns the absolute path of check_snapshot.py.
func ScriptPath() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "check_snapshot.py")
}

// Check validates the pickle at snapshotPath.  A snapshot that breaks rules
// is not an error: it yields OK == false and the problems.  An error means
// the checker could not run (no python3, unreadable file, crash).
func Check(ctx context.Context, snapshotPath string, opts Options) (*Result, error) {
	python, err := exec.LookPath("python3")
	if err != nil {
		return nil, fmt.Errorf("snapshotcheck needs python3 (standard library only) in PATH: %w", err)
	}
	args := []string{ScriptPath()}
	if opts.ExpectTime {
		args = append(args, "--expect-time")
	}
	if opts.RequireShould {
		args = append(args, "--require-should")
	}
	if opts.AllowProto != nil {
		protos := make([]string, len(opts.AllowProto))
		for i, p := range opts.AllowProto {
			protos[i] = strconv.Itoa(p)
		}
		args = append(args, "--allow-proto", strings.Join(protos, ","))
	}
	var jsonPath string
	if opts.WantJSON {
		dir, err := os.MkdirTemp("", "snapshotcheck-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		jsonPath = filepath.Join(dir, "snapshot.json")
		args = append(args, "--json-out", jsonPath)
	}
	args = append(args, snapshotPath)

	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, python, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	runErr := cmd.Run()

	result := &Result{}
	var exitErr *exec.ExitError
	switch {
	case runErr == nil:
		result.OK = true
		result.Summary = strings.TrimSpace(stdout.String())
	case errors.As(runErr, &exitErr) && exitErr.ExitCode() == 1:
		result.Problems = strings.Split(strings.TrimRight(stderr.String(), "\n"), "\n")
	default:
		return nil, fmt.Errorf("check_snapshot.py %s: %v\n%s", snapshotPath, runErr, stderr.String())
	}
	if jsonPath != "" {
		if data, err := os.ReadFile(jsonPath); err == nil {
			result.JSON = data
		}
	}
	return result, nil
}
