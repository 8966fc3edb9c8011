package agent

import "errors"

// Kinds of Error, for errors.Is.
var (
	ErrNoProcess     = errors.New("no such process")
	ErrNoRuntime     = errors.New("no CANN runtime mapped")
	ErrPrivilege     = errors.New("not enough privilege")
	ErrKernelFeature = errors.New("kernel feature missing")
	ErrNoSymbols     = errors.New("symbols not found")
)

// Error is a problem a user can meet and fix. Its message is one line:
// what went wrong, the cause, then what to do about it.
type Error struct {
	Kind error  // one of the Err* kinds above
	What string // what went wrong, naming the thing involved
	Err  error  // underlying cause, if any
	Fix  string // what the user can do
}

func (e *Error) Error() string {
	msg := e.What
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	if e.Fix != "" {
		msg += " (" + e.Fix + ")"
	}
	return msg
}

func (e *Error) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrNoProcess) and friends work.
func (e *Error) Is(target error) bool { return target == e.Kind }
